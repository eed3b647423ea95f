"""The seed's results table, redone with the cost model: writes ``docs/seed_table.md``.

    python -m mcpar.sim.seed_table > docs/seed_table.md

GPT-3 175B on 1024 A100-80GB GPUs, global batch 1536 sequences of 2048 tokens, fp16 with the
2021 Megatron kernels in every column (so that differences come from layouts and settings, not
from newer kernels), on two fabrics: the cluster of the Megatron paper (one 200 Gb/s NIC per
GPU) and the seed's own deployment floor (100 Gb/s between nodes per node: a node's 8 GPUs share
one NIC). Columns, on each:

A. the classic 3D layout of the Megatron paper (Narayanan et al., SC21: tensor 8 inside the node,
   pipeline 8 interleaved by 2, data 16, micro-batch 1, full recompute, plain data-parallel
   all-reduce on flat rings);
B. the planner restricted to A's mechanisms (full recompute, no sequence parallelism, no ZeRO, no
   compression, flat rings): what choosing the layout alone gains;
C. the planner with everything it can choose (sequence parallelism, selective recompute, ZeRO,
   the parameter store, compression, hierarchical collectives, ...), ranking only what
   ``mcpar train`` accepts;
D. the planner held to the seed's communication settings (hierarchical collectives and 1-bit
   compression, which needs ZeRO 0): the best that MCP's communication features allow.

Then one row per mechanism (``MECHANISMS``): the best plan that uses it against the best plan of
the same family without it, on each fabric; the text is generated from those numbers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, replace

from mcpar.registry.schedule import SCHEDULES
from mcpar.sim.calibration import summary
from mcpar.sim.costmodel import Prediction, simulate
from mcpar.sim.hardware import GIB, Cluster, cluster_preset, load_accelerators
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.planner import SearchSpace, plan
from mcpar.sim.runs import packaged_runs, predict_run
from mcpar.sim.workload import MODEL_PRESETS, Layout, ModelShape

PRESET = MODEL_PRESETS["gpt3-175b"]
CLUSTER = "a100x1024"
FLOOR_NODE_GBPS = 100.0  # the seed's deployment floor: 100 Gb/s between nodes, per node
# Reported for this model, batch and GPU count in SC21 sec. 5.1 (the layout is not printed there;
# A is our reading of it, from the paper's other 175B-class runs).
SC21_REPORTED_TFLOPS = 140.0
CLASSIC = Layout(tp=8, pp=8, vp=2, dp=16, global_batch=PRESET.global_batch, micro_batch=1,
                 recompute="full", precision=PRESET.precision, topology="flat")
# A mechanism "buys nothing" below this gain (the model's own resolution is coarser).
NEGLIGIBLE = 0.005


@dataclass
class Column:
    title: str
    layout: Layout
    pred: Prediction
    scaling: float
    reference_gpus: int


@dataclass(frozen=True)
class Fabric:
    name: str
    cluster: Cluster
    text: str  # how the nodes are linked, for the reader


@dataclass(frozen=True)
class Mechanism:
    name: str
    family: str  # what it is measured against
    with_it: SearchSpace
    without: SearchSpace
    uses: Callable[[Layout], bool]  # whether a layout uses it


FLAT, BOTH = ("flat",), ("flat", "hierarchical")
STORE, NO_STORE, ANY_STORE = ("topology_aware",), ("default",), ("default", "topology_aware")
NONE, INT8, ANY_GATHER = ("none",), ("int8",), ("none", "int8")
SPLIT_SCHEDULES = tuple(s.name for s in SCHEDULES if s.splits_backward)
WHOLE_SCHEDULES = tuple(s.name for s in SCHEDULES if not s.splits_backward)
PIPELINES = (2, 4, 8, 16, 32, 64)  # both sides of the schedules' row have a pipeline
MECHANISMS = (
    Mechanism("hierarchical all-reduce", "ZeRO 0, flat rings",
              SearchSpace(zero_stages=(0,), compression=NONE, topology=("hierarchical",)),
              SearchSpace(zero_stages=(0,), compression=NONE, topology=FLAT),
              lambda lay: lay.topology == "hierarchical"),
    Mechanism("1-bit Adam", "ZeRO 0, uncompressed",
              SearchSpace(zero_stages=(0,), compression=("1bit",), topology=BOTH),
              SearchSpace(zero_stages=(0,), compression=NONE, topology=BOTH),
              lambda lay: lay.compression == "1bit"),
    Mechanism("ZeRO-3", "ZeRO 0-2, uncompressed",
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT, allocation=NO_STORE,
                          weight_gather=NONE),
              SearchSpace(zero_stages=(0, 1, 2), compression=NONE, topology=FLAT),
              lambda lay: lay.zero_stage == 3),
    Mechanism("the parameter store (hpZ)", "plain ZeRO-3",
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT, allocation=STORE,
                          weight_gather=NONE),
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT,
                          allocation=NO_STORE, weight_gather=NONE),
              lambda lay: lay.allocation == "topology_aware"),
    Mechanism("int8 weight gathers (qwZ)", "ZeRO-3 with or without the store, fp16 gathers",
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT,
                          allocation=ANY_STORE, weight_gather=INT8),
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT,
                          allocation=ANY_STORE, weight_gather=NONE),
              lambda lay: lay.weight_gather == "int8"),
    Mechanism("bf16 inter-node reduce-scatter", "the store, uncompressed",
              SearchSpace(zero_stages=(3,), compression=("bf16",), topology=FLAT,
                          allocation=STORE, weight_gather=ANY_GATHER),
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT, allocation=STORE,
                          weight_gather=ANY_GATHER),
              lambda lay: lay.allocation == "topology_aware" and lay.compression == "bf16"),
    Mechanism("zero-bubble schedules (ZB-H1, ZB-H2, ZBV)", "pipelines with an unsplit backward",
              SearchSpace(pp=PIPELINES, schedules=SPLIT_SCHEDULES),
              SearchSpace(pp=PIPELINES, schedules=WHOLE_SCHEDULES),
              lambda lay: lay.pp > 1 and SCHEDULES.get(lay.schedule).splits_backward),
    Mechanism("int8 inter-node reduce-scatter (qgZ)", "the store, uncompressed",
              SearchSpace(zero_stages=(3,), compression=("int8",), topology=FLAT,
                          allocation=STORE, weight_gather=ANY_GATHER),
              SearchSpace(zero_stages=(3,), compression=NONE, topology=FLAT, allocation=STORE,
                          weight_gather=ANY_GATHER),
              lambda lay: lay.compression == "int8"),
)


@dataclass
class Measured:
    """A mechanism on one fabric: the best plan with it and the best of its family without."""

    with_it: tuple[Layout, float] | None  # (layout, step seconds); None: nothing fits
    without: tuple[Layout, float] | None

    @property
    def gain(self) -> float | None:
        if self.with_it is None or self.without is None:
            return None
        return self.without[1] / self.with_it[1] - 1


def fabrics() -> list[Fabric]:
    base = cluster_preset(CLUSTER, load_accelerators())
    per_gpu = FLOOR_NODE_GBPS / base.gpus_per_node
    floor = replace(base, inter_bw=FLOOR_NODE_GBPS * 1e9 / 8 / base.gpus_per_node,
                    name=f"{CLUSTER}-{FLOOR_NODE_GBPS:.0f}g-per-node")
    return [
        Fabric("200 Gb/s per GPU", base,
               f"one {base.inter_bw * 8 / 1e9:.0f} Gb/s NIC per GPU (the Megatron paper's "
               "cluster)"),
        Fabric(f"{FLOOR_NODE_GBPS:.0f} Gb/s per node", floor,
               f"one {FLOOR_NODE_GBPS:.0f} Gb/s NIC per node of {base.gpus_per_node}, shared "
               f"by its GPUs ({per_gpu:.1f} Gb/s each: the seed's deployment floor)"),
    ]


def scaling_efficiency(m: ModelShape, lay: Layout, cluster: Cluster) -> tuple[float, int]:
    """Per-GPU throughput at the full cluster over that of one data-parallel replica of the
    same layout (same global batch: strong scaling), and that replica's GPU count."""
    ref_gpus = lay.tp * lay.pp * lay.cp
    ref_layout = lay.with_(dp=1, zero_stage=0, compression="none", allocation="default",
                           weight_gather="none")
    ref_cluster = replace(cluster, num_gpus=ref_gpus)
    ref = simulate(m, ref_layout, ref_cluster, GPU_EFFICIENCY, where="reference")
    full = simulate(m, lay, cluster, GPU_EFFICIENCY, where="seed")
    per_gpu_full = full.tokens_per_s / lay.num_gpus
    per_gpu_ref = ref.tokens_per_s / ref_gpus
    return per_gpu_full / per_gpu_ref, ref_gpus


def _best(m: ModelShape, cluster: Cluster, space: SearchSpace) -> tuple[Layout, float] | None:
    result = plan(m, cluster, PRESET.global_batch, PRESET.precision, space, keep=1)
    if not result.candidates:
        return None
    return result.candidates[0].layout, result.candidates[0].prediction.step_s


def columns(cluster: Cluster) -> list[Column]:
    m = PRESET.shape
    b, prec = PRESET.global_batch, PRESET.precision
    classic_space = SearchSpace(recompute=("full",), zero_stages=(0,), compression=("none",),
                                topology=("flat",), sequence_parallel=False)
    layout_only = plan(m, cluster, b, prec, classic_space, keep=1)
    best = plan(m, cluster, b, prec, SearchSpace(), keep=1).candidates[0].layout
    seed_space = SearchSpace(zero_stages=(0,), compression=("1bit",), topology=("hierarchical",))
    seed_comm = plan(m, cluster, b, prec, seed_space, keep=1).candidates[0].layout
    out = []
    for title, lay in (("A. classic 3D (Megatron SC21)", CLASSIC),
                       ("B. planner, classic mechanisms", layout_only.candidates[0].layout),
                       ("C. planner, all mechanisms", best),
                       ("D. planner, hierarchy + 1-bit", seed_comm)):
        pred = simulate(m, lay, cluster, GPU_EFFICIENCY, where="seed")
        scaling, ref = scaling_efficiency(m, lay, cluster)
        out.append(Column(title, lay, pred, scaling, ref))
    return out


def mechanisms(cluster: Cluster) -> list[Measured]:
    m = PRESET.shape
    return [Measured(_best(m, cluster, mech.with_it), _best(m, cluster, mech.without))
            for mech in MECHANISMS]


def _settings(lay: Layout) -> str:
    store = (", the parameter store" if lay.allocation == "topology_aware" else "") + (
        ", int8 weight gathers" if lay.weight_gather == "int8" else "")
    return (f"{lay.describe()}{' +SP' if lay.seq_parallel else ''}, micro-batch "
            f"{lay.micro_batch}, recompute {lay.recompute}, ZeRO {lay.zero_stage}{store}, "
            f"compression {lay.compression}, {lay.topology} collectives")


def _short(lay: Layout) -> str:
    """A layout in a few words, for the mechanism table."""
    extras = [f"ZeRO {lay.zero_stage}"]
    extras += ["store"] if lay.allocation == "topology_aware" else []
    extras += ["int8 gathers"] if lay.weight_gather == "int8" else []
    extras += [lay.compression] if lay.compression != "none" else []
    extras += ["hierarchical"] if lay.topology == "hierarchical" else []
    return (f"{lay.describe()}{' sp' if lay.seq_parallel else ''} mb{lay.micro_batch} "
            f"{lay.recompute}, " + ", ".join(extras))


def _gain(g: float | None) -> str:
    return "n/a (nothing fits)" if g is None else f"{g:+.1%}"


def verdict(gain: float | None, picked: bool) -> str:
    """What a mechanism buys, in words, from its measured gain and whether the free planner
    picks it."""
    if gain is None:
        return "cannot be priced here (no layout that uses it fits in memory)"
    if gain > NEGLIGIBLE:
        text = f"buys {gain:.1%} over its family's best without it"
    elif gain >= -NEGLIGIBLE:
        text = "buys nothing measurable (within 0.5%) over its family's best without it"
    else:
        text = f"costs {-gain:.1%} against its family's best without it"
    return text + ("; the free planner's pick uses it" if picked
                   else "; the free planner's pick does not use it")


def _table(cols: list[Column], limit_gib: float) -> list[str]:
    head = "| | " + " | ".join(c.title for c in cols) + " |"
    rule = "|---" * (len(cols) + 1) + "|"

    def row(name: str, cells: list[str]) -> str:
        return f"| {name} | " + " | ".join(cells) + " |"

    return [
        head, rule,
        row("layout and settings", [_settings(c.layout) for c in cols]),
        row("throughput (tokens/s)", [f"{c.pred.tokens_per_s:,.0f}" for c in cols]),
        row("step time (s)", [f"{c.pred.step_s:.2f}" for c in cols]),
        row(f"memory utilization (of {limit_gib:.0f} GiB)",
            [f"{c.pred.memory.total / c.pred.memory_limit:.0%} "
             f"({c.pred.memory.total / GIB:.1f} GiB)" for c in cols]),
        row("communication share (exposed)", [f"{c.pred.comm_fraction:.1%}" for c in cols]),
        row("data-parallel traffic (s per step, hidden or not)",
            [f"{c.pred.dp_comm_s:.2f}" for c in cols]),
        row(f"scaling efficiency at {cols[0].layout.num_gpus} GPUs",
            [f"{c.scaling:.0%} (vs {c.reference_gpus} GPUs)" for c in cols]),
        row("pipeline bubble", [f"{c.pred.bubble_fraction:.1%}" for c in cols]),
        row("MFU", [f"{c.pred.mfu:.1%}" for c in cols]),
        row("gain over A", [f"{cols[0].pred.step_s / c.pred.step_s - 1:+.0%}" for c in cols]),
    ]


def _mechanism_table(fabs: list[Fabric], measured: list[list[Measured]]) -> list[str]:
    lines = [
        "| mechanism | family | " + " | ".join(
            f"{fab.name}: best with it | {fab.name}: gain" for fab in fabs) + " |",
        "|---|---|" + "---|---|" * len(fabs),
    ]
    for i, mech in enumerate(MECHANISMS):
        cells = []
        for per_fabric in measured:
            got = per_fabric[i]
            cells.append("none fits" if got.with_it is None
                         else f"{_short(got.with_it[0])}: {got.with_it[1]:.2f} s")
            cells.append(_gain(got.gain))
        lines.append(f"| {mech.name} | {mech.family} | " + " | ".join(cells) + " |")
    return lines


def _findings(fab: Fabric, cols: list[Column], measured: list[Measured]) -> list[str]:
    """One fabric's bullets, every figure and verdict taken from the columns and mechanisms."""
    a, b, c, d = (col.pred for col in cols)
    best = cols[2].layout
    used = [mech.name for mech in MECHANISMS if mech.uses(best)]
    lines = [
        f"- {fab.name}: the free planner (C) is {a.step_s / c.step_s - 1:+.0%} against the "
        f"classic layout (A); the layout search alone, with A's mechanisms (B), "
        f"{a.step_s / b.step_s - 1:+.0%}. C's pick: {_short(best)}, {best.topology} "
        "collectives; of the mechanisms below it uses "
        + (", ".join(used) if used else "none")
        + ". The seed's communication settings (D) are "
        f"{d.step_s / c.step_s - 1:+.1%} against C. Exposed communication: A "
        f"{a.comm_fraction:.0%}, C {c.comm_fraction:.0%}."]
    for mech, got in zip(MECHANISMS, measured, strict=True):
        lines.append(f"  - {mech.name} {verdict(got.gain, mech.uses(best))}.")
    return lines


def render() -> str:
    fabs = fabrics()
    cols = [columns(fab.cluster) for fab in fabs]
    measured = [mechanisms(fab.cluster) for fab in fabs]
    fit = summary([predict_run(r, GPU_EFFICIENCY).step_s / r.measured_step_s
                   for r in packaged_runs(load_accelerators())])
    fit_median, fit_worst = fit["median_abs_error"], fit["worst_abs_error"]
    # The reported TFLOP/s count formula F1 (with recompute): 96 l h^2 (1 + s/6h + V/16lh) per
    # token.
    layers, h, s, v = 96, 12288, 2048, 51200
    f1_per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    cluster = fabs[0].cluster
    sc21_tokens = SC21_REPORTED_TFLOPS * 1e12 * cluster.num_gpus / f1_per_token
    a0 = cols[0][0].pred
    anchor = a0.tokens_per_s / sc21_tokens - 1
    limit_gib = cluster.accel.hbm_bytes / GIB
    lines = [
        "# The seed's results table, redone",
        "",
        "Generated by `python -m mcpar.sim.seed_table > docs/seed_table.md` from mcpar's cost "
        "model (`mcpar.sim`, see [cost_model.md](cost_model.md)); do not edit by hand.",
        "",
        f"GPT-3 175B (96 layers, hidden 12288, 96 heads, vocabulary 51200, sequence 2048) on "
        f"{cluster.num_gpus} A100-80GB ({cluster.num_nodes} nodes of {cluster.gpus_per_node}, "
        f"NVSwitch 300 GB/s per GPU and direction), global batch {PRESET.global_batch} "
        "sequences, fp16 with the 2021 Megatron kernels in every column, on two fabrics "
        "between the nodes:",
        "",
        *[f"- **{fab.name}**: {fab.text}." for fab in fabs],
        "",
        "The planner's columns rank only layouts `mcpar train` accepts (ZeRO runs its "
        "collectives flat; the parameter store and its codecs need ZeRO-3).",
    ]
    for fab, fab_cols in zip(fabs, cols, strict=True):
        lines += ["", f"## {fab.name}", "", *_table(fab_cols, limit_gib)]
    lines += [
        "", "## What each mechanism buys", "",
        "The best plan that uses the mechanism against the best plan of its family without it "
        "(the planner held to each, everything else free): gain = step time without / step "
        "time with - 1. A gain inside its family says nothing of whether the family wins; the "
        "bullets below say whether the free planner's pick (C) uses the mechanism.",
        "", *_mechanism_table(fabs, measured),
        "", "## What the numbers say", "",
        f"- Anchor: SC21 reports {SC21_REPORTED_TFLOPS:.0f} TFLOP/s per GPU for this model, "
        f"batch and GPU count, i.e. about {sc21_tokens:,.0f} tokens/s; column A on the "
        f"{fabs[0].name} fabric predicts {a0.tokens_per_s:,.0f} ({anchor:+.0%}). The seed's "
        f"table claims 12,345 tokens/s for classic 3D parallelism "
        f"({12_345 / sc21_tokens:.0%} of what was published for this very setting).",
    ]
    for fab, fab_cols, fab_measured in zip(fabs, cols, measured, strict=True):
        lines += _findings(fab, fab_cols, fab_measured)
    slow_a, slow_c = cols[-1][0], cols[-1][2]
    lines += [
        "- The seed claims \"+90% throughput, communication share 41% -> 18%, scaling 63% -> "
        f"89%\". At its own deployment floor ({fabs[-1].name}) the model predicts "
        f"{slow_a.pred.step_s / slow_c.pred.step_s - 1:+.0%} throughput (C over A), "
        f"communication share {slow_a.pred.comm_fraction:.0%} -> "
        f"{slow_c.pred.comm_fraction:.0%}, scaling {slow_a.scaling:.0%} -> "
        f"{slow_c.scaling:.0%}.",
        "",
        "## What each number assumes",
        "",
        "- Throughput: global batch x 2048 tokens / predicted step time. The step time is the "
        f"cost model's, fitted on published runs (median error {fit_median:.1%}, worst "
        f"{fit_worst:.1%} on the calibration rows, {anchor:+.0%} on the SC21 anchor above; see "
        "cost_model.md). No calibration row ran on a fabric as slow as the second one or with "
        "the parameter store: those figures are the model's extrapolation.",
        "- Memory utilization: predicted peak per GPU (weights, gradients, optimizer state per "
        "ZeRO stage, activations per recompute mode and schedule, logits, ZeRO-3's gathered "
        "blocks and root parameters, the store's secondary copy, a 2 GiB reserve) / "
        f"{limit_gib:.0f} GiB. No fragmentation beyond the reserve.",
        "- Communication share: communication on the critical path that no compute hides "
        "(tensor-parallel all-reduces, pipeline sends, exposed data-parallel traffic), over the "
        "step time. Traffic hidden behind compute is not counted.",
        f"- Scaling efficiency: per-GPU throughput on {cluster.num_gpus} GPUs over that of one "
        "data-parallel replica of the same layout (the GPU count in brackets), same global "
        "batch (strong scaling). It falls with the pipeline bubble (fewer micro-batches per "
        "replica) and with exposed data-parallel traffic.",
        "- The second fabric is the first with a node's GPUs sharing one NIC: everything else "
        "(NVSwitch, latencies, efficiencies) is the same.",
        "- Compression is priced as 1-bit Adam's compression stage or PowerSGD rank 4 after "
        "their warm-up, int8 as one byte per element plus an fp32 scale per 256 elements; "
        "their effect on convergence is not modelled. The fp16 runs' gradients are 16-bit "
        "already, so bf16 on the store's inter-node stage moves the same bytes; int8 keeps an "
        "fp32 error-feedback residual of the rank's 1/k gradient shard (k data ranks per node), "
        "and the store a 1/k copy of the weights.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
