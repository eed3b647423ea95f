"""Expert parallelism: each MoE layer's experts spread over the 'ep' axis, tokens moved by
all-to-all; and the migration of an expert between ranks.

Layout. The expert axis is carved out of the data axis (ParallelDims: 'ep' joins ``ep``
consecutive data ranks, 'edp' the replicas of one expert group). A layer's E experts sit in E
*slots*, E/ep per rank (slot s on ep rank s // (E/ep)); ``expert_of_slot`` (a buffer, saved with
the model) says which expert each slot holds. It starts as the identity and changes only when the
load balancer swaps two slots' contents (``swap_expert_slots``).

Forward of ``ShardedExperts`` (rows = (token, chosen expert) entries of this rank's tokens):
1. sort the rows by destination slot, so they are grouped by destination rank;
2. all-to-all of the per-slot row counts (E integers), then of the rows themselves (uneven splits);
3. the received rows are regrouped by local slot and each local expert runs its MLP;
4. the outputs return by the inverse all-to-all, and are put back in entry order.
Both all-to-alls are autograd functions whose backward is the opposite all-to-all, all through
the Communicator, so every token byte is counted on the 'ep' axis.

Under tensor parallelism each expert's inner width is split over 'tp' (the first weight by
columns, the second by rows, as Megatron splits a dense MLP): every tp rank dispatches the same
rows to the same ep rank and computes a partial output; the partial outputs are summed over 'tp'
*before* the router weights multiply them, so that the router's gradient is whole on every tp
rank. The shared expert is sharded like a dense MLP.

Gradients: an expert's parameters exist on the ``edp`` ranks that hold its group position; their
gradient is summed over 'edp' and divided by the data degree (each rank's loss is a mean over its
own tokens, and the expert saw tokens of the whole expert group). Parameters carry the
``is_expert_sharded`` mark so that gradient synchronization, clipping and checkpoints treat them
as sharded over 'ep'.

Why hand-written: PyTorch has no MoE dispatch, and the token exchange must go through the
Communicator (counted, and on the groups that ParallelDims owns).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.models.moe import Experts, GroupedWeight, MoELayer, expert_mlps
from mcpar.parallel.tensor import (
    TP_SHARDED_ATTR,
    enter_tensor_parallel,
    leave_tensor_parallel,
    shard_dense_mlp,
)

EXPERT_SHARDED_ATTR = "_mcpar_expert_sharded"
# Point-to-point tags of expert migrations, far from the pipeline's.
MIGRATION_TAG_BASE = 1 << 25


def is_expert_sharded(p: nn.Parameter) -> bool:
    """True when `p` holds this ep rank's experts only (different on every ep rank)."""
    return bool(getattr(p, EXPERT_SHARDED_ATTR, False))


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, comm: Communicator,
                send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
        ctx.comm, ctx.send_counts, ctx.recv_counts = comm, send_counts, recv_counts
        return comm.all_to_all_rows(rows, send_counts, recv_counts, axis="ep")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return ctx.comm.all_to_all_rows(grad.contiguous(), ctx.recv_counts, ctx.send_counts,
                                        axis="ep"), None, None, None


class ShardedExperts(nn.Module):
    """This rank's experts of one MoE layer (E/ep slots, each expert's width split over tp)."""

    def __init__(self, full: Experts, comm: Communicator, ep_rank: int, ep: int,
                 tp_rank: int, tp: int):
        super().__init__()
        num_experts = full.num_experts
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts are not divisible by expert degree {ep}")
        ffn = full.fc.weight.shape[-1]
        if ffn % tp:
            raise ValueError(f"expert width {ffn} is not divisible by tensor degree {tp}")
        self.comm, self.ep, self.ep_rank, self.tp = comm, ep, ep_rank, tp
        self.num_experts = num_experts
        self.per_rank = num_experts // ep
        mine = slice(ep_rank * self.per_rank, (ep_rank + 1) * self.per_rank)
        width = slice(tp_rank * ffn // tp, (tp_rank + 1) * ffn // tp)
        self.fc = GroupedWeight(self.per_rank, full.fc.weight.shape[1], ffn // tp)
        self.proj = GroupedWeight(self.per_rank, ffn // tp, full.proj.weight.shape[2])
        with torch.no_grad():  # copies, so that the full model can be freed
            self.fc.weight.copy_(full.fc.weight[mine, :, width])
            self.proj.weight.copy_(full.proj.weight[mine, width, :])
        for p in (self.fc.weight, self.proj.weight):
            if ep > 1:
                setattr(p, EXPERT_SHARDED_ATTR, True)
            if tp > 1:
                setattr(p, TP_SHARDED_ATTR, True)
        self.register_buffer("expert_of_slot", torch.arange(num_experts))

    def forward(self, tokens: torch.Tensor, token_index: torch.Tensor,
                expert_index: torch.Tensor) -> torch.Tensor:
        tokens = enter_tensor_parallel(tokens, self.comm)
        slot_of_expert = torch.argsort(self.expert_of_slot)
        slot = slot_of_expert.to(expert_index.device)[expert_index]
        order = torch.argsort(slot, stable=True)
        rows = tokens[token_index[order]]
        slot_counts = torch.bincount(slot, minlength=self.num_experts)
        if self.ep > 1:
            # recv[s, j]: rows source rank s sends to my local slot j.
            recv = torch.empty_like(slot_counts)
            self.comm.all_to_all_single(recv, slot_counts, axis="ep")
            recv, slot_counts = recv.cpu().view(self.ep, self.per_rank), slot_counts.cpu()
            send_counts = slot_counts.view(self.ep, self.per_rank).sum(1).tolist()
            recv_counts = recv.sum(1).tolist()
            received = _AllToAllRows.apply(rows, self.comm, send_counts, recv_counts)
            local_slot = torch.arange(self.per_rank).repeat(self.ep).repeat_interleave(
                recv.flatten())
            regroup = torch.argsort(local_slot, stable=True).to(rows.device)
            out = expert_mlps(received[regroup], recv.sum(0).tolist(), self.fc.weight,
                              self.proj.weight)
            out = _AllToAllRows.apply(out[torch.argsort(regroup)], self.comm, recv_counts,
                                      send_counts)
        else:
            out = expert_mlps(rows, slot_counts.cpu().tolist(), self.fc.weight,
                              self.proj.weight)
        out = leave_tensor_parallel(out, self.comm)
        return out[torch.argsort(order)]


def apply_expert_parallel(module: nn.Module, comm: Communicator, ep_rank: int,
                          ep: int, tp_rank: int, tp: int) -> None:
    """Replace, in place, every MoE layer's experts with this rank's ``ShardedExperts`` and
    shard its shared expert over tp. The module must hold the full, initialized model."""
    for layer in module.modules():
        if isinstance(layer, MoELayer):
            layer.experts = ShardedExperts(layer.experts, comm, ep_rank, ep, tp_rank, tp)
            if layer.shared is not None and tp > 1:
                shard_dense_mlp(layer.shared, comm, tp_rank, tp, sequence_parallel=False)


def _slot_tensors(experts: ShardedExperts, local_slot: int,
                  optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Views of everything that belongs to one slot: weights and per-element optimizer state."""
    views = []
    for p in (experts.fc.weight, experts.proj.weight):
        views.append(p.data[local_slot])
        for value in optimizer.state.get(p, {}).values():
            if torch.is_tensor(value) and value.shape == p.shape:
                views.append(value[local_slot])
    return views


def swap_expert_slots(experts: ShardedExperts, optimizer: torch.optim.Optimizer, slot_a: int,
                      slot_b: int, tag: int = 0) -> None:
    """Exchange the experts of two slots (their weights and optimizer state), on every rank of
    the ep group; the math of the model is unchanged, only where each expert lives."""
    per = experts.per_rank
    rank_a, local_a = divmod(slot_a, per)
    rank_b, local_b = divmod(slot_b, per)
    me = experts.ep_rank
    with torch.no_grad():
        if rank_a == rank_b:
            if me == rank_a:
                for va, vb in zip(_slot_tensors(experts, local_a, optimizer),
                                  _slot_tensors(experts, local_b, optimizer), strict=True):
                    held = va.clone()
                    va.copy_(vb)
                    vb.copy_(held)
        elif me in (rank_a, rank_b):
            local, peer = (local_a, rank_b) if me == rank_a else (local_b, rank_a)
            views = _slot_tensors(experts, local, optimizer)
            outgoing = torch.cat([v.reshape(-1) for v in views])
            incoming = torch.empty_like(outgoing)
            handle = experts.comm.send(outgoing, peer, axis="ep", tag=MIGRATION_TAG_BASE + tag)
            experts.comm.recv(incoming, peer, axis="ep", tag=MIGRATION_TAG_BASE + tag)
            handle.wait()
            offset = 0
            for v in views:
                v.copy_(incoming[offset:offset + v.numel()].view_as(v))
                offset += v.numel()
        placement = experts.expert_of_slot
        placement[[slot_a, slot_b]] = placement[[slot_b, slot_a]].clone()
