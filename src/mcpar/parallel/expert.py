"""Expert parallelism: each MoE layer's experts spread over the 'ep' axis, tokens moved by
all-to-all; and the migration of an expert between ranks.

Layout. The expert axis is carved out of the data axis (ParallelDims: 'ep' joins ``ep``
consecutive data ranks, 'edp' the replicas of one expert group). A layer's E experts sit in E
*slots*, E/ep per rank (slot s on ep rank s // (E/ep)); ``expert_of_slot`` (a buffer, saved with
the model) says which expert each slot holds. It starts as the identity and changes only when the
load balancer swaps two slots' contents (``swap_expert_slots``).

Which modules are MoE layers, where their experts are and how an expert computes is the model's
business: its spec's ``ExpertPlan`` (mcpar.models.plan) says, and nothing here names a model's
attributes.

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

import time
from typing import Any

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.parallel.tensor import (
    TP_SHARDED_ATTR,
    enter_tensor_parallel,
    leave_tensor_parallel,
    replace,
    resolve,
    shard_block,
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
    """This rank's experts of one MoE layer (E/ep slots, each expert's width split over tp).

    Built from the layer's full experts module and the model's ``ExpertPlan``: each grouped
    weight the plan lists (``[experts, ...]``) keeps this rank's experts and, along the plan's
    width dim, this tp rank's slice; it is registered at the same path as in the full module, so
    parameter names do not change. The plan's ``compute`` runs the experts."""

    def __init__(self, full: nn.Module, plan: Any, comm: Communicator, ep_rank: int, ep: int,
                 tp_rank: int, tp: int):
        super().__init__()
        weights = [resolve(full, w.path) for w in plan.weights]
        num_slots = weights[0].shape[0]
        if num_slots % ep:
            raise ValueError(f"{num_slots} experts are not divisible by expert degree {ep}")
        for spec, weight in zip(plan.weights, weights, strict=True):
            if weight.shape[spec.width_dim] % tp:
                raise ValueError(f"expert width {weight.shape[spec.width_dim]} is not divisible "
                                 f"by tensor degree {tp}")
        self.comm, self.ep, self.ep_rank, self.tp = comm, ep, ep_rank, tp
        self.num_slots = num_slots
        self.per_rank = num_slots // ep
        self.compute = plan.compute
        self.weight_paths = tuple(w.path for w in plan.weights)
        for spec, weight in zip(plan.weights, weights, strict=True):
            width = weight.shape[spec.width_dim] // tp
            # A copy, so that the full model can be freed.
            piece = (weight.detach().narrow(0, ep_rank * self.per_rank, self.per_rank)
                     .narrow(spec.width_dim, tp_rank * width, width)
                     .clone(memory_format=torch.contiguous_format))
            p = nn.Parameter(piece)
            if ep > 1:
                setattr(p, EXPERT_SHARDED_ATTR, True)
            if tp > 1:
                setattr(p, TP_SHARDED_ATTR, True)
            _register(self, spec.path, p)
        self.register_buffer("expert_of_slot", torch.arange(num_slots))
        # Seconds this rank spent in its experts' forward since the load balancer last read it
        # (the balancer's measured cost of imbalance).
        self.compute_s = 0.0

    def grouped_weights(self) -> list[nn.Parameter]:
        """This rank's grouped weights ``[E/ep, ...]``, in the plan's order."""
        return [resolve(self, path) for path in self.weight_paths]

    def forward(self, tokens: torch.Tensor, token_index: torch.Tensor,
                expert_index: torch.Tensor) -> torch.Tensor:
        tokens = enter_tensor_parallel(tokens, self.comm)
        slot_of_expert = torch.argsort(self.expert_of_slot)
        slot = slot_of_expert.to(expert_index.device)[expert_index]
        order = torch.argsort(slot, stable=True)
        rows = tokens[token_index[order]]
        slot_counts = torch.bincount(slot, minlength=self.num_slots)
        weights = self.grouped_weights()
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
            start = time.perf_counter()
            out = self.compute(received[regroup], recv.sum(0).tolist(), *weights)
            self.compute_s += time.perf_counter() - start
            out = _AllToAllRows.apply(out[torch.argsort(regroup)], self.comm, recv_counts,
                                      send_counts)
        else:
            out = self.compute(rows, slot_counts.cpu().tolist(), *weights)
        out = leave_tensor_parallel(out, self.comm)
        return out[torch.argsort(order)]


def _register(root: nn.Module, path: str, p: nn.Parameter) -> None:
    """Register ``p`` at dotted ``path`` below ``root``, creating plain holder modules on the
    way (so ``fc.weight`` of the full experts stays ``fc.weight`` here)."""
    *owners, name = path.split(".")
    module = root
    for owner in owners:
        if not hasattr(module, owner):
            module.add_module(owner, nn.Module())
        module = getattr(module, owner)
    module.register_parameter(name, p)


def apply_expert_parallel(stage: nn.Module, plan: Any, comm: Communicator, ep_rank: int,
                          ep: int, tp_rank: int, tp: int) -> None:
    """Replace, in place, the experts of every MoE layer that ``plan`` (the model spec's
    ``ExpertPlan``) finds in the blocks of ``stage`` (a ``StageModule``) with this rank's
    ``ShardedExperts``, and shard the layer's shared expert over tp. The stage must hold the
    full, initialized model's pieces."""
    for block in stage.pieces()[1]:
        for layer in plan.layers(block):
            full = resolve(layer, plan.routed)
            replace(layer, plan.routed,
                    ShardedExperts(full, plan, comm, ep_rank, ep, tp_rank, tp))
            if tp > 1:
                shard_block(layer, plan.dense, comm, tp_rank, tp, sequence_parallel=False)


def _slot_tensors(experts: ShardedExperts, local_slot: int,
                  optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Views of everything that belongs to one slot: weights and per-element optimizer state."""
    views = []
    for p in experts.grouped_weights():
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
