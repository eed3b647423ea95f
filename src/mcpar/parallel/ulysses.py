"""Ulysses attention over the context axis: trade sequence shards for head shards and back.

Each context rank holds the zigzag shard of every sequence (chunks ``i`` and ``2n-1-i`` of ``2n``)
for all heads. One all-to-all gives each rank the whole sequence for ``heads / n`` heads; the
chunks are put back in position order, causal attention runs locally on the full sequence, and the
opposite all-to-all returns each rank its own tokens for all heads. The all-to-all is an autograd
function whose backward is the same all-to-all (with equal chunks it is its own adjoint), issued
through the Communicator on the 'cp' axis.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcpar.comm.communicator import Communicator


class _AllToAll(torch.autograd.Function):
    """``x`` [n, ...]: part j goes to axis rank j; the result's part j came from axis rank j."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm: Communicator,  # type: ignore[override]
                axis: str) -> torch.Tensor:
        ctx.comm, ctx.axis = comm, axis
        return _exchange(x, comm, axis)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _exchange(grad, ctx.comm, ctx.axis), None, None


def _exchange(x: torch.Tensor, comm: Communicator, axis: str) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all_single(out.view(-1), x.view(-1), axis=axis)
    return out


def _sequence_to_heads(x: torch.Tensor, comm: Communicator, axis: str) -> torch.Tensor:
    """[b, h, 2c, d] zigzag shard -> [b, h/n, 2nc, d], the whole sequence in position order."""
    n = comm.axis_size(axis)
    b, h, local, d = x.shape
    c = local // 2
    parts = x.view(b, n, h // n, local, d).transpose(0, 1)  # part j: heads of rank j
    got = _AllToAll.apply(parts, comm, axis)  # [n (source rank), b, h/n, 2c, d]
    got = got.view(n, b, h // n, 2, c, d)
    # Chunk j (< n) is rank j's first half; chunk 2n-1-j is rank j's second half.
    first = got[:, :, :, 0].permute(1, 2, 0, 3, 4)  # [b, h/n, n, c, d]
    second = got[:, :, :, 1].flip(0).permute(1, 2, 0, 3, 4)
    return torch.cat([first, second], dim=2).reshape(b, h // n, 2 * n * c, d)


def _heads_to_sequence(y: torch.Tensor, comm: Communicator, axis: str) -> torch.Tensor:
    """The inverse of ``_sequence_to_heads``: [b, h/n, 2nc, d] -> [b, h, 2c, d] zigzag shard."""
    n = comm.axis_size(axis)
    b, hn, total, d = y.shape
    c = total // (2 * n)
    chunks = y.view(b, hn, 2 * n, c, d)
    first = chunks[:, :, :n].permute(2, 0, 1, 3, 4)  # [n (destination), b, h/n, c, d]
    second = chunks[:, :, n:].flip(2).permute(2, 0, 1, 3, 4)
    parts = torch.stack([first, second], dim=3)  # [n, b, h/n, 2, c, d]
    got = _AllToAll.apply(parts, comm, axis)  # [n (head group), b, h/n, 2, c, d]
    return got.permute(1, 0, 2, 3, 4, 5).reshape(b, n * hn, 2 * c, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Communicator,
                      axis: str = "cp") -> torch.Tensor:
    """Causal attention of zigzag-sharded q, k, v [b, h, 2c, d]; h divisible by the axis."""
    full = [_sequence_to_heads(t, comm, axis) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*full, is_causal=True)
    return _heads_to_sequence(out, comm, axis)
