"""The resolved plan of a job: a validated config plus the world resolve into a frozen JobPlan.

``resolve_plan`` is the one place where a config meets a world size: it runs every cross-field
check (degrees against the world and the model, batch divisibility, schedule, gradient exchange,
node layout), derives what the config leaves open (the data degree, the micro-batch count, the
global batch) and asks each controller for its plan:

- ComputeController: ``ComputePlan`` (schedule, stage cut, micro-batches, expert balancing);
- MemoryController: ``MemoryPlan`` (ZeRO stage, store, offload, recompute, the estimate), after
  the placement to the memory budget;
- CommunicationController: ``CommPlan`` (the gradient exchange).

Each plan builds its runtime; the runtime reads plans, never ``controllers.*``. ``mcpar check``,
``mcpar train`` (the launcher and every worker) and ``mcpar simulate`` all go through here, so
they accept and refuse the same configs. ``JobPlan.config`` is a new, frozen config with the
derived values filled in (the run directory's ``config.yaml``, a record of the decisions);
dynamic batch splitting produces a new plan (``with_split``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from mcpar.capabilities import ContextFacts, context_layout_problems
from mcpar.config import JobConfig
from mcpar.controllers.communication.plan import (
    CommPlan,
    communication_problems,
    plan_communication,
)
from mcpar.controllers.compute.plan import (
    ComputePlan,
    plan_compute,
    post_validation_problems,
    schedule_problems,
)
from mcpar.controllers.memory.estimate import estimate_memory
from mcpar.controllers.memory.placement import place, with_settings
from mcpar.controllers.memory.plan import MemoryPlan, plan_memory, recompute_problems
from mcpar.controllers.memory.zero_plan import zero_problems
from mcpar.elastic import ElasticChange, elastic_layout
from mcpar.errors import UserError, problem
from mcpar.sim.hardware import NodeLink
from mcpar.topology import ParallelDims, replica_ranks, split_dp_by_node


class LayoutChoice(Protocol):
    """``parallelism.auto``'s choice (``auto_layout.AutoLayout``), as the plan carries it."""

    ranked_on: str  # the machine it was priced on
    nodes: NodeLink | None  # the nodes and link, where the job spans several

    def to_json(self) -> dict[str, object]: ...

    def report_lines(self) -> list[str]: ...

    @property
    def predicted_step_s(self) -> float: ...


def collective_timeout_s(cfg: JobConfig) -> float:
    """The process groups' timeout: under training.elastic, a lost peer is waited for
    ``wait_s`` at most, so that the workers left fail fast and are restarted without it."""
    training = cfg.training
    if training.elastic is None:
        return training.collective_timeout_s
    return min(training.collective_timeout_s, training.elastic.wait_s)


@dataclass(frozen=True)
class JobPlan:
    """Everything a run is, once resolved; ``plan.json`` in the run directory."""

    config: JobConfig  # the user's config with the derived values filled in (frozen)
    world_size: int
    dp: int
    tp: int
    pp: int
    ep: int
    compute: ComputePlan
    memory: MemoryPlan
    communication: CommPlan
    auto: LayoutChoice | None = None  # parallelism.auto's choice (auto_layout.py), else None
    cp: int = 1  # context-parallel degree
    context_mode: str = "ring"  # how attention runs over the context axis (ring | ulysses)
    elastic: ElasticChange | None = None  # training.elastic's re-plan for a smaller world

    @property
    def collective_timeout_s(self) -> float:
        """The process groups' timeout (``collective_timeout_s``)."""
        return collective_timeout_s(self.config)

    # The compute plan's batch and pipeline terms, which most readers of a plan want.
    @property
    def virtual_stages(self) -> int:
        return self.compute.virtual_stages

    @property
    def sequence_parallel(self) -> bool:
        return self.compute.sequence_parallel

    @property
    def micro_batch_size(self) -> int:
        return self.compute.micro_batch_size

    @property
    def num_microbatches(self) -> int:
        return self.compute.num_microbatches

    @property
    def global_batch_size(self) -> int:
        return self.compute.global_batch_size

    @property
    def schedule(self) -> str | None:
        return self.compute.schedule

    @property
    def stage_cut(self) -> tuple[tuple[int, int], ...]:
        return self.compute.stage_cut

    def parallel_dims(self) -> ParallelDims:
        """A new ParallelDims of this plan's degrees (it holds the process groups it builds)."""
        return ParallelDims(dp=self.dp, tp=self.tp, pp=self.pp, ep=self.ep, cp=self.cp,
                            world_size=self.world_size)

    def with_split(self, micro_batch_size: int, num_microbatches: int) -> JobPlan:
        """This plan with another micro-batch split of the same global batch (dynamic batch
        splitting); the config, memory estimate and checks follow."""
        if micro_batch_size * num_microbatches * self.dp != self.global_batch_size:
            raise ValueError(f"{num_microbatches} x {micro_batch_size} x data {self.dp} is not "
                             f"the global batch {self.global_batch_size}")
        opt = self.config.optimization.model_copy(update={
            "micro_batch_size": micro_batch_size, "gradient_accumulation": num_microbatches})
        config = self.config.model_copy(update={"optimization": opt})
        problems = schedule_problems(config, num_microbatches)
        if problems:
            raise UserError(problems)
        compute = dataclasses.replace(self.compute.with_split(micro_batch_size,
                                                              num_microbatches),
                                      batch_splitting="dynamic")
        return dataclasses.replace(
            self, config=config, compute=compute,
            memory=self.memory.with_estimate(estimate_memory(config, self.parallel_dims())))

    def to_json(self) -> dict[str, object]:
        compute, memory = self.compute, self.memory
        return {
            "world_size": self.world_size,
            "degrees": {"data": self.dp, "tensor": self.tp, "pipeline": self.pp,
                        "experts": self.ep, "context": self.cp},
            "context_mode": self.context_mode,
            "mesh": {"order": ["pp", "dp", "cp", "tp"], "virtual_stages": compute.virtual_stages,
                     "sequence_parallel": compute.sequence_parallel},
            "batch": {"micro_batch_size": compute.micro_batch_size,
                      "num_microbatches": compute.num_microbatches,
                      "global_batch_size": compute.global_batch_size,
                      "batch_splitting": compute.batch_splitting},
            "schedule": compute.schedule,
            # A split schedule held to 1F1B's activation peak: the most chunk activations each
            # pipeline rank holds (None: unbounded).
            "schedule_held_limits": (None if compute.held_limits is None
                                     else list(compute.held_limits)),
            "stage_cut": [list(r) for r in compute.stage_cut],
            "grad_exchange": self.communication.to_json(),
            "memory": {"params_per_rank": memory.estimate.params_per_rank,
                       **{name: value for name, value in memory.estimate.rows()}},
            "memory_placement": memory.holdings.to_json(),
            **({"memory_plan": memory.budget.to_json()} if memory.budget else {}),
            **({"auto": self.auto.to_json()} if self.auto is not None else {}),
            **({"elastic": self.elastic.to_json()} if self.elastic is not None else {}),
        }


def resolve_plan(cfg: JobConfig, world_size: int | None) -> JobPlan:
    """The plan of ``cfg`` on ``world_size`` workers (None: what the degrees multiply to, for
    ``mcpar check``). Raises UserError listing every problem found.

    Under ``training.elastic``, a world smaller than the layout asks is planned first with a
    smaller data degree and more micro-batches, the global batch kept (``mcpar.elastic``)."""
    cfg, elastic = elastic_layout(cfg, world_size)
    par, opt = cfg.parallelism, cfg.optimization
    problems: list[str] = []
    tp, pp, cp = par.tensor, par.pipeline, par.context
    per_replica = replica_ranks(tp, pp, cp)
    groups = f"tensor {tp} x pipeline {pp}" + (f" x context {cp}" if cp > 1 else "")
    dp = par.data
    if dp is None:
        if world_size is None:
            dp = 1
        elif world_size % per_replica:
            problems.append(problem(
                "parallelism.data",
                f"{world_size} workers cannot be split into {groups} groups; "
                f"use a world size divisible by {per_replica}",
            ))
            dp = 1
        else:
            dp = world_size // per_replica
    if world_size is not None and dp * per_replica != world_size:
        problems.append(problem(
            "parallelism",
            f"the layout needs data {dp} x {groups} = {dp * per_replica} devices, "
            f"but the job has {world_size}; change the degrees or the number of workers",
        ))
    problems += model_layout_problems(cfg, dp)
    problems += context_problems(cfg)
    problems += communication_problems(cfg, dp)
    problems += zero_problems(cfg, dp)
    problems += recompute_problems(cfg)
    accum = opt.gradient_accumulation
    if opt.global_batch_size is not None:
        per_micro = opt.micro_batch_size * dp
        if opt.global_batch_size % per_micro:
            problems.append(problem(
                "optimization.global_batch_size",
                f"{opt.global_batch_size} is not divisible by micro_batch_size "
                f"{opt.micro_batch_size} x data {dp} = {per_micro}",
            ))
        elif accum is not None and accum * per_micro != opt.global_batch_size:
            problems.append(problem(
                "optimization.gradient_accumulation",
                f"{accum} x micro_batch_size {opt.micro_batch_size} x data {dp} != "
                f"global_batch_size {opt.global_batch_size}; set one of them only",
            ))
        else:
            accum = opt.global_batch_size // per_micro
    num_micro = accum or 1
    problems += schedule_problems(cfg, num_micro)
    problems += post_validation_problems(cfg)
    rpn = cfg.cluster.ranks_per_node
    if (rpn is not None and world_size is not None and not problems
            and cfg.controllers.communication.topology != "flat"):
        if world_size % rpn:
            problems.append(problem(
                "cluster.ranks_per_node",
                f"{world_size} ranks do not fill nodes of {rpn}; use a divisor of {world_size}",
            ))
        else:
            try:
                split_dp_by_node(ParallelDims(dp=dp, tp=tp, pp=pp, ep=par.experts, cp=cp,
                                              world_size=world_size),
                                 [r // rpn for r in range(world_size)])
            except UserError as err:
                problems += err.problems
    if problems:
        raise UserError(problems)
    global_batch = opt.micro_batch_size * num_micro * dp
    resolved = cfg.model_copy(update={
        "parallelism": par.model_copy(update={"data": dp}),
        "optimization": opt.model_copy(update={"gradient_accumulation": num_micro,
                                               "global_batch_size": global_batch}),
    })
    dims = ParallelDims(dp=dp, tp=tp, pp=pp, ep=par.experts, cp=cp,
                        world_size=dp * per_replica)
    # The MemoryController first: recompute per block, offload and ZeRO stage to the memory
    # budget (what the user left unset); the exchange serves its ZeRO stage.
    memory = plan_memory(resolved, dims, place(resolved, dims))
    resolved = with_settings(resolved, memory.settings)  # config.yaml records the decision
    return JobPlan(
        config=resolved, world_size=dims.world_size, dp=dp, tp=tp, pp=pp, ep=par.experts,
        compute=plan_compute(resolved, opt.micro_batch_size, num_micro, global_batch,
                             memory.held_limits),
        memory=memory,
        # The gradients' replicas: the data ranks, times the context ranks (which hold the
        # same parameters and see other tokens of the same sequences).
        communication=plan_communication(resolved, dp * cp, memory.zero_stage),
        cp=cp, context_mode=par.context_mode, elastic=elastic,
    )


def model_layout_problems(cfg: JobConfig, dp: int) -> list[str]:
    """The model's shape against the parallel degrees."""
    par, model = cfg.parallelism, cfg.model
    tp, pp = par.tensor, par.pipeline
    problems: list[str] = []
    if model.hidden_size % model.num_heads:
        problems.append(problem(
            "model.num_heads",
            f"{model.num_heads} heads do not divide hidden_size {model.hidden_size}",
        ))
    if model.num_heads % tp:
        problems.append(problem(
            "model.num_heads",
            f"{model.num_heads} heads are not divisible by parallelism.tensor {tp}",
        ))
    if model.ffn_size % tp:
        problems.append(problem(
            "model.ffn_hidden_size",
            f"{model.ffn_size} is not divisible by parallelism.tensor {tp}",
        ))
    if model.vocab_size % tp:
        problems.append(problem(
            "model.vocab_size",
            f"{model.vocab_size} is not divisible by parallelism.tensor {tp} (the vocabulary "
            "is split over tensor ranks)",
        ))
    if par.sequence_parallel and tp == 1:
        problems.append(problem(
            "parallelism.sequence_parallel",
            "shards the sequence over tensor ranks; it needs parallelism.tensor > 1",
        ))
    if par.sequence_parallel and model.seq_len % tp:
        problems.append(problem(
            "model.seq_len",
            f"{model.seq_len} is not divisible by parallelism.tensor {tp} "
            "(sequence parallelism splits it)",
        ))
    if model.num_layers < pp * par.virtual_stages:
        problems.append(problem(
            "model.num_layers",
            f"{model.num_layers} layers cannot fill pipeline {pp} x virtual_stages "
            f"{par.virtual_stages} stages; a stage would be empty",
        ))
    if model.tie_embeddings and pp > 1:
        problems.append(problem(
            "model.tie_embeddings",
            "a tied embedding cannot be split between the first and last pipeline stages; "
            "set it to false or use parallelism.pipeline 1",
        ))
    if dp % par.experts:
        problems.append(problem(
            "parallelism.experts",
            f"expert degree {par.experts} does not divide the data degree {dp} (the expert "
            f"axis is carved out of the data axis); use a divisor of {dp}",
        ))
    # The family's own rules against the degrees (its registry entry).
    problems += model.family.layout_problems(model, tp, par.experts, par.sequence_parallel)
    return problems


def context_problems(cfg: JobConfig) -> list[str]:
    """Context parallelism's rules against the rest of the config (``capabilities.
    context_layout_problems``, which the planner applies to its layouts too)."""
    par, model = cfg.parallelism, cfg.model
    mem, com = cfg.controllers.memory, cfg.controllers.communication
    return context_layout_problems(ContextFacts(
        cp=par.context, mode=par.context_mode, seq_len=model.seq_len,
        heads_per_tensor_rank=model.num_heads // par.tensor,
        zero_stage=mem.zero_stage, allocation=mem.allocation,
        recompute=mem.activation_checkpointing,
        compression=com.compression, topology=com.topology, dropout=model.dropout > 0,
        compile=cfg.training.compile, kind=model.kind,
        has_plan=getattr(model.family, "context_parallel", None) is not None))
