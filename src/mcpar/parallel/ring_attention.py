"""Ring attention over the context axis: the K/V blocks of ``mcpar.ring_blocks`` carried around
the 'cp' ranks by the Communicator.

The blocks' math, the zigzag and why every rank's work is the same are in ``ring_blocks``; this
module is the ring itself: rank ``i`` sends to ``i + 1`` and receives from ``i - 1`` with the
Communicator's point-to-point calls (so the bytes are in its books), each block's receive posted
before the previous block's attention so that the transfer overlaps with it.
"""

from __future__ import annotations

import torch

from mcpar.comm.communicator import CommHandle, Communicator
from mcpar.ring_blocks import ring_blocks


class CommRing:
    """The ring of one attention call on the Communicator's ``axis``: which block a rank holds
    at each step and the asynchronous sends and receives that move blocks (and their gradients)
    one rank on (``ring_blocks.Ring``)."""

    def __init__(self, comm: Communicator, axis: str):
        self.comm, self.axis = comm, axis
        self.size = comm.axis_size(axis)
        self.rank = comm.axis_rank(axis)
        self.next = (self.rank + 1) % self.size
        self.prev = (self.rank - 1) % self.size

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        return (self.rank - step) % self.size

    def shift(self, block: torch.Tensor, tag: int) -> tuple[CommHandle, CommHandle,
                                                            torch.Tensor]:
        """Start sending ``block`` to the next rank and receiving the previous rank's; the
        caller waits both handles before reading the received tensor (or reusing ``block``)."""
        received = torch.empty_like(block)
        recv = self.comm.irecv(received, self.prev, axis=self.axis, tag=tag)
        send = self.comm.send(block, self.next, axis=self.axis, tag=tag)
        return send, recv, received


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                   axis: str = "cp", layout: str = "zigzag") -> torch.Tensor:
    """Causal attention over the context group of zigzag-sharded q, k, v [b, h, 2c, d]
    (``layout="contiguous"``: rank i holding the i-th of n pieces, for the bench)."""
    return ring_blocks(q, k, v, CommRing(comm, axis), layout)
