"""The MemoryController's plan: what each rank holds and how, decided once, and its build.

``plan_memory`` reads ``controllers.memory`` (with what the placement to a budget chose,
``placement.py``) and returns a frozen ``MemoryPlan``: the ZeRO stage, the parameter store,
the offload, each block's recompute, the replica checks, and the estimate of what a rank holds.
``MemoryPlan.build`` returns the memory runtime (gradient sync, parameter store, offload; then
the optimizer), which the trainer, the checkpoint manager and the memory meter use; none of
them reads the config's memory section again.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from mcpar.config import JobConfig
from mcpar.controllers.memory.estimate import (
    MemoryEstimate,
    estimate_memory,
    layer_modes,
    schedule_held_limits,
)
from mcpar.controllers.memory.placement import Placement, with_settings
from mcpar.controllers.memory.store_offload_plan import OffloadPlan, StorePlan
from mcpar.controllers.memory.zero_plan import (
    MemoryPlacement,
    plan_placement,
    reduces_every_backward,
    shard_axis,
)
from mcpar.errors import problem
from mcpar.registry import LAYOUT_KEYS
from mcpar.registry.recompute import RECOMPUTE_POLICIES, RecomputeFacts
from mcpar.registry.zero import ZeroStage, zero_stage
from mcpar.topology import ParallelDims

# The plan is made without torch (`mcpar check`); the runtime it builds imports it.
if TYPE_CHECKING:
    import torch
    from torch import nn

    from mcpar.controllers.communication.controller import CommunicationController
    from mcpar.controllers.communication.grad_sync import DataParallelGradSync, ShardSpec
    from mcpar.controllers.communication.plan import CommPlan
    from mcpar.controllers.memory.offload import OffloadSpec
    from mcpar.controllers.memory.param_store import ParameterStore


@dataclass(frozen=True)
class MemoryPlan:
    """What the MemoryController runs (``plan.json``'s memory keys)."""

    zero_stage: int  # 0: replicated; 1: optimizer state sharded; 2: and gradients; 3: and params
    store: StorePlan  # ZeRO-3's parameter store
    offload: OffloadPlan
    recompute: tuple[str, ...]  # each block's mode ('none', 'selective', 'full'), model order
    consistency_interval: int  # steps between replica checks (0: never)
    budget_gb: float | None  # controllers.memory.memory_budget_gb (None: the device's capacity)
    estimate: MemoryEstimate  # the largest rank's
    holdings: MemoryPlacement  # what each rank holds of every parameter group
    # The dense parameters' replicas, which ZeRO shards over: 'dp', or 'dp_cp' under context
    # parallelism (``zero_plan.shard_axis``); the checkpoint's replica coordinate too.
    shard_axis: str = "dp"
    # ZeRO 2/3: the gradients reduce-scattered after every backward (True) or once per step,
    # after each chunk's last backward (the stage entry's ``reduces_every_backward``).
    reduce_every_backward: bool = False
    # A split pipeline schedule held to 1F1B's activation peak: the most chunk activations each
    # pipeline rank may hold (``mcpar.sim.memory.held_limits``); None: unbounded.
    held_limits: tuple[int, ...] | None = None
    budget: Placement | None = None  # the placement to the budget (None beside dynamic split)
    # The memory section's keys the plan decided (the run's config.yaml records them).
    settings: dict[str, object] = field(default_factory=dict, hash=False)

    @property
    def zero(self) -> ZeroStage:
        """The ZeRO stage's registry entry."""
        return zero_stage(self.zero_stage)

    @property
    def data_sharded(self) -> bool:
        """Optimizer state (and gradients) sharded over ``shard_axis``: clipping sums the norm
        over it, checkpoints save per replica."""
        return self.zero.shards_optimizer

    def with_estimate(self, estimate: MemoryEstimate) -> MemoryPlan:
        return dataclasses.replace(self, estimate=estimate)

    def build(self, comm: CommunicationController, chunks: list[nn.Module],
              params: list[nn.Parameter], exchange: CommPlan, run_dir: Path, rank: int,
              device: torch.device) -> MemoryRuntime:
        """The memory runtime, in its order: offload (before the gradient buffers: with bf16 it
        makes the parameters bf16 copies), then the gradient sync (ZeRO: buckets
        reduce-scattered into shards over ``shard_axis``, experts over their replicas; stage 3:
        the parameter store, which gathers each layer)."""
        from mcpar.controllers.communication.grad_sync import DataParallelGradSync

        offload = self.offload.build(params, run_dir, rank, device)
        axis = self.shard_axis
        shards: ShardSpec = ((axis, comm.axis_size(axis), comm.axis_rank(axis)),
                             ("edp", comm.axis_size("edp"), comm.axis_rank("edp")))
        store, notes = None, []
        zero = self.zero
        if zero.shards_parameters:
            sync, store, text = self.store.build(comm, chunks, shards,
                                                 exchange.bucket_size_mb, exchange.overlap,
                                                 self.reduce_every_backward)
            notes.append(text)
        else:
            sync = DataParallelGradSync(
                params, exchange.bucket_size_mb, overlap=exchange.overlap,
                shards=shards if zero.shards_optimizer else None,
                release_grads=zero.shards_gradients,
                reduce_every_backward=self.reduce_every_backward)
        return MemoryRuntime(self, sync, store, offload, notes)


@dataclass
class MemoryRuntime:
    """The MemoryController's live objects for one run."""

    plan: MemoryPlan
    grad_sync: DataParallelGradSync
    store: ParameterStore | None  # ZeRO-3's
    offload: OffloadSpec | None
    notes: list[str]  # lines for the start-up log

    def build_optimizer(self, params: list[nn.Parameter], cfg: JobConfig, exchange: CommPlan,
                        comm: CommunicationController,
                        ) -> tuple[torch.optim.Optimizer, list[nn.Parameter]]:
        """The optimizer over what this rank holds, and the parameters whose gradients the
        update reads (ZeRO: the shards' pieces)."""
        from mcpar.controllers.memory.optimizer import build_optimizer

        return build_optimizer(params, cfg, self.plan.zero_stage, exchange, comm,
                               self.grad_sync, self.store, self.offload)

    def full_parameters(self) -> Callable[[bool], contextlib.AbstractContextManager[None]] | None:
        """What a checkpoint saves and restores the full parameters through (ZeRO-3: the
        store's gathers; bf16 copies under offload: the fp32 masters), or None."""
        from mcpar.controllers.memory.offload import checkpoint_parameters

        if self.store is not None:
            return self.store.full_parameters
        return checkpoint_parameters(self.offload)

    def owned_shards(self, optimizer: torch.optim.Optimizer,
                     ) -> list[tuple[str, str, torch.Tensor]]:
        """(name, axis, elements) of the state this rank alone updates (ZeRO's shards, whose
        checksums the consistency check keeps); none without ZeRO."""
        if self.plan.zero_stage == 0:
            return []
        from mcpar.controllers.memory.zero import ZeroAdamW

        assert isinstance(optimizer, ZeroAdamW)  # build_optimizer's, under ZeRO
        return optimizer.owned_shards()

    def replicated(self, chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
        """The tensors every data replica holds alike (none under ZeRO-3)."""
        if self.store is not None:
            return []
        return [(f"{i}.{n}", p) for i, c in enumerate(chunks) for n, p in c.named_parameters()]


def holds_masters(cfg: JobConfig) -> bool:
    """Whether the offloaded state holds fp32 master weights (the model bf16 copies)."""
    mem = cfg.controllers.memory
    return mem.offload != "none" and cfg.training.dtype == "bfloat16" and mem.zero_stage == 0


def recompute_problems(cfg: JobConfig) -> list[str]:
    """The rules of the recompute policies the config's blocks use (their registry entries)."""
    facts = RecomputeFacts(is_moe=cfg.model.is_moe)
    return [problem(LAYOUT_KEYS[field], text) for mode in dict.fromkeys(layer_modes(cfg))
            for field, text in RECOMPUTE_POLICIES.get(mode).problems(facts)]


def plan_memory(cfg: JobConfig, dims: ParallelDims, budget: Placement | None) -> MemoryPlan:
    """The MemoryController's plan of a resolved config and of what the placement to the
    budget chose (``budget``: its settings win over the config's)."""
    settings = budget.chosen.settings() if budget is not None and budget.searched else {}
    cfg = with_settings(cfg, settings)
    mem, wire = cfg.controllers.memory, cfg.controllers.communication
    node_cache = mem.allocation == "topology_aware"
    return MemoryPlan(
        zero_stage=mem.zero_stage,
        store=StorePlan(mem.gather_mb, node_cache, wire.weight_gather,
                        wire.compression if node_cache else "none", cfg.cluster.ranks_per_node),
        offload=OffloadPlan(mem.offload, mem.offload_dir, int(mem.offload_buffer_mb * 2**20),
                            holds_masters(cfg)),
        recompute=layer_modes(cfg),
        consistency_interval=mem.consistency_interval,
        budget_gb=mem.memory_budget_gb,
        estimate=estimate_memory(cfg, dims),
        holdings=plan_placement(cfg, dims.dp, dims.ep, dims.cp),
        shard_axis=shard_axis(dims.cp),
        reduce_every_backward=reduces_every_backward(cfg),
        held_limits=schedule_held_limits(cfg, dims),
        budget=budget,
        settings=settings,
    )
