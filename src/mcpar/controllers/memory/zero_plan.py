"""The ZeRO stage's part of the MemoryController's plan: the rules a stage runs under for a config
(``capabilities.zero_layout_problems``, shared with the planner), the axis its shards are cut
over (``shard_axis``) and what each rank holds of every parameter group under it
(``plan.json``'s ``memory_placement``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from mcpar.capabilities import zero_layout_problems
from mcpar.config import JobConfig
from mcpar.registry.schedule import splits_backward
from mcpar.registry.zero import ZeroFacts, zero_stage


@dataclass(frozen=True)
class GroupPlacement:
    """Where one group of parameters and its training state live on a rank."""

    group: str  # 'dense' or 'experts'
    axis: str  # the replicas it is sharded (or reduced) over: 'dp' or 'edp'
    degree: int  # how many replicas
    parameters: str
    gradients: str
    optimizer_state: str


@dataclass(frozen=True)
class MemoryPlacement:
    """The MemoryController's placement decision: per parameter group, what each rank holds."""

    zero_stage: int
    groups: tuple[GroupPlacement, ...]

    def to_json(self) -> dict[str, object]:
        return {"zero_stage": self.zero_stage, "groups": [asdict(g) for g in self.groups]}

    def report_lines(self) -> list[str]:
        lines = [f"memory placement: ZeRO stage {self.zero_stage}"]
        for g in self.groups:
            lines.append(f"  {g.group} ({g.degree} replica{'s' if g.degree > 1 else ''} over "
                         f"'{g.axis}'): parameters "
                         f"{g.parameters}; gradients {g.gradients}; AdamW state "
                         f"{g.optimizer_state}")
        return lines


def shard_axis(cp: int) -> str:
    """The axis of the dense parameters' replicas, which ZeRO cuts its shards over (the
    MemoryController's one decision of it: the gradient sync, the parameter store, clipping and
    the checkpoint's replica coordinates read it from the plan). Context ranks hold the same
    parameters as data ranks, so under context parallelism the shards span data x context
    ('dp_cp', degree dp x cp), as the gradient all-reduce does; expert weights keep their own
    replicas, 'edp', which span the context ranks already."""
    return "dp_cp" if cp > 1 else "dp"


def reduces_every_backward(cfg: JobConfig) -> bool:
    """Whether ``cfg``'s ZeRO stage reduce-scatters the gradients after every backward pass
    (else once per step): the stage entry's rule for the config's schedule."""
    par = cfg.parallelism
    facts = ZeroFacts(dp=par.data or 1, pp=par.pipeline, vp=par.virtual_stages,
                      splits_backward=splits_backward(par.schedule, par.pipeline))
    return zero_stage(cfg.controllers.memory.zero_stage).reduces_every_backward(facts)


def plan_placement(cfg: JobConfig, dp: int, ep: int, cp: int = 1) -> MemoryPlacement:
    """What each rank holds of every parameter group under ``cfg``'s ZeRO stage (and, at
    stage 3, the parameter store's copies)."""
    mem = cfg.controllers.memory
    stage, store = mem.zero_stage, mem.allocation == "topology_aware"
    groups = [("dense", shard_axis(cp), dp * cp)]
    if ep > 1:
        groups.append(("experts", "edp", dp // ep * cp))
    placed = []
    per_backward = reduces_every_backward(cfg)
    for name, axis, n in groups:
        shard = f"a 1/{n} shard"
        if stage < 3:
            parameters = "a full copy"
        else:
            parameters = (f"{shard} (the global store); each layer gathered over '{axis}' "
                          "just before its forward and its backward, freed after")
            if mem.gather_mb > 0:
                parameters += (f"; small blocks in groups of {mem.gather_mb:g} MiB per gather "
                               "(controllers.memory.gather_mb)")
            parameters += "; the last layer (or group) kept from its forward into its backward"
            if store and name == "dense":
                parameters += ("; a node-local 1/(ranks per node) copy of each layer, filled by "
                               "the forward gather, serves the backward gather inside the node")
        placed.append(GroupPlacement(
            name, axis, n, parameters=parameters,
            gradients=("a full copy (all-reduced)" if stage == 0 else
                       f"a full buffer, reduce-scattered into {shard} once per step"
                       if stage == 1 else
                       f"{shard} (each bucket reduce-scattered and freed "
                       + ("per backward" if per_backward else
                          "once per step, after its chunk's last backward")
                       + (", inside the node then across nodes)" if store and name == "dense"
                          else ")")),
            optimizer_state="a full copy" if stage == 0 else shard))
    return MemoryPlacement(stage, tuple(placed))


def zero_problems(cfg: JobConfig, dp: int) -> list[str]:
    """ZeRO settings this version cannot honour as described; each names its key (the rules
    are shared with the planner: ``capabilities.zero_layout_problems``)."""
    par, ctl = cfg.parallelism, cfg.controllers
    if ctl.memory.zero_stage == 0:
        # The store and its codecs without ZeRO-3 are refused by ``mcpar train`` alone
        # (capabilities.unsupported_settings): plans of the seed's own file stay checkable.
        return []
    return zero_layout_problems(
        ctl.memory.zero_stage, dp, pp=par.pipeline, vp=par.virtual_stages, cp=par.context,
        topology=ctl.communication.topology,
        allocation=ctl.memory.allocation, weight_gather=ctl.communication.weight_gather,
        scheduler=ctl.compute.scheduler,
        splits_backward=splits_backward(par.schedule, par.pipeline))
