"""The ComputeController's plan: the pipeline schedule, the stage cut, the micro-batch split
and the expert balancing policy of a job, decided once.

``plan_compute`` reads ``parallelism``'s pipeline keys and ``controllers.compute``; the runtime
(the executor's task list, the expert balancer, dynamic batch splitting) builds from the frozen
``ComputePlan`` and never reads those keys again. The schedule's rules are its registry entry's
(``mcpar.registry.schedule``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcpar.config import JobConfig
from mcpar.controllers.compute.balance_plan import BalancePlan
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.device_kernels import pipeline_receives_ahead
from mcpar.errors import problem
from mcpar.registry import LAYOUT_KEYS
from mcpar.registry.schedule import SCHEDULES, ActionCosts, steps_overlap
from mcpar.topology import ParallelDims

# The plan is made without torch (`mcpar check`); its methods that build the runtime import it.
if TYPE_CHECKING:
    import torch

    from mcpar.comm.communicator import Communicator
    from mcpar.controllers.compute.controller import ComputeController, GradientSync
    from mcpar.controllers.compute.expert_balance import MoERoutingController
    from mcpar.parallel.pipeline import PipelineExecutor
    from mcpar.parallel.stage import StageModule
    from mcpar.parallel.tasks import Task

LossFn = Callable[["torch.Tensor", "torch.Tensor"], "torch.Tensor"]


@dataclass(frozen=True)
class ComputePlan:
    """What the ComputeController runs each step."""

    pp: int
    virtual_stages: int
    schedule: str | None  # the registered pipeline schedule; None without a pipeline
    sequence_parallel: bool
    micro_batch_size: int  # sequences per micro-batch per data-parallel rank
    num_microbatches: int  # per step
    global_batch_size: int  # sequences per step, all ranks
    stage_cut: tuple[tuple[int, int], ...]  # [start, end) blocks of every global stage
    batch_splitting: str  # how the micro-batch count is chosen: 'fixed' or 'dynamic'
    balance: BalancePlan
    # Measured seconds of each action (``ActionCosts``), for a schedule that orders by them;
    # None: the schedule's order at equal costs.
    action_costs: ActionCosts | None = None
    # The most chunk activations each pipeline rank may hold, where the MemoryController bounds
    # a split schedule to 1F1B's peak (``MemoryPlan.held_limits``); None: unbounded.
    held_limits: tuple[int, ...] | None = None
    # Each rank starts its next step as soon as its own update is done, the step's global
    # figures checked one step later (``optimization.post_validation``): the schedule's
    # orders are chosen for overlapping steps (``for_overlapped_steps``).
    overlapped_steps: bool = False

    @property
    def placement(self) -> str:
        """Where the chunks' stages sit (``mcpar.registry.schedule.placed_stage``)."""
        return "round_robin" if self.schedule is None else SCHEDULES.get(self.schedule).placement

    def stages_of(self, pp_rank: int) -> list[int]:
        """The global stages of ``pp_rank``'s local chunks, as the schedule places them."""
        if self.schedule is None:
            return [c * self.pp + pp_rank for c in range(self.virtual_stages)]
        entry = SCHEDULES.get(self.schedule)
        return [entry.stage_of(c, pp_rank, self.pp, self.virtual_stages)
                for c in range(self.virtual_stages)]

    def stage_ranks(self) -> list[int]:
        """The pipeline rank of every global stage."""
        ranks = [0] * (self.pp * self.virtual_stages)
        for r in range(self.pp):
            for stage in self.stages_of(r):
                ranks[stage] = r
        return ranks

    def send_order(self, pp_rank: int) -> dict[int, list[tuple[str, int, int]]] | None:
        """For each peer, the messages it sends ``pp_rank`` in the order it sends them (None
        without a pipeline). The executor posts its receives in that order: a backend that
        matches point-to-point messages by order, not tag (NCCL), needs it where a rank reads
        a peer's messages in another order (a V's neighbours), and it is what lets a rank post
        receives ahead of their tasks (``pipeline_receives_ahead``)."""
        if self.schedule is None or self.pp == 1:
            return None
        from mcpar.controllers.compute.schedules import message_orders

        sent, _read = message_orders(self.schedule, self.pp, self.num_microbatches,
                                     self.virtual_stages, self.action_costs, self.held_limits,
                                     self.overlapped_steps)
        return {src: messages for (src, dst), messages in sent.items() if dst == pp_rank}

    def executor_wiring(self, pp_rank: int, device_type: str) -> dict[str, Any]:
        """The pipeline executor's placement and receives for ``pp_rank`` on ``device_type``:
        its chunks' stages, every stage's rank, each peer's send order, and the receives it
        keeps posted ahead (``PipelineExecutor``'s keyword arguments)."""
        return {"stages": self.stages_of(pp_rank), "stage_ranks": self.stage_ranks(),
                "send_order": self.send_order(pp_rank),
                "receives_ahead": pipeline_receives_ahead(device_type)}

    @property
    def splits_backward(self) -> bool:
        """The schedule computes weight gradients in W tasks apart from the backward."""
        return self.schedule is not None and SCHEDULES.get(self.schedule).splits_backward

    def with_split(self, micro_batch_size: int, num_microbatches: int) -> ComputePlan:
        return dataclasses.replace(self, micro_batch_size=micro_batch_size,
                                   num_microbatches=num_microbatches)

    def step_tasks(self, pp_rank: int, reduce_every_backward: bool) -> list[Task]:
        """Every task of one optimizer step on pipeline rank ``pp_rank``, in order."""
        from mcpar.controllers.compute.schedules import step_tasks

        return step_tasks(self.schedule, pp_rank, self.pp, self.num_microbatches,
                          self.virtual_stages, reduce_every_backward=reduce_every_backward,
                          costs=self.action_costs, limits=self.held_limits,
                          overlapped=self.overlapped_steps)

    def build(self, cfg: JobConfig, dims: ParallelDims, comm: Communicator,
              chunks: list[StageModule], device: torch.device, loss_fn: LossFn,
              activation_shape: tuple[int, int, int], activation_dtype: torch.dtype,
              forward_context: Callable[[], AbstractContextManager[object]],
              grad_sync: GradientSync, update: Callable[[int, list[float]], object],
              reduce_every_backward: bool, optimizer: torch.optim.Optimizer,
              run_dir: Path | None, has_experts: bool, is_main: bool) -> ComputeRuntime:
        """The pipeline executor of this rank's chunks, the ComputeController over the step's
        task list (``update``: the step's last task), and a model with experts' balancer."""
        from mcpar.controllers.compute.controller import ComputeController
        from mcpar.controllers.compute.expert_balance import MoERoutingController
        from mcpar.parallel.pipeline import PipelineExecutor
        from mcpar.parallel.weight_grad import WeightGradStore, split_weight_grads

        pp_rank = dims.axis_rank("pp")
        store = WeightGradStore() if self.splits_backward else None
        # Under a split schedule the linear layers' weight gradients are W's (the deferred
        # parameters); every other parameter's gradient is still its chunk's backward's.
        # The output head keeps its whole backward (``split_weight_grads`` says why).
        deferred = [split_weight_grads(chunk, store, keep_whole=chunk.pieces()[2])
                    if store is not None else [] for chunk in chunks]
        from_backward = [[p for p in chunk.parameters() if all(p is not q for q in late)]
                         for chunk, late in zip(chunks, deferred, strict=True)]
        executor = PipelineExecutor(
            chunks, pp_rank, self.pp, comm, self.num_microbatches, activation_shape, loss_fn,
            device, forward_context=forward_context, activation_dtype=activation_dtype,
            weight_grads=store, **self.executor_wiring(pp_rank, device.type))
        controller = ComputeController(
            self.step_tasks(pp_rank, reduce_every_backward), executor, from_backward,
            grad_sync, update, chunk_deferred=deferred)
        moe = None
        if has_experts:
            moe = MoERoutingController(cfg, self.balance, self.num_microbatches, dims, comm,
                                       chunks, optimizer, run_dir, is_main=is_main)
        count = sum(len(params) for params in deferred)
        notes = [f"schedule {self.schedule} splits the backward: {count} parameters of this "
                 "rank's linear layers get their gradients in W tasks"] if count else []
        return ComputeRuntime(executor, controller, moe, notes)

    def split_allowed(self, num_microbatches: int) -> bool:
        """Whether the schedule runs with this micro-batch count (dynamic splitting asks)."""
        from mcpar.controllers.compute.schedules import schedule_problem

        return self.schedule is None or schedule_problem(
            self.schedule, self.pp, num_microbatches, self.virtual_stages) is None


@dataclass
class ComputeRuntime:
    """The ComputeController's live objects for one run."""

    executor: PipelineExecutor
    controller: ComputeController
    moe: MoERoutingController | None  # a model with experts: routing metrics and balancing
    notes: list[str]  # lines for the run's log


# What a step taken before the mesh agrees on it cannot follow yet: state that the update
# changes outside the parameters and the optimizer (a compressed codec's error feedback, MoE
# balancing), collectives of its own in the update (ZeRO's sharded step), and the profiler's
# window, which times each step as it ends.
def post_validation_problems(cfg: JobConfig) -> list[str]:
    """Problems of ``optimization.post_validation`` with the rest of the config."""
    if not cfg.optimization.post_validation:
        return []
    key = "optimization.post_validation"
    fix = "; or set optimization.post_validation false"
    checks = [
        (cfg.parallelism.pipeline > 1, "needs parallelism.pipeline > 1: without a pipeline no "
         "rank waits for another at the step's end"),
        (cfg.optimization.optimizer == "adamw", "needs optimizer adamw (onebit_adam's "
         "compressed phase keeps error feedback that a redone step would count twice)"),
        (cfg.controllers.communication.compression == "none", "needs "
         "controllers.communication.compression none (a codec's error feedback would be spent "
         "twice by a redone step)"),
        (cfg.controllers.memory.zero_stage == 0, "needs controllers.memory.zero_stage 0 (ZeRO's "
         "sharded update gathers the parameters inside the step)"),
        (cfg.model.num_experts <= 1, "needs a dense model (the expert balancer moves state at "
         "each step's end)"),
        (cfg.controllers.memory.offload == "none", "needs controllers.memory.offload none "
         "(the offloaded optimizer state is stepped away from the parameters)"),
        (not cfg.training.profile.enabled, "needs training.profile.enabled false (the "
         "profiler's window times each step as it ends)"),
    ]
    return [problem(key, text + fix) for ok, text in checks if not ok]


def schedule_problems(cfg: JobConfig, num_microbatches: int) -> list[str]:
    """Problems of the pipeline schedule with this layout and micro-batch count."""
    par = cfg.parallelism
    if par.schedule not in SCHEDULES:
        return [problem("parallelism.schedule", SCHEDULES.unknown(par.schedule))]
    if par.pipeline == 1:
        if par.virtual_stages > 1:
            return [problem("parallelism.virtual_stages",
                            f"{par.virtual_stages} virtual stages need parallelism.pipeline > 1")]
        return []
    entry = SCHEDULES.get(par.schedule)
    if entry.splits_backward and cfg.training.compile:
        # A compiled block's backward is traced once; W's store is filled from inside it.
        return [problem("training.compile", f"schedule {entry.name} splits the backward, which "
                        "the compiled blocks' traced backward cannot do; set training.compile "
                        "false or use schedule 1f1b / interleaved_1f1b")]
    found = entry.problem(par.pipeline, num_microbatches, par.virtual_stages)
    if found is None:
        return []
    field, text = found
    if field == "gradient_accumulation" and cfg.controllers.compute.batch_splitting == "dynamic":
        return []  # the controller only considers micro-batch counts the schedule accepts
    return [problem(LAYOUT_KEYS[field], text)]


def plan_compute(cfg: JobConfig, micro_batch_size: int, num_microbatches: int,
                 global_batch_size: int,
                 held_limits: tuple[int, ...] | None = None) -> ComputePlan:
    """The ComputeController's plan of a checked config (``held_limits``: the
    MemoryController's bound on what each pipeline rank holds)."""
    par, ctl = cfg.parallelism, cfg.controllers.compute
    pp = par.pipeline
    return ComputePlan(
        pp=pp, virtual_stages=par.virtual_stages, schedule=par.schedule if pp > 1 else None,
        sequence_parallel=par.sequence_parallel, micro_batch_size=micro_batch_size,
        num_microbatches=num_microbatches, global_batch_size=global_batch_size,
        stage_cut=tuple(partition_layers(cfg.model, pp * par.virtual_stages)),
        batch_splitting=ctl.batch_splitting,
        balance=BalancePlan(ctl.scheduler, ctl.balance_interval, ctl.migration_cost,
                            ctl.balance_costs),
        held_limits=held_limits if pp > 1 else None,
        overlapped_steps=steps_overlap(pp, cfg.optimization.post_validation))
