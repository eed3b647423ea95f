"""The MemoryController's placement to a memory budget: per block recompute, offload and the ZeRO
stage of the cheapest plan whose estimated peak per rank fits.

Budget: ``controllers.memory.memory_budget_gb``, else the device's capacity
(``device.memory_budget_bytes``: 90% of a GPU). Without a budget key the config is kept as given
while it fits the GPU (a run that fits is not changed behind its author's back), and on a CPU
device (its share of host RAM is no capacity to place to: a job is often checked on one machine
and run on another); the search runs when the key is set, or when a GPU cannot hold the config.

Search space (every key the user set in the YAML is kept as set; pydantic's ``model_fields_set``
tells which were):
- recompute, per block: counts of blocks with none / selective / full (blocks are alike, so the
  counts are the plan; the first blocks recompute the most: ``estimate.layer_modes``);
- offload: none, nvme, and cpu on CUDA (a CPU device has no host to move to); a candidate the
  run could not train (``capabilities.offload_problems``) is left out;
- the ZeRO stage 0-3, when the data axis has more than one rank and the layout allows it
  (``zero_plan.zero_problems``).
Keys a user set are single points of their axis; ``recompute_blocks`` set by an earlier
placement (a run directory's resolved config, every key written) is kept the same way.

Cost of a plan: the cost model's step time (``sim.costmodel.simulate``) on the machine the job
runs on (``ranking_cluster``): on CUDA the hardware table's row of the device (by its name; the
A100-80GB row when the table has none), the job's world in 8-GPU nodes, at the rates measured on
the device when its profile is valid (``sim.deviceprofile.cuda_cluster``); on CPU this machine's
calibrated local profile when it is this machine's (``sim.profilestore.lookup_profile``, the rule
the MFU's CPU peak follows too), else declared CPU figures (``DECLARED_CPU``) and why the
profile was not used, with how to calibrate. Only the ranking of plans matters here, but it
differs between machines: a slow CPU pays more for recompute against a fixed offload bandwidth
than a GPU does. The report names the machine.
The recompute term is the extra forward work, linear in the blocks of each mode (blocks are alike:
the step of a mix is the step without recompute plus each mode's share of its all-blocks extra);
ZeRO's is its extra communication as the cost model prices it; offload's is the offloaded state
read and written once per step at ``sim.hardware.OFFLOAD_BANDWIDTH``. The plan with the lowest
cost that fits is chosen (ties: fewer bytes); nothing fits: a UserError naming the budget key and
what the smallest plan needs.

Dynamic batch splitting (``controllers.compute.batch_splitting: dynamic``) sizes micro-batches to
the same budget; it is left the whole budget and no placement runs beside it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, replace

from mcpar.capabilities import offload_problems
from mcpar.config import JobConfig
from mcpar.controllers.memory.estimate import layer_modes, memory_breakdown
from mcpar.controllers.memory.zero_plan import zero_problems
from mcpar.device_select import memory_budget_bytes, select_device
from mcpar.errors import UserError, problem
from mcpar.registry.zero import ZERO_STAGES
from mcpar.sim.costmodel import simulate
from mcpar.sim.deviceprofile import cuda_cluster
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.hardware import OFFLOAD_BANDWIDTH, Cluster, LocalProfile, NodeLink
from mcpar.sim.localprofile import local_cluster
from mcpar.sim.memory import format_bytes
from mcpar.sim.profilestore import cores, lookup_profile
from mcpar.topology import ParallelDims

BUDGET_KEY = "controllers.memory.memory_budget_gb"
MODES = ("none", "selective", "full")
Blocks = tuple[int, int, int]  # blocks with none, selective, full recompute


@dataclass(frozen=True)
class DeclaredCpu:
    """A CPU without a usable local profile: round figures of a current server core (fp32 matmul
    and causal attention rates per thread, element-wise streaming, eager op and block costs,
    gloo all-reduce over loopback), stated as such in the report; the calibration replaces
    them."""

    flops_per_thread: float = 50e9
    attention_flops_per_thread: float = 15e9
    mem_bw_per_thread: float = 10e9
    mem_bw_total_per_core: float = 5e9
    op_overhead_s: float = 5e-5
    layer_overhead_s: float = 7e-4
    allreduce: tuple[float, float] = (5e-3, 4e-10)  # (alpha s, beta s/byte)

    def profile(self, cores: int) -> LocalProfile:
        return LocalProfile(
            cores=cores, flops_per_thread=self.flops_per_thread,
            attention_flops_per_thread=self.attention_flops_per_thread,
            mem_bw_per_thread=self.mem_bw_per_thread,
            mem_bw_total=self.mem_bw_total_per_core * cores, op_overhead_s=self.op_overhead_s,
            layer_overhead_s=self.layer_overhead_s, collectives={"ar": list(self.allreduce)})


DECLARED_CPU = DeclaredCpu()


@dataclass(frozen=True)
class Plan:
    """One point of the search: its settings, estimated cost (s per step) and peak bytes."""

    zero_stage: int
    offload: str
    blocks: Blocks
    step_s: float
    peak_bytes: float
    offloaded_bytes: float = 0.0

    def describe(self) -> str:
        none, selective, full = self.blocks
        if none == sum(self.blocks):
            recompute = "no recompute"
        else:
            recompute = ", ".join(f"{n} {mode}" for n, mode in
                                  ((full, "full"), (selective, "selective"), (none, "none")) if n)
            recompute = f"recompute {recompute}"
        return f"ZeRO {self.zero_stage}, offload {self.offload}, {recompute}"

    def settings(self) -> dict[str, object]:
        """The memory section's keys this plan sets."""
        none, selective, full = self.blocks
        uniform = next((m for m, n in zip(MODES, self.blocks, strict=True)
                        if n == sum(self.blocks)), None)
        return {"zero_stage": self.zero_stage, "offload": self.offload,
                "activation_checkpointing": uniform or ("full" if full else "selective"),
                "recompute_blocks": None if uniform else [none, selective, full]}

    def to_json(self) -> dict[str, object]:
        return {"zero_stage": self.zero_stage, "offload": self.offload,
                "recompute_blocks": {"none": self.blocks[0], "selective": self.blocks[1],
                                     "full": self.blocks[2]},
                "step_s": self.step_s, "peak_bytes": round(self.peak_bytes),
                "offloaded_bytes": round(self.offloaded_bytes)}


@dataclass
class Placement:
    """The chosen plan, the budget, and the cheaper plans that did not fit."""

    chosen: Plan
    budget: float
    budget_source: str
    searched: int
    rejected: list[Plan] = field(default_factory=list)
    fixed: list[str] = field(default_factory=list)  # keys the user set: not searched
    machine: str = ""  # what the plans were ranked on (``ranking_cluster``)

    def report_lines(self) -> list[str]:
        if not self.searched and not self.budget:
            return [f"memory budget: none set: the config as given; set {BUDGET_KEY} to place "
                    "recompute, offload and the ZeRO stage to a budget"]
        if not self.searched:
            return [f"memory budget: {format_bytes(self.budget)} per rank ({self.budget_source}): "
                    f"the config as given fits ({format_bytes(self.chosen.peak_bytes)}); set "
                    f"{BUDGET_KEY} to place to a budget"]
        lines = [f"memory budget: {format_bytes(self.budget)} per rank ({self.budget_source}); "
                 f"{self.searched} plans searched"
                 + (f" (kept as set: {', '.join(self.fixed)})" if self.fixed else ""),
                 f"  chosen: {self.chosen.describe()}: {format_bytes(self.chosen.peak_bytes)}, "
                 f"step {self.chosen.step_s * 1e3:.2f} ms (cost model)",
                 f"  ranked on: {self.machine}"]
        if not self.rejected:
            lines.append("  why: the cheapest plan searched, and it fits")
            return lines
        lines.append(f"  why: the {len(self.rejected)} cheaper plan(s) do not fit, e.g.:")
        lines += [f"    {p.describe()}: {format_bytes(p.peak_bytes)} > budget, step "
                  f"{p.step_s * 1e3:.2f} ms" for p in self.rejected[:4]]
        return lines

    def to_json(self) -> dict[str, object]:
        return {"budget_bytes": round(self.budget), "budget_source": self.budget_source,
                "searched": self.searched, "ranked_on": self.machine,
                "chosen": self.chosen.to_json(),
                "cheaper_rejected": [p.to_json() for p in self.rejected]}


def budget_bytes(cfg: JobConfig, local_world_size: int) -> tuple[float, str]:
    """The budget and where it comes from."""
    gb = cfg.controllers.memory.memory_budget_gb
    if gb:
        return gb * 2**30, BUDGET_KEY
    device = select_device(cfg.training.device).torch_device(0)
    return memory_budget_bytes(device, local_world_size), f"the {device.type} device's capacity"


def with_settings(cfg: JobConfig, settings: dict[str, object]) -> JobConfig:
    mem = cfg.controllers.memory.model_copy(update=settings)
    return cfg.model_copy(update={"controllers": cfg.controllers.model_copy(
        update={"memory": mem})})


def _axes(cfg: JobConfig, dims: ParallelDims, device_type: str) -> tuple[list[int], list[str],
                                                                          list[Blocks],
                                                                          list[str]]:
    """(ZeRO stages, offloads, recompute block counts) to search, and the keys kept as set."""
    mem = cfg.controllers.memory
    user = mem.model_fields_set
    layers = cfg.model.num_layers
    fixed = sorted(k for k in ("zero_stage", "offload", "activation_checkpointing",
                               "recompute_blocks") if k in user)
    stages = [mem.zero_stage]
    if "zero_stage" not in user and dims.dp_cp > 1:
        stages = [z.stage for z in ZERO_STAGES
                  if not zero_problems(with_settings(cfg, {"zero_stage": z.stage}), dims.dp)]
    offloads = [mem.offload] if "offload" in user else \
        ["none", "nvme"] + (["cpu"] if device_type == "cuda" else [])
    if "recompute_blocks" in user and mem.recompute_blocks is not None:
        none, selective, full = mem.recompute_blocks  # three counts (the schema's bounds)
        blocks = [(none, selective, full)]
    elif "activation_checkpointing" in user:
        if mem.activation_checkpointing not in MODES:
            raise UserError(problem(
                BUDGET_KEY, f"the placement to a budget mixes the recompute modes {MODES} per "
                f"block; {mem.activation_checkpointing!r} is not one of them: set "
                "controllers.memory.activation_checkpointing to one, or leave the budget unset"))
        mode = MODES.index(mem.activation_checkpointing)
        blocks = [(layers if mode == 0 else 0, layers if mode == 1 else 0,
                   layers if mode == 2 else 0)]
    else:
        # MoE blocks cannot replay their routing (capabilities.py): no full recompute there.
        full_max = 0 if cfg.model.is_moe else layers
        blocks = [(layers - s - f, s, f) for f in range(full_max + 1)
                  for s in range(layers - f + 1)]
    return stages, offloads, blocks, fixed


def _blocks(cfg: JobConfig) -> tuple[int, int, int]:
    """The config's blocks per recompute mode (none, selective, full)."""
    modes = layer_modes(cfg)
    return modes.count("none"), modes.count("selective"), modes.count("full")


def _cpu_profile() -> tuple[LocalProfile, str]:
    """This machine's calibrated profile when it is valid here (``lookup_profile``: the MFU's
    CPU peak reads the same), else the declared figures; with the words the report says of it."""
    found = lookup_profile()
    if found.profile is not None:
        return found.profile, f"this machine's calibrated local profile ({found.path})"
    n = cores()
    return DECLARED_CPU.profile(n), (f"this machine's CPU ({n} cores), declared figures "
                                     f"({found.why}: python -m mcpar.sim.localprofile "
                                     "calibrates it)")


def ranking_cluster(device_type: str, world: int, nodes: NodeLink | None = None
                    ) -> tuple[Cluster, str]:
    """The machine plans are ranked on, ``world`` devices of it, and its name for the report.
    On CPU, ``nodes`` spreads the workers over nodes joined by a link (one node without it); a
    CUDA host's devices are one node, and between hosts the table's network figures hold."""
    if device_type == "cuda":
        return cuda_cluster(world)
    profile, what = _cpu_profile()
    where = f"{what}, {world} worker(s)"
    if nodes is not None and nodes.ranks_per_node < world:
        where += f" in {nodes.describe()}"
    return replace(local_cluster(profile, nodes=nodes), num_gpus=world), where


def _step_s(cfg: JobConfig, dims: ParallelDims, cluster: Cluster) -> float:
    world = dims.world_size
    layout = config_layout(cfg, world)
    if layout.precision not in cluster.accel.peak_flops:  # a CPU's profile has fp32 alone
        layout = replace(layout, precision="fp32")
    return simulate(config_model(cfg), layout, cluster, validate=False).step_s


def search(cfg: JobConfig, dims: ParallelDims, device_type: str,
           machine: tuple[Cluster, str] | None = None) -> tuple[list[Plan], list[str]]:
    """Every plan of the search space, cheapest first (ties: fewer bytes), and the fixed keys;
    ranked on ``machine`` (default: ``ranking_cluster(device_type, ...)``)."""
    cluster = (machine or ranking_cluster(device_type, dims.world_size))[0]
    stages, offloads, blocks, fixed = _axes(cfg, dims, device_type)
    layers = cfg.model.num_layers
    mem_offload = cfg.controllers.memory.offload
    plans = []
    for z in stages:
        base = with_settings(cfg, {"zero_stage": z, "offload": "none",
                                   "recompute_blocks": None})
        # Steps with every block in one mode: a mix costs each mode's share of the extra.
        uniform = {mode: _step_s(with_settings(base, {"activation_checkpointing": mode}), dims,
                                 cluster) for mode in MODES}
        for offload, counts in itertools.product(offloads, blocks):
            plan = Plan(z, offload, counts, 0.0, 0.0)
            candidate = with_settings(cfg, plan.settings())
            if offload != mem_offload and offload_problems(candidate):
                continue  # an offload this run cannot use (device, optimizer, checkpoints)
            mem = memory_breakdown(candidate, dims)
            step = uniform["none"] + sum(
                n / layers * (uniform[mode] - uniform["none"])
                for mode, n in zip(MODES, counts, strict=True))
            if offload != "none":
                step += 2 * mem.offloaded / OFFLOAD_BANDWIDTH[offload]  # read and write back
            plans.append(Plan(z, offload, counts, step, mem.per_rank, mem.offloaded))
    plans.sort(key=lambda p: (p.step_s, p.peak_bytes, p.describe()))
    return plans, fixed


def place(cfg: JobConfig, dims: ParallelDims, local_world_size: int | None = None,
          ) -> Placement | None:
    """The placement to the budget: the chosen plan (``chosen.settings()``: the memory keys it
    sets, when ``searched``), or None when dynamic batch splitting owns the budget. Raises
    UserError when no plan fits."""
    if cfg.controllers.compute.batch_splitting == "dynamic":
        return None
    device_type = select_device(cfg.training.device).type
    if cfg.controllers.memory.memory_budget_gb is None:
        # No budget asked for: the config as given, while it fits a GPU. A CPU's share of host
        # RAM is no capacity to place to (the job may be checked here and run elsewhere).
        mem = memory_breakdown(cfg, dims)
        given = Plan(cfg.controllers.memory.zero_stage, cfg.controllers.memory.offload,
                     _blocks(cfg), 0.0, mem.per_rank, mem.offloaded)
        if device_type != "cuda":
            return Placement(given, 0.0, "none set", 0)
        budget, source = budget_bytes(cfg, local_world_size or dims.world_size)
        if mem.per_rank <= budget:
            return Placement(given, budget, source, 0)
    budget, source = budget_bytes(cfg, local_world_size or dims.world_size)
    machine = ranking_cluster(device_type, dims.world_size)
    plans, fixed = search(cfg, dims, device_type, machine)
    fitting = [p for p in plans if p.peak_bytes <= budget]
    if not fitting:
        smallest = min(plans, key=lambda p: p.peak_bytes)
        raise UserError(problem(
            BUDGET_KEY, f"no plan fits {format_bytes(budget)} per rank ({source}); the smallest "
            f"of the {len(plans)} searched ({smallest.describe()}) needs "
            f"{format_bytes(smallest.peak_bytes)} ({round(smallest.peak_bytes):,} B): raise the "
            "budget to at least that, or use more ranks (parallelism.*), a smaller "
            "optimization.micro_batch_size"
            + (", or leave the memory settings to the placement (" + ", ".join(
                f"controllers.memory.{k}" for k in fixed) + " are set)" if fixed else "")))
    chosen = fitting[0]
    rejected = [p for p in plans if p.step_s < chosen.step_s and p.peak_bytes > budget]
    return Placement(chosen, budget, source, len(plans), rejected, fixed, machine[1])
