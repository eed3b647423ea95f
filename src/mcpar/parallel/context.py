"""Context parallelism: every sequence split over the context ranks in a balanced zigzag.

With ``n`` context ranks a sequence of ``s`` tokens is cut into ``2n`` chunks of ``s / 2n`` and
rank ``i`` holds chunks ``i`` and ``2n-1-i``, in that order (``zigzag_positions``). Under a causal
mask a chunk's attention work grows with its position, so pairing an early chunk with a late one
gives every rank the same work; a plain split into ``n`` pieces would give the last rank all of
its keys and the first almost none.

What follows the shards:
- the data: each rank's inputs and targets are the tokens at its positions (``shard_sequence``);
- positions: the model's position lookups (a learned table, rotary angles) take the absolute
  positions of the shard, set on the modules its ``ContextParallelPlan`` names;
- attention: the plan's attention core is replaced by ring attention (``ring_attention.py``) or
  Ulysses' all-to-all (``ulysses.py``) over the 'cp' axis;
- the loss: every rank holds ``s / n`` tokens of each sequence, so the mean of the context ranks'
  token means is the mean over the whole sequence; the gradient exchange averages over the data
  and context ranks together (``ParallelDims.grad_axis``), which takes that mean;
- routing (MoE): each token is routed alone, but the auxiliary loss is per sequence: the plan's
  routed layer sums its expert counts over the context ranks; experts are replicated over the
  context axis like the parameters, their gradients reduced over data and context ('edp');
- the parameters are replicated over the axis, so checkpoints do not depend on its degree.

Everything else in a block (linears, norms, the MLP) acts on each token alone and needs nothing.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.parallel.ring_attention import ring_attention
from mcpar.parallel.ulysses import ulysses_attention

CONTEXT_MODES = ("ring", "ulysses")


def zigzag_positions(seq_len: int, cp_rank: int, cp: int,
                     device: torch.device | None = None) -> torch.Tensor:
    """The positions rank ``cp_rank`` of ``cp`` holds: chunks ``cp_rank`` and
    ``2cp-1-cp_rank`` of ``2cp`` equal chunks, in increasing order."""
    if seq_len % (2 * cp):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x context {cp}")
    chunk = seq_len // (2 * cp)
    first = torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device)
    last = 2 * cp - 1 - cp_rank
    second = torch.arange(last * chunk, (last + 1) * chunk, device=device)
    return torch.cat([first, second])


def shard_sequence(tokens: torch.Tensor, cp_rank: int, cp: int) -> torch.Tensor:
    """This rank's zigzag shard of ``tokens`` [batch, seq] (or anything with the sequence on
    dim 1)."""
    if cp == 1:
        return tokens
    return tokens.index_select(1, zigzag_positions(tokens.shape[1], cp_rank, cp, tokens.device))


class ContextAttentionCore(nn.Module):
    """Causal attention of a zigzag shard's q, k, v [batch, heads, 2c, head_dim] over the
    context group (the plan's attention core, replaced)."""

    def __init__(self, comm: Communicator, mode: str, axis: str = "cp"):
        super().__init__()
        if mode not in CONTEXT_MODES:
            raise ValueError(f"context mode {mode!r} is not one of {CONTEXT_MODES}")
        self.comm, self.mode, self.axis = comm, mode, axis

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        attend = ring_attention if self.mode == "ring" else ulysses_attention
        return attend(q, k, v, self.comm, self.axis)

    def extra_repr(self) -> str:
        return f"mode={self.mode}, axis={self.axis}"


def _resolve(root: nn.Module, path: str) -> nn.Module:
    target = root
    for name in filter(None, path.split(".")):
        target = getattr(target, name)
    return target


def _replace(root: nn.Module, path: str, module: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    setattr(_resolve(root, parent_path), name, module)


def apply_context_parallel(chunk: nn.Module, plan: Any, comm: Communicator,
                           cp_rank: int, cp: int, mode: str, seq_len: int) -> None:
    """Make a pipeline chunk (a StageModule, or anything with ``pieces()``) act on this rank's
    zigzag shard: its attention cores over the context group, its positions the shard's.
    ``plan``: the model spec's ``ContextParallelPlan`` (mcpar.models.plan), paths inside the
    pieces, so nothing here names a model's attribute."""
    embedding, blocks, _, _ = chunk.pieces()  # type: ignore[operator]
    positions = zigzag_positions(seq_len, cp_rank, cp)
    if embedding is not None and plan.embedding_positions is not None:
        _resolve(embedding, plan.embedding_positions).positions = positions.clone()
    for block in blocks:
        if plan.block_positions is not None:
            _resolve(block, plan.block_positions).positions = positions.clone()
        _replace(block, plan.attention_core, ContextAttentionCore(comm, mode))
        if plan.routed_layer is not None:
            assert plan.join_routing is not None, "a routed layer needs its join_routing"
            plan.join_routing(_resolve(block, plan.routed_layer), cp,
                              lambda t: comm.all_reduce(t, axis="cp"))
