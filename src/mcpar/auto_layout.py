"""``parallelism.auto``: the layout the cost model predicts fastest, chosen before the plan is
resolved, so that ``mcpar train`` runs it, ``mcpar check`` prints it, and ``summary.json``
compares its prediction with the measured step.

What is searched: the tensor, pipeline, context (each context mode) and data degrees of the
world (and the expert degree of an MoE model), chunks per pipeline rank, every registered
schedule, the micro-batch size (the global batch stays the config's), every registered ZeRO
stage, recompute policy and gradient codec. Every key the user set stays as set; what is not
searched keeps the config's value (precision, offload, topology, the store). Each layout is
priced by the same cost model and memory estimate ``mcpar check`` prints, on the machine the job
runs on (the memory controller's ``ranking_cluster``: the calibrated local profile on CPU, the
device's row of the hardware table on CUDA), and checked by the same rules ``mcpar train``
applies: the choice is the fastest layout that resolves, trains and fits the memory budget. A
CPU job whose ranks span nodes is priced over them: what crosses a node's link on that link
(the ``cluster`` keys' figures, or what its torchrun workers measure at start:
``comm.node_link_probe``), the rest on the profile.

The search runs in two passes to stay within a second: every degree/schedule/micro-batch core
is priced with the config's memory settings under each codec, then the memory and codec
variants of the ``REFINED_CORES`` fastest cores. Workers resolve their run directory's config,
in which every key is set: their search is the chosen layout alone, priced the same way.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from dataclasses import replace as dc_replace

from mcpar.capabilities import unsupported_settings
from mcpar.config import JobConfig
from mcpar.controllers.communication.plan import communication_problems
from mcpar.controllers.memory.estimate import memory_breakdown
from mcpar.controllers.memory.placement import budget_bytes, ranking_cluster
from mcpar.device_select import select_device
from mcpar.errors import UserError, problem
from mcpar.plan import JobPlan, resolve_plan
from mcpar.registry.codec import CODECS
from mcpar.registry.recompute import RECOMPUTE_POLICIES
from mcpar.registry.schedule import SCHEDULES
from mcpar.registry.zero import ZERO_STAGES
from mcpar.sim.costmodel import simulate
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.hardware import NodeLink
from mcpar.sim.memory import format_bytes
from mcpar.topology import ParallelDims, replica_ranks

AUTO_KEY = "parallelism.auto"
AUTO_LAYOUT_FILE = "auto_layout.json"  # the run directory's copy of the ranking
REFINED_CORES = 6  # cores whose memory and codec variants are priced in the second pass
SHOWN = 5  # layouts `mcpar check` and plan.json list
MAX_MICRO_BATCH = 64


@dataclass(frozen=True)
class Choice:
    """One priced layout: the keys it sets, and what the cost model predicts of it."""

    settings: dict[str, object] = field(hash=False)
    step_s: float
    peak_bytes: float
    # The data-parallel traffic the step waits for after its compute (the cost model's exposed
    # ``dp_comm``); the rest of the step is compute and in-step communication.
    dp_exposed_s: float = 0.0

    def describe(self) -> str:
        s = self.settings
        text = (f"tensor {s['parallelism.tensor']} x pipeline {s['parallelism.pipeline']} x "
                f"data {s['parallelism.data']}")
        if s.get("parallelism.context", 1) != 1:
            text += f" x context {s['parallelism.context']} ({s['parallelism.context_mode']})"
        if s.get("parallelism.experts", 1) != 1:
            text += f", experts {s['parallelism.experts']}"
        if s["parallelism.pipeline"] != 1:
            text += (f", {s['parallelism.schedule']}"
                     + (f" vp {s['parallelism.virtual_stages']}"
                        if s["parallelism.virtual_stages"] != 1 else ""))
        return (text + f", micro-batch {s['optimization.micro_batch_size']}, ZeRO "
                f"{s['controllers.memory.zero_stage']}, recompute "
                f"{s['controllers.memory.activation_checkpointing']}, codec "
                f"{s['controllers.communication.compression']}")

    def to_json(self) -> dict[str, object]:
        return {"layout": self.describe(), "settings": self.settings,
                "predicted_step_s": self.step_s, "predicted_peak_bytes": round(self.peak_bytes),
                "predicted_dp_exposed_s": self.dp_exposed_s}


@dataclass(frozen=True)
class AutoLayout:
    """The planner's choice for ``parallelism.auto`` and how it was reached."""

    chosen: Choice
    runners_up: list[Choice]  # the next fastest that resolve, train and fit
    ranked_on: str  # the machine the layouts were priced on
    fixed: list[str]  # keys the user set, kept
    budget_bytes: float
    budget_source: str
    priced: int
    dropped: dict[str, int]  # reason -> layouts
    seconds: float
    nodes: NodeLink | None = None  # the nodes and link the layouts were priced over, if several

    @property
    def predicted_step_s(self) -> float:
        return self.chosen.step_s

    def report_lines(self) -> list[str]:
        lines = [f"auto layout ({AUTO_KEY}): {self.chosen.describe()}; predicted "
                 f"{self.chosen.step_s:.4g} s/step, {format_bytes(self.chosen.peak_bytes)} per "
                 f"rank; ranked on {self.ranked_on}",
                 f"  {self.priced} layouts priced in {self.seconds:.2f} s"
                 + (f"; kept as set: {', '.join(self.fixed)}" if self.fixed else "")]
        for rank, c in enumerate([self.chosen, *self.runners_up], 1):
            lines.append(f"  {rank}. {c.step_s:.4g} s/step  {format_bytes(c.peak_bytes):>10}  "
                         f"{c.describe()}")
        if self.dropped:
            lines.append("  dropped: " + ", ".join(f"{n} {why}"
                                                    for why, n in self.dropped.items()))
        return lines

    def to_json(self) -> dict[str, object]:
        return {"chosen": self.chosen.to_json(),
                "runners_up": [c.to_json() for c in self.runners_up],
                "ranked_on": self.ranked_on, "fixed": self.fixed,
                "budget_bytes": round(self.budget_bytes), "budget_source": self.budget_source,
                "priced": self.priced, "dropped": self.dropped, "seconds": self.seconds}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# The keys the search sets (each kept as the user set it).
SEARCHED = ("parallelism.tensor", "parallelism.pipeline", "parallelism.context",
            "parallelism.context_mode", "parallelism.data",
            "parallelism.experts", "parallelism.virtual_stages", "parallelism.schedule",
            "optimization.micro_batch_size", "optimization.gradient_accumulation",
            "optimization.global_batch_size", "controllers.memory.zero_stage",
            "controllers.memory.activation_checkpointing",
            "controllers.communication.compression")


def _user_keys(cfg: JobConfig) -> set[str]:
    """The searched keys the user set (the config file, the overrides)."""
    sections = {"parallelism": cfg.parallelism, "optimization": cfg.optimization,
                "controllers.memory": cfg.controllers.memory,
                "controllers.communication": cfg.controllers.communication}
    return {f"{name}.{key}" for name, section in sections.items()
            for key in section.model_fields_set} & set(SEARCHED)


def _global_batch(cfg: JobConfig, world: int) -> int:
    """The sequences per step the config asks for: ``global_batch_size``, else what its own
    degrees would run (micro-batch x accumulation x the data degree the world leaves)."""
    opt, par = cfg.optimization, cfg.parallelism
    if opt.global_batch_size is not None:
        return opt.global_batch_size
    data = par.data or max(1, world // replica_ranks(par.tensor, par.pipeline, par.context))
    return opt.micro_batch_size * (opt.gradient_accumulation or 1) * data


def _options(cfg: JobConfig, user: set[str], key: str, values: list[object]) -> list[object]:
    """The values searched for ``key``: the config's alone when the user set it."""
    section, name = key.rsplit(".", 1)
    current = cfg
    for part in section.split("."):
        current = getattr(current, part)
    return [getattr(current, name)] if key in user else values


def _cores(cfg: JobConfig, world: int, batch: int, user: set[str]) -> list[dict[str, object]]:
    """Every degree / chunk / schedule / micro-batch combination of the world."""
    m = cfg.model
    out = []
    for tp, pp, cp in itertools.product(
            _options(cfg, user, "parallelism.tensor", _divisors(world)),
            _options(cfg, user, "parallelism.pipeline", _divisors(world)),
            _options(cfg, user, "parallelism.context", _divisors(world))):
        tp, pp, cp = int(tp), int(pp), int(cp)  # type: ignore[call-overload]
        if world % (tp * pp * cp) or pp > m.num_layers:
            continue
        dp = world // (tp * pp * cp)
        # Each context mode, when the axis is there (the plan's rule refuses what does not run).
        modes = (_options(cfg, user, "parallelism.context_mode", ["ring", "ulysses"])
                 if cp > 1 else [cfg.parallelism.context_mode])
        if "parallelism.data" in user and cfg.parallelism.data not in (None, dp):
            continue
        if batch % dp:
            continue
        eps = _options(cfg, user, "parallelism.experts",
                       [e for e in _divisors(dp) if m.num_experts % e == 0] if m.is_moe else [1])
        vps = _options(cfg, user, "parallelism.virtual_stages",
                       [v for v in (1, 2) if pp > 1 or v == 1])
        micro = _options(cfg, user, "optimization.micro_batch_size",
                         [b for b in _divisors(batch // dp) if b <= MAX_MICRO_BATCH])
        for ep, vp, b, mode in itertools.product(eps, vps, micro, modes):
            schedules = _options(cfg, user, "parallelism.schedule",
                                 [s.name for s in SCHEDULES] if pp > 1 else
                                 [cfg.parallelism.schedule])
            for schedule in schedules:
                rule = SCHEDULES.get(str(schedule)) if pp > 1 else None
                if rule is not None and rule.problem(pp, batch // (dp * int(b)), int(vp)):
                    continue  # the schedule's own rule (chunks per rank, micro-batches)
                out.append({"parallelism.tensor": tp, "parallelism.pipeline": pp,
                            "parallelism.context": cp, "parallelism.context_mode": mode,
                            "parallelism.data": dp, "parallelism.experts": ep,
                            "parallelism.virtual_stages": vp, "parallelism.schedule": schedule,
                            "optimization.micro_batch_size": b,
                            "optimization.gradient_accumulation": batch // (dp * int(b)),
                            "optimization.global_batch_size": batch})
    return out


def _variants(cfg: JobConfig, user: set[str]) -> list[dict[str, object]]:
    """Every ZeRO stage x recompute policy x codec, the user's keys kept."""
    stages = _options(cfg, user, "controllers.memory.zero_stage", [z.stage for z in ZERO_STAGES])
    policies = _options(cfg, user, "controllers.memory.activation_checkpointing",
                        [p.name for p in RECOMPUTE_POLICIES])
    codecs = _options(cfg, user, "controllers.communication.compression",
                      [c.name for c in CODECS])
    return [{"controllers.memory.zero_stage": z,
             "controllers.memory.activation_checkpointing": r,
             "controllers.communication.compression": c}
            for z, r, c in itertools.product(stages, policies, codecs)]


def with_keys(cfg: JobConfig, settings: dict[str, object]) -> JobConfig:
    """``cfg`` with dotted keys set (each one counted as set, as a user's would be)."""
    updates: dict[str, dict[str, object]] = {}
    for key, value in settings.items():
        section, name = key.rsplit(".", 1)
        updates.setdefault(section, {})[name] = value
    for section, values in updates.items():
        parts = section.split(".")
        parents = [cfg]
        for part in parts:
            parents.append(getattr(parents[-1], part))
        node = parents[-1].model_copy(update=values)
        for parent, part in zip(reversed(parents[:-1]), reversed(parts), strict=True):
            node = parent.model_copy(update={part: node})
        cfg = node  # type: ignore[assignment]
    return cfg


def _price(cfg: JobConfig, settings: dict[str, object], cluster: object
           ) -> tuple[JobConfig, Choice] | None:
    """The config of ``settings`` and its prediction, None where the cost model finds the
    layout invalid (degrees the model does not split into)."""
    candidate = with_keys(cfg, settings)
    par = candidate.parallelism
    dp = par.data or 1
    dims = ParallelDims(dp=dp, tp=par.tensor, pp=par.pipeline, ep=par.experts, cp=par.context,
                        world_size=dp * replica_ranks(par.tensor, par.pipeline, par.context))
    try:
        layout = config_layout(candidate, dims.world_size)
        if layout.precision not in cluster.accel.peak_flops:  # type: ignore[attr-defined]
            layout = dc_replace(layout, precision="fp32")  # a CPU's profile has fp32 alone
        pred = simulate(config_model(candidate), layout, cluster,  # type: ignore[arg-type]
                        where=AUTO_KEY)
        peak = memory_breakdown(candidate, dims).per_rank
    except UserError:
        return None
    return candidate, Choice(dict(settings), pred.step_s, peak, pred.breakdown.get("dp_comm", 0.0))


def config_node_link(cfg: JobConfig, world: int) -> NodeLink | None:
    """The nodes the ``cluster`` keys describe: ``ranks_per_node`` below the world and the
    inter-node bandwidth given (the latency defaults to none); else None (one node, or a
    worker measures the link itself: ``comm.node_link_probe``)."""
    cluster = cfg.cluster
    if (cluster.ranks_per_node is None or cluster.ranks_per_node >= world
            or cluster.inter_node_bandwidth_gbps is None):
        return None
    return NodeLink(cluster.ranks_per_node, (cluster.inter_node_latency_us or 0.0) * 1e-6,
                    cluster.inter_node_bandwidth_gbps * 1e9 / 8, "cluster.inter_node_* keys")


def choose_layout(cfg: JobConfig, world: int, nodes: NodeLink | None = None) -> AutoLayout:
    """The fastest layout of ``cfg`` on ``world`` workers that resolves, trains and fits the
    budget, priced on this machine's profile spread over ``nodes`` (default: what the config's
    ``cluster`` keys say). Raises UserError naming the budget and the smallest layout's bytes
    when none fits, or the rules that refused every layout."""
    start = time.perf_counter()
    user = _user_keys(cfg)
    device_type = select_device(cfg.training.device).type
    nodes = nodes or config_node_link(cfg, world)
    cluster, ranked_on = ranking_cluster(device_type, world, nodes)
    budget, source = budget_bytes(cfg, world)
    batch = _global_batch(cfg, world)
    base_variant = {"controllers.memory.zero_stage": cfg.controllers.memory.zero_stage,
                    "controllers.memory.activation_checkpointing":
                        cfg.controllers.memory.activation_checkpointing,
                    "controllers.communication.compression":
                        cfg.controllers.communication.compression}
    dropped: dict[str, int] = {}

    def drop(why: str) -> None:
        dropped[why] = dropped.get(why, 0) + 1

    # Pass 1: every core with the config's memory settings, under each codec: over a slow
    # link a compressed exchange can move a data-parallel core from the back to the front.
    codecs = _options(cfg, user, "controllers.communication.compression",
                      [c.name for c in CODECS])
    cores: list[tuple[float, dict[str, object]]] = []
    for core in _cores(cfg, world, batch, user):
        steps = []
        for codec in codecs:
            settings = {**core, **base_variant, "controllers.communication.compression": codec}
            if len(codecs) > 1 and communication_problems(with_keys(cfg, settings),
                                                          int(core["parallelism.data"])):
                continue  # e.g. 1-bit Adam on a run too short to reach its freeze step
            priced = _price(cfg, settings, cluster)
            if priced is None:
                drop("refused by the layout rules (degrees, schedule, codec, ZeRO)")
                continue
            steps.append(priced[1].step_s)
        if steps:
            cores.append((min(steps), core))
    cores.sort(key=lambda item: item[0])
    # Pass 2: the variants of the fastest cores.
    priced_all: list[tuple[JobConfig, Choice]] = []
    variants = _variants(cfg, user)
    for _, core in cores[:REFINED_CORES]:
        for variant in variants:
            priced = _price(cfg, {**core, **variant}, cluster)
            if priced is None:
                drop("refused by the layout rules (degrees, schedule, codec, ZeRO)")
                continue
            priced_all.append(priced)
    priced_all.sort(key=lambda item: (item[1].step_s, item[1].peak_bytes))
    kept: list[Choice] = []
    smallest: Choice | None = None
    first_refusal = ""  # the plan's own words for the fastest layout it refused
    for candidate, choice in priced_all:
        if choice.peak_bytes > budget:
            drop("over the memory budget")
            if smallest is None or choice.peak_bytes < smallest.peak_bytes:
                smallest = choice
            continue
        if len(kept) >= SHOWN:
            continue
        try:
            resolve_plan(candidate, world)
        except UserError as err:
            drop("refused by the plan's rules")
            first_refusal = first_refusal or str(err)
            continue
        if unsupported_settings(candidate):
            drop("not trainable by this version")
            continue
        kept.append(choice)
    if not kept:
        if smallest is not None:
            raise UserError(problem(
                "controllers.memory.memory_budget_gb" if cfg.controllers.memory.memory_budget_gb
                else AUTO_KEY,
                f"no layout of {world} worker(s) fits {format_bytes(budget)} per rank "
                f"({source}); the smallest ({smallest.describe()}) needs "
                f"{format_bytes(smallest.peak_bytes)} ({round(smallest.peak_bytes):,} B): raise "
                "the budget to at least that, or use more workers or a smaller global batch"))
        raise UserError(problem(AUTO_KEY, (
            f"no layout of {world} worker(s) resolves for this config ("
            + ", ".join(f"{n} {why}" for why, n in dropped.items())
            + (f"); the fastest was refused with: {first_refusal.removeprefix('mcpar: error: ')}"
               if first_refusal else
               "); `mcpar check` with the degrees set by hand names the rule"))))
    return AutoLayout(kept[0], kept[1:], ranked_on, sorted(user), budget, source,
                      len(cores) + len(priced_all), dropped, time.perf_counter() - start,
                      nodes if nodes is not None and nodes.ranks_per_node < world else None)


def resolve_job(cfg: JobConfig, world_size: int | None, nodes: NodeLink | None = None
                ) -> JobPlan:
    """The plan of ``cfg`` on ``world_size`` workers, with the layout chosen first when
    ``parallelism.auto`` asks for it (``plan.auto``: the choice and its prediction, priced
    over ``nodes`` where the job spans several)."""
    if not cfg.parallelism.auto:
        return resolve_plan(cfg, world_size)
    if world_size is None:
        par = cfg.parallelism
        world_size = (par.data or 1) * replica_ranks(par.tensor, par.pipeline, par.context)
    auto = choose_layout(cfg, world_size, nodes)
    plan = resolve_plan(with_keys(cfg, auto.chosen.settings), world_size)
    return dataclasses.replace(plan, auto=auto)


# A measured step further than this from the prediction is reported as a warning line (and,
# on CPU, makes ``mcpar train`` measure this machine's local profile again).
PREDICTION_MARGIN = 0.25
# A measured peak further than this from the estimate is reported too (the memory estimate's
# target: within 10% on every layout).
MEMORY_MARGIN = 0.10


def _median_after_first(values: list[float]) -> float:
    """The median after the first step, which pays the warm-up."""
    ordered = sorted(values[1:] or values)
    return ordered[len(ordered) // 2] if ordered else float("nan")


def _terms(chosen: dict[str, object], step: float, measured_step: float,
           exposed: list[float], straggling: list[tuple[float, float]]
           ) -> dict[str, dict[str, float]]:
    """The step's terms, predicted and measured: the data-parallel traffic waited for after the
    compute (measured: the WAIT_GRADS tasks' time, ``exposed_comm_s``, less this rank's wait
    for the slowest replica to come), the slowest replica's lateness behind the replicas' mean
    (``Straggling.behind_mean_s``; the cost model's ranks all run alike, so it predicts none),
    and the rest (compute, in-step tensor/pipeline communication, the bubble and the optimizer;
    measured: the step minus the other two). Without a profile window the bubble is not
    measured apart."""
    dp = float(chosen.get("predicted_dp_exposed_s", 0.0))  # type: ignore[arg-type]
    straggling = straggling or [(0.0, 0.0)] * len(exposed)  # no replicas: no wait for one
    wire = [max(0.0, e - w) for e, (w, _) in zip(exposed, straggling, strict=True)]
    dp_measured = _median_after_first(wire) if wire else 0.0
    late = _median_after_first([b for _, b in straggling]) if straggling else 0.0
    return {"compute": {"predicted": step - dp,
                        "measured": measured_step - dp_measured - late},
            "slowest replica's lateness": {"predicted": 0.0, "measured": late},
            "exposed data-parallel communication": {"predicted": dp, "measured": dp_measured}}


def predicted_against_measured(chosen: dict[str, object], step_times: list[float],
                               memory: dict[str, dict[str, int]],
                               exposed_comm: list[float] | None = None,
                               straggling: list[tuple[float, float]] | None = None
                               ) -> dict[str, object]:
    """``summary.json``'s ``prediction``: the chosen layout's predicted step time and peak per
    rank beside the measured ones (the median step after the first), their relative errors, the
    step's terms predicted and measured (``_terms``; ``straggling``: per step, this rank's wait
    for its slowest replica and that replica's lateness behind their mean), and a warning for
    each figure off by more than its margin, naming the term that is off most."""
    measured = _median_after_first(step_times)
    predicted = float(chosen["predicted_step_s"])  # type: ignore[arg-type]
    peak = float(chosen["predicted_peak_bytes"])  # type: ignore[arg-type]
    measured_peak = float(memory.get("measured", {}).get("total", 0))
    error = measured / predicted - 1 if predicted > 0 else float("nan")
    peak_error = measured_peak / peak - 1 if peak > 0 else float("nan")
    terms = _terms(chosen, predicted, measured, exposed_comm or [], straggling or [])
    warnings = []
    if abs(error) > PREDICTION_MARGIN:
        name, term = max(terms.items(),
                         key=lambda kv: abs(kv[1]["measured"] - kv[1]["predicted"]))
        warnings.append(
            f"the measured step ({measured:.4g} s) is {error:+.0%} off the planner's prediction "
            f"({predicted:.4g} s) for {chosen['layout']}; the term off most is {name} "
            f"(predicted {term['predicted']:.4g} s, measured {term['measured']:.4g} s); the "
            "ranking of parallelism.auto may not hold on this machine")
    if measured_peak > 0 and abs(peak_error) > MEMORY_MARGIN:
        warnings.append(
            f"the measured peak per rank ({format_bytes(measured_peak)}) is {peak_error:+.0%} "
            f"off the memory estimate ({format_bytes(peak)}) for {chosen['layout']}; the term "
            "off is memory: the budget check of parallelism.auto may not hold")
    return {"source": AUTO_KEY, "layout": chosen["layout"],
            "predicted_step_s": predicted, "measured_step_s": measured, "step_error": error,
            "predicted_peak_bytes": peak, "measured_peak_bytes": measured_peak,
            "peak_error": peak_error, "terms": terms,
            "margin": PREDICTION_MARGIN, "memory_margin": MEMORY_MARGIN,
            "warning": "; ".join(warnings)}
