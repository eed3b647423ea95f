"""One rank's share of ring attention: the blocks its queries meet, and the autograd function
that computes them as a ring hands them over.

With ``n`` context ranks the sequence is cut into ``2n`` chunks of ``c`` tokens and rank ``i``
holds chunks ``i`` and ``2n-1-i`` (``context.zigzag_positions``), in that order. Its queries
meet every rank's keys and values once: the K/V block travels around the ring (rank ``i`` sends to
``i+1``), the next block's receive posted before this block's attention so the transfer overlaps
with it. Under the causal mask the zigzag makes every block but the rank's own one exactly half
useful, and the useful half is a rectangle, never a triangle:

- its own block (step 0): both chunks in increasing position order, so the plain causal mask over
  the 2c local tokens is the exact mask;
- a block from a lower rank ``j < i``: every query sees the block's first chunk (``j``) whole and
  its second chunk (``2n-1-j``, later than both of ours) not at all;
- a block from a higher rank ``j > i``: the first query chunk (``i``) sees nothing, the second
  (``2n-1-i``) sees both of the block's chunks whole.

So every rank computes one causal 2c x 2c block and ``n - 1`` dense c x 2c blocks: the same work
on every rank (a plain split would give the last rank ``2n - 1`` times the first one's).
``layout="contiguous"`` runs that plain split (rank ``i`` holding the ``i``-th of ``n`` pieces):
the block of a lower rank is seen whole, a higher rank's not at all. No config key reaches it; it
is there so ``bench/context_parallel.py`` can time the imbalance the zigzag removes.

Partial results are merged with the log-sum-exp of each query row (online softmax), in fp32 (or
the inputs' wider type). The backward pass (a custom autograd function) recomputes each block's
probabilities from the saved log-sum-exp, and sends each block's dK/dV accumulator around the ring
with the block itself: after ``n`` hops it is back at its owner, summed over every rank's queries.
How blocks travel is the ring's business (``Ring``): over the Communicator's point-to-point
calls on the 'cp' axis in training (``parallel/ring_attention.py``, so their bytes are in the
books), or as local copies where only the compute is wanted (``LocalRing``): the local
profile times this module's blocks that way (``sim/microbench.py``), so the cost model prices
the very kernels training runs. The module sits below the cost model for that reason, and
imports torch alone.
"""

from __future__ import annotations

from typing import Protocol

import torch

from mcpar.ring_geometry import LAYOUTS, visible

# Point-to-point tags of the ring, far from the pipeline's (which count micro-batches up from 0)
# and from the validation pipeline's (1 << 24).
RING_TAG_BASE = 1 << 26
KV_TAG, GRAD_TAG = RING_TAG_BASE, RING_TAG_BASE + 1

def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if causal:
        rows, cols = scores.shape[-2:]
        mask = torch.ones(rows, cols, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the merge and the gradients accumulate in: fp32, or the inputs' wider type."""
    return torch.promote_types(dtype, torch.float32)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
            causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(softmax(q k^T scale) v, log-sum-exp of each row), in the accumulation dtype."""
    acc = accumulation_dtype(q.dtype)
    scores = _scores(q.to(acc), k.to(acc), scale, causal)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.unsqueeze(-1))
    return torch.matmul(probs, v.to(acc)), lse


def _merge(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor,
           block_lse: torch.Tensor) -> None:
    """Fold a block's (output, log-sum-exp) into the running ones, in place (rows of a slice)."""
    new_lse = torch.logaddexp(lse, block_lse)
    out.mul_(torch.exp(lse - new_lse).unsqueeze(-1))
    out.add_(block_out * torch.exp(block_lse - new_lse).unsqueeze(-1))
    lse.copy_(new_lse)


class Transfer(Protocol):
    """A posted send or receive: ``wait`` returns once it is done."""

    def wait(self) -> None: ...


class Ring(Protocol):
    """How blocks reach a rank: its place on the ring and a shift of one block one rank on."""

    size: int
    rank: int

    def source(self, step: int) -> int:
        """The rank whose block this rank holds at ``step``."""
        ...

    def shift(self, block: torch.Tensor, tag: int) -> tuple[Transfer, Transfer, torch.Tensor]:
        """Start sending ``block`` to the next rank and receiving the previous rank's: (send,
        receive, the received tensor); the caller waits both before reading it."""
        ...


class _Done:
    def wait(self) -> None:
        return None


class LocalRing:
    """Rank ``rank`` of ``size`` with no other rank: each shift hands back a copy of the block it
    was given, so the rank computes exactly the blocks (and the shapes) the ring would bring,
    on its own values. For timing the compute alone (the local profile), not for results."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def source(self, step: int) -> int:
        return (self.rank - step) % self.size

    def shift(self, block: torch.Tensor, tag: int) -> tuple[Transfer, Transfer, torch.Tensor]:
        return _Done(), _Done(), block.clone()


class RingAttention(torch.autograd.Function):
    """Causal attention of zigzag-sharded (or, for the bench, contiguous) q, k, v
    [batch, heads, 2c, head_dim] over the ring."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,  # type: ignore[override]
                ring: Ring, layout: str) -> torch.Tensor:
        if layout not in LAYOUTS:
            raise ValueError(f"ring layout {layout!r} is not one of {LAYOUTS}")
        scale = q.shape[-1] ** -0.5
        half = q.shape[-2] // 2
        kv = torch.stack([k, v]).contiguous()
        out = lse = None
        for step in range(ring.size):
            pending = ring.shift(kv, KV_TAG) if step + 1 < ring.size else None
            seen = visible(layout, ring.rank, ring.source(step), half)
            if seen is None:
                block_out = block_lse = None
            else:
                rows, cols, causal = seen
                block_out, block_lse = _attend(q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                               scale, causal)
            if out is None:  # step 0: the own block, which every row sees (itself at least)
                out, lse = block_out, block_lse
            elif block_out is not None:
                assert lse is not None and block_lse is not None
                _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            if pending is not None:
                send, recv, kv = pending
                send.wait()
                recv.wait()
        assert out is not None and lse is not None
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.layout = ring, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        q, k, v, out, lse = ctx.saved_tensors
        ring = ctx.ring
        scale = q.shape[-1] ** -0.5
        half = q.shape[-2] // 2
        acc = accumulation_dtype(q.dtype)
        qf, dout = q.to(acc), grad_out.to(acc)
        # D_i = sum_j dO_ij O_ij: the softmax's backward term of each query row.
        delta = (dout * out).sum(-1)
        dq = torch.zeros_like(qf)
        kv = torch.stack([k, v]).contiguous()
        dkv = torch.zeros(kv.shape, dtype=acc, device=kv.device)
        for step in range(ring.size):
            pending = ring.shift(kv, KV_TAG) if step + 1 < ring.size else None
            seen = visible(ctx.layout, ring.rank, ring.source(step), half)
            if seen is not None:
                rows, cols, causal = seen
                k_blk, v_blk = kv[0][:, :, cols].to(acc), kv[1][:, :, cols].to(acc)
                q_rows, dout_rows = qf[:, :, rows], dout[:, :, rows]
                probs = torch.exp(_scores(q_rows, k_blk, scale, causal)
                                  - lse[:, :, rows].unsqueeze(-1))
                dkv[1][:, :, cols] += torch.matmul(probs.transpose(-1, -2), dout_rows)
                dprobs = torch.matmul(dout_rows, v_blk.transpose(-1, -2))
                dscores = probs * (dprobs - delta[:, :, rows].unsqueeze(-1)) * scale
                dq[:, :, rows] += torch.matmul(dscores, k_blk)
                dkv[0][:, :, cols] += torch.matmul(dscores.transpose(-1, -2), q_rows)
            # This block's gradient goes on with the block; the previous rank's arrives for the
            # next step (after the last step: this rank's own block, complete).
            grad_send, grad_recv, dkv_next = ring.shift(dkv, GRAD_TAG)
            if pending is not None:
                send, recv, kv = pending
                send.wait()
                recv.wait()
            grad_send.wait()
            grad_recv.wait()
            dkv = dkv_next
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def ring_blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: Ring,
                layout: str = "zigzag") -> torch.Tensor:
    """Causal attention of one rank's zigzag-sharded (or contiguous) q, k, v [b, h, 2c, d], the
    other ranks' K/V blocks brought by ``ring``."""
    return RingAttention.apply(q, k, v, ring, layout)
