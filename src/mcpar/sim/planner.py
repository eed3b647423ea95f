"""Search layouts and settings under the memory limit; rank them by predicted step time
(``mcpar plan``). The search space, and the rule that only what ``mcpar train`` accepts is
ranked (``train_problems``): docs/cost_model.md ("The planner").

Beyond the doc: sequence parallelism is on whenever tp > 1 (in this model it only removes work
and memory); micro-batches are the divisors of the sequences per data-parallel rank, up to 32;
PowerSGD runs at rank 4; ``extra`` layouts are priced as given. Each core is priced once
(``pipeline_core``), ZeRO stage, compression, topology and the store on top of it (``finish``);
layouts that do not fit in memory are dropped before their traffic is priced.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

from mcpar.capabilities import ContextFacts, context_layout_problems, zero_layout_problems
from mcpar.errors import UserError, problem
from mcpar.registry.codec import CODECS, LAYOUT_KEYS, codec_problems
from mcpar.registry.recompute import RECOMPUTE_POLICIES, RecomputeFacts
from mcpar.registry.schedule import SCHEDULES, default_schedule, splits_backward
from mcpar.registry.zero import ZERO_STAGES
from mcpar.sim.costmodel import PipelineCore, Prediction, finish, pipeline_core
from mcpar.sim.hardware import GIB, Cluster, Efficiency
from mcpar.sim.memory import memory_per_gpu
from mcpar.sim.workload import (
    CONFIG_TOPOLOGY,
    Layout,
    ModelShape,
    exchange_facts,
    layout_problems,
    model_problems,
)

MAX_MICRO_BATCH = 32
MAX_VP = 8
MIN_TOKENS_PER_CP_RANK = 2048  # context parallelism is searched on long sequences only
# Bounds that keep `mcpar plan` within seconds. Pricing a core costs ~0.4 ms; the number of
# cores is set by the divisors of the layers, experts, GPU count and global batch, not by the
# GPU count's size (measured: mixtral-8x7b, global batch 8n, 8148 cores from 2^11 to 2^20 GPUs,
# 3-6 s on a loaded 2-core machine; llama3-405b 825 cores, under 1 s; a global batch of
# n x 720720/8 on 20160-3628800 GPUs: 23-31k cores, 9-13 s; a 120-layer, 24-expert model on
# 20160 GPUs, global batch 3628800: 151k cores, about a minute). The GPU bound is 2.6x the
# largest clusters trained on; the core budget keeps the worst case under ~10 s on a slow machine
# (counting the cores first takes well under a second).
MAX_PLAN_GPUS = 262_144
MAX_PLAN_CORES = 20_000
# `--top`: the list of the fastest is re-sorted per core, so its cost grows with its length
# (--top 1000: ~4x --top 10; --top 10^6 ran for minutes).
MAX_TOP = 100


@dataclass
class Candidate:
    layout: Layout
    prediction: Prediction


@dataclass
class PlanResult:
    candidates: list[Candidate]  # fitting layouts, fastest first
    considered: int  # layouts priced or rejected for memory
    seconds: float
    smallest_memory: tuple[float, Layout] | None  # when nothing fits: the closest miss


def _divisors(n: int) -> list[int]:
    """The divisors of n, ascending, in O(sqrt n) (a GPU count or a batch may be large)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


@dataclass(frozen=True)
class SearchSpace:
    """Which values each setting may take (the planner's defaults, or fixed by the user)."""

    recompute: tuple[str, ...] | None = None  # registered recompute policies; None: all
    zero_stages: tuple[int, ...] | None = None  # registered ZeRO stages; None: all
    compression: tuple[str, ...] | None = None  # registered gradient codecs; None: all
    topology: tuple[str, ...] = ("flat", "hierarchical")
    allocation: tuple[str, ...] = ("default", "topology_aware")
    weight_gather: tuple[str, ...] = ("none", "int8")
    tp: tuple[int, ...] | None = None
    pp: tuple[int, ...] | None = None
    cp: tuple[int, ...] = (1, 2, 4, 8)
    context_modes: tuple[str, ...] = ("ring", "ulysses")  # mcpar's (cp > 1)
    micro_batch: tuple[int, ...] | None = None
    sequence_parallel: bool = True  # with tp > 1
    schedules: tuple[str, ...] | None = None  # pipeline schedules; None: every registered one


def _schedules(space: SearchSpace, pp: int, vp: int, num_microbatches: int) -> list[str]:
    """The registered schedules that run `vp` chunks per rank of a `pp`-deep pipeline with
    this many micro-batches (without a pipeline there is nothing to schedule)."""
    if pp == 1:
        return [default_schedule(vp)]
    return [s.name for s in SCHEDULES
            if (space.schedules is None or s.name in space.schedules)
            and s.problem(pp, num_microbatches, vp) is None]


def _recompute(space: SearchSpace, m: ModelShape) -> list[str]:
    """The registered recompute policies the model runs with."""
    facts = RecomputeFacts(is_moe=m.is_moe)
    return [p.name for p in RECOMPUTE_POLICIES
            if (space.recompute is None or p.name in space.recompute) and not p.problems(facts)]


def core_layouts(m: ModelShape, cluster: Cluster, global_batch: int, precision: str,
                 space: SearchSpace, attention: str) -> Iterator[Layout]:
    n, g = cluster.num_gpus, cluster.gpus_per_node
    policies = _recompute(space, m)
    for tp in _divisors(min(g, n)):
        if n % tp:
            continue
        if space.tp is not None and tp not in space.tp:
            continue
        if m.heads % tp or m.ffn % tp or (m.kv_heads % tp and tp % m.kv_heads):
            continue
        for cp in space.cp:
            if n % (tp * cp) or m.seq_len % (cp * tp) or (cp > 1 and (
                    m.seq_len // cp < MIN_TOKENS_PER_CP_RANK or attention != "flash")):
                continue
            rest = n // (tp * cp)
            for pp in _divisors(m.layers):  # pp splits the layers evenly and the GPUs left
                if rest % pp or (space.pp is not None and pp not in space.pp):
                    continue
                dp = n // (tp * cp * pp)
                if global_batch % dp:
                    continue
                per_rank = global_batch // dp
                for vp in _divisors(m.layers // pp):
                    if vp > MAX_VP or (vp > 1 and pp == 1):
                        continue
                    eps = [e for e in _divisors(m.experts) if dp % e == 0] \
                        if m.is_moe else [1]
                    for ep in eps:
                        for b in range(1, min(per_rank, MAX_MICRO_BATCH) + 1):
                            if per_rank % b or (
                                    space.micro_batch is not None and b not in space.micro_batch):
                                continue
                            for schedule in _schedules(space, pp, vp, per_rank // b):
                                for rc in policies:
                                    lay = Layout(
                                        tp=tp, pp=pp, vp=vp, cp=cp, dp=dp, ep=ep,
                                        seq_parallel=space.sequence_parallel and tp > 1,
                                        global_batch=global_batch, micro_batch=b,
                                        recompute=rc, precision=precision,
                                        attention=attention, schedule=schedule)
                                    yield from _context_cores(m, lay, space)


def _context_cores(m: ModelShape, lay: Layout, space: SearchSpace) -> Iterator[Layout]:
    """`lay` itself without context parallelism; with it, one core per context mode that the
    runtime's rule (``context_problems``) accepts (a ZeRO stage, a codec or a topology it
    refuses is the variants' to drop: ``train_problems``)."""
    if lay.cp == 1:
        yield lay
        return
    for mode in space.context_modes:
        core = lay.with_(context_mode=mode)
        if not context_problems(m, core.with_(zero_stage=0, compression="none",
                                              topology="flat")):
            yield core


def context_problems(m: ModelShape, lay: Layout) -> list[str]:
    """The runtime's context-parallel rule (``capabilities.context_layout_problems``, which
    ``mcpar check`` and ``mcpar train`` apply) on a layout. Every mcpar family has a
    context-parallel plan, and ``training.compile`` is not a layout's (off)."""
    if lay.cp == 1:
        return []
    return context_layout_problems(ContextFacts(
        cp=lay.cp, mode=lay.context_mode, seq_len=m.seq_len,
        heads_per_tensor_rank=m.heads // lay.tp, zero_stage=lay.zero_stage,
        allocation=lay.allocation, recompute=lay.recompute,
        compression=lay.compression, topology=CONFIG_TOPOLOGY.get(lay.topology, lay.topology),
        dropout=m.dropout, kind=m.name))


def train_problems(lay: Layout, m: ModelShape | None = None) -> list[str]:
    """What ``mcpar train`` would refuse in `lay`'s ZeRO, store, codec and context settings:
    the rules of ``mcpar.capabilities`` (``zero_layout_problems``, ``context_layout_problems``),
    which train applies too, so that a ranked layout is one that trains. The context rule reads
    the model: `m` is needed when cp > 1."""
    if lay.cp > 1 and m is None:
        raise ValueError("train_problems of a cp > 1 layout needs the model shape")
    problems = zero_layout_problems(
        lay.zero_stage, lay.dp, pp=lay.pp, vp=lay.vp, cp=lay.cp,
        topology=CONFIG_TOPOLOGY[lay.topology], allocation=lay.allocation,
        weight_gather=lay.weight_gather,
        splits_backward=splits_backward(lay.schedule, lay.pp))
    if lay.ep > 1 and lay.compression != "none":
        # capabilities.expert_problems: expert weights are reduced uncompressed.
        problems.append(problem("controllers.communication.compression",
                                "not applied with parallelism.experts > 1"))
    if m is not None:
        problems += context_problems(m, lay)
    # The codec's own rules (its registry entry), as train applies them.
    return problems + [problem(LAYOUT_KEYS[field], text) for field, text in
                       codec_problems(lay.compression, exchange_facts(lay))]


def all_variants(core: Layout, space: SearchSpace, multi_node_dp: bool) -> Iterator[Layout]:
    """Every ZeRO stage x compression x topology x store x weight-gather setting of `core`
    that the cost model can price, before train's rules (``train_problems``) are applied."""
    codecs = [c for c in CODECS if space.compression is None or c.name in space.compression]
    stages = space.zero_stages if space.zero_stages is not None else \
        tuple(s.stage for s in ZERO_STAGES)
    for zero in stages:
        for codec in codecs:
            topologies = space.topology if multi_node_dp else space.topology[:1]
            # The store pays only when the data axis crosses nodes (its backward gathers stay
            # inside the node); the quantized gathers exist only under ZeRO-3.
            stores = [a for a in space.allocation if a == "default" or (zero == 3 and
                                                                        multi_node_dp)]
            gathers = space.weight_gather if zero == 3 else ("none",)
            for topo in topologies:
                for alloc in stores:
                    # A codec that buys nothing here (a 16-bit cast of 16-bit gradients) is
                    # not priced; what the codec cannot run with is its rules' to refuse.
                    if not codec.worth_pricing(core.precision, zero, alloc != "default"):
                        continue
                    for gather in gathers:
                        lay = core.with_(zero_stage=zero, compression=codec.name,
                                         topology=topo, allocation=alloc, weight_gather=gather)
                        if not codec_problems(codec.name, exchange_facts(lay)):
                            yield lay


def _variants(core: Layout, space: SearchSpace, multi_node_dp: bool,
              m: ModelShape | None = None) -> Iterator[Layout]:
    """The variants `mcpar train` accepts."""
    return (lay for lay in all_variants(core, space, multi_node_dp)
            if not train_problems(lay, m))


def plan(m: ModelShape, cluster: Cluster, global_batch: int, precision: str,
         space: SearchSpace | None = None, eff: Efficiency | None = None,
         memory_limit: float | None = None, extra: list[Layout] | None = None,
         where: str = "model", keep: int = 50, budget_key: str = "global batch") -> PlanResult:
    """The `keep` fastest fitting layouts, fastest first. `extra` layouts (e.g. a published one)
    are priced too, so the best is never worse than them when they fit. A search of more than
    MAX_PLAN_CORES cores is refused (a UserError naming `budget_key`) before any is priced.

    Cores are visited from the lowest lower bound on their step time (the pipeline without any
    data-parallel traffic or optimizer); once `keep` layouts are known, a core whose bound is
    above the slowest of them cannot enter the list and is skipped."""
    problems = model_problems(m, where)
    if problems:
        raise UserError(problems)
    space = space or SearchSpace()
    limit = memory_limit or cluster.accel.hbm_bytes
    attention = Layout(precision=precision).attention_kind
    start = time.perf_counter()
    considered = 0
    smallest: tuple[float, Layout] | None = None
    extra = [lay for lay in extra or []
             if not layout_problems(m, lay, cluster.num_gpus, cluster.gpus_per_node, where)]
    if not 1 <= keep <= MAX_TOP:
        raise UserError(problem("keep", f"must be 1..{MAX_TOP}, got {keep}"))
    cores: list[Layout] = []
    for core_layout in core_layouts(m, cluster, global_batch, precision, space, attention):
        cores.append(core_layout)
        if len(cores) > MAX_PLAN_CORES:
            raise UserError(problem(budget_key, (
                f"{global_batch} sequences on {cluster.num_gpus} GPUs leave more than "
                f"{MAX_PLAN_CORES:,} layouts to price (the planner's bound, a few seconds); "
                "choose a global batch with fewer divisors (a power of two) or fewer GPUs")))
    ranked: list[tuple[float, Layout, PipelineCore]] = []
    for core_layout in [*cores, *extra]:
        # The leanest variant of this core (weights, gradients and optimizer state sharded).
        # The leanest variant of this core: ZeRO-3, or ZeRO-2 where the gathered blocks and
        # root parameters outweigh what sharding the weights saves (small data axes).
        leanest = ([core_layout] if core_layout in extra
                   else [core_layout.with_(zero_stage=z) for z in (3, 2)])
        lean, lean_layout = min(
            ((memory_per_gpu(m, lay, cluster.reserved_bytes, cluster.gpus_per_node).total, lay)
             for lay in leanest), key=lambda item: item[0])
        if lean > limit:
            considered += 1
            if smallest is None or lean < smallest[0]:
                smallest = (lean, lean_layout)
            continue
        core = pipeline_core(m, core_layout, cluster, eff)
        ranked.append((_lower_bound(core, core_layout), core_layout, core))
    ranked.sort(key=lambda item: item[0])
    found: list[Candidate] = []
    seen: set[Layout] = set()
    for bound, core_layout, core in ranked:
        if len(found) >= keep and bound > found[-1].prediction.step_s:
            break
        multi_node = core_layout.tp * core_layout.dp * core_layout.cp > cluster.gpus_per_node
        variants = ([core_layout] if core_layout in extra
                    else _variants(core_layout, space, multi_node, m))
        for lay in variants:
            if lay in seen:
                continue
            seen.add(lay)
            considered += 1
            mem = memory_per_gpu(m, lay, cluster.reserved_bytes, cluster.gpus_per_node).total
            if mem > limit:
                continue
            found.append(Candidate(lay, finish(core, m, lay, cluster)))
        found.sort(key=lambda c: c.prediction.step_s)
        del found[keep:]
    return PlanResult(found, considered, time.perf_counter() - start,
                      smallest if not found else None)


def _lower_bound(core: PipelineCore, lay: Layout) -> float:
    return SCHEDULES.get(lay.schedule).span(lay.num_microbatches, core.work_max, core.work_sum,
                                            core.rank_work, lay.vp, core.fwd_share)


def best_or_error(result: PlanResult, cluster: Cluster, where: str) -> Candidate:
    if result.candidates:
        return result.candidates[0]
    hint = ""
    if result.smallest_memory is not None:
        mem, lay = result.smallest_memory
        hint = (f"; the smallest footprint found is {mem / GIB:.1f} GiB per GPU "
                f"({lay.describe()}, ZeRO {lay.zero_stage}, recompute {lay.recompute}, "
                f"micro-batch {lay.micro_batch})")
    raise UserError(problem(where, f"no layout on {cluster.num_gpus} x {cluster.accel.name} "
                                   f"fits in {cluster.accel.hbm_bytes / GIB:.0f} GiB per GPU"
                                   f"{hint}; use more or larger GPUs, or a smaller model"))


def format_table(result: PlanResult, top: int) -> str:
    header = (f"{'#':>3} {'layout':<24} {'mb':>3} {'recomp':<9} {'zero':>4} {'compress':<8} "
              f"{'topology':<12} {'store':<17} {'step_s':>9} {'tokens/s':>11} {'MFU':>6} "
              f"{'mem_GiB':>8} {'comm':>6} {'bubble':>6}")
    lines = [header, "-" * len(header)]
    for i, cand in enumerate(result.candidates[:top], 1):
        lay, pred = cand.layout, cand.prediction
        desc = lay.describe() + (" sp" if lay.seq_parallel else "")
        lines.append(
            f"{i:>3} {desc:<24} {lay.micro_batch:>3} {lay.recompute:<9} {lay.zero_stage:>4} "
            f"{lay.compression:<8} {lay.topology:<12} {_store(lay):<17} {pred.step_s:>9.3f} "
            f"{pred.tokens_per_s:>11.0f} {pred.mfu:>6.1%} {pred.memory.total / GIB:>8.1f} "
            f"{pred.comm_fraction:>6.1%} {pred.bubble_fraction:>6.1%}")
    return "\n".join(lines)


def _store(lay: Layout) -> str:
    """The parameter store and the int8 weight gathers of a ZeRO-3 layout, '-' for neither."""
    parts = (["store"] if lay.allocation == "topology_aware" else []) + (
        ["int8-gather"] if lay.weight_gather == "int8" else [])
    return "+".join(parts) or "-"
