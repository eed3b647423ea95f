"""The seed's results table, redone with the cost model: writes ``docs/seed_table.md``.

    python -m mcpar.sim.seed_table > docs/seed_table.md

GPT-3 175B on 1024 A100-80GB GPUs, global batch 1536 sequences of 2048 tokens, fp16 with the
2021 Megatron kernels in every column (so that differences come from layouts and settings, not
from newer kernels). Columns:

A. the classic 3D layout of the Megatron paper (Narayanan et al., SC21: tensor 8 inside the node,
   pipeline 8 interleaved by 2, data 16, micro-batch 1, full recompute, plain data-parallel
   all-reduce on flat rings);
B. the planner restricted to A's mechanisms (full recompute, no sequence parallelism, no ZeRO, no
   compression, flat rings): what choosing the layout alone gains;
C. the planner with everything it can choose (sequence parallelism, selective recompute, ZeRO,
   compression, hierarchical collectives, ...);
D. the planner held to the seed's communication settings (hierarchical collectives and 1-bit
   compression, which needs ZeRO 0): the best that MCP's communication features allow.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from mcpar.sim.calibration import summary
from mcpar.sim.costmodel import Prediction, simulate
from mcpar.sim.hardware import GIB, Cluster, cluster_preset, load_accelerators
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.planner import SearchSpace, plan
from mcpar.sim.runs import packaged_runs, predict_run
from mcpar.sim.workload import MODEL_PRESETS, Layout, ModelShape

PRESET = MODEL_PRESETS["gpt3-175b"]
CLUSTER = "a100x1024"
# Reported for this model, batch and GPU count in SC21 sec. 5.1 (the layout is not printed there;
# A is our reading of it, from the paper's other 175B-class runs).
SC21_REPORTED_TFLOPS = 140.0
CLASSIC = Layout(tp=8, pp=8, vp=2, dp=16, global_batch=PRESET.global_batch, micro_batch=1,
                 recompute="full", precision=PRESET.precision, topology="flat")


@dataclass
class Column:
    title: str
    layout: Layout
    pred: Prediction
    scaling: float
    reference_gpus: int


def scaling_efficiency(m: ModelShape, lay: Layout, cluster: Cluster) -> tuple[float, int]:
    """Per-GPU throughput at the full cluster over that of one data-parallel replica of the
    same layout (same global batch: strong scaling), and that replica's GPU count."""
    ref_gpus = lay.tp * lay.pp * lay.cp
    ref_layout = lay.with_(dp=1, zero_stage=0, compression="none")
    ref_cluster = replace(cluster, num_gpus=ref_gpus)
    ref = simulate(m, ref_layout, ref_cluster, GPU_EFFICIENCY, where="reference")
    full = simulate(m, lay, cluster, GPU_EFFICIENCY, where="seed")
    per_gpu_full = full.tokens_per_s / lay.num_gpus
    per_gpu_ref = ref.tokens_per_s / ref_gpus
    return per_gpu_full / per_gpu_ref, ref_gpus


def columns() -> tuple[list[Column], Cluster]:
    m = PRESET.shape
    cluster = cluster_preset(CLUSTER, load_accelerators())
    b, prec = PRESET.global_batch, PRESET.precision
    classic_space = SearchSpace(recompute=("full",), zero_stages=(0,), compression=("none",),
                                topology=("flat",), sequence_parallel=False)
    layout_only = plan(m, cluster, b, prec, classic_space, keep=1)
    everything = plan(m, cluster, b, prec, SearchSpace(), keep=1)
    best = everything.candidates[0].layout
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
    return out, cluster


def _settings(lay: Layout) -> str:
    return (f"{lay.describe()}{' +SP' if lay.seq_parallel else ''}, micro-batch "
            f"{lay.micro_batch}, recompute {lay.recompute}, ZeRO {lay.zero_stage}, compression "
            f"{lay.compression}, {lay.topology} collectives")


def render() -> str:
    cols, cluster = columns()
    a = cols[0].pred
    fit = summary([predict_run(r, GPU_EFFICIENCY).step_s / r.measured_step_s
                   for r in packaged_runs(load_accelerators())])
    fit_median, fit_worst = fit["median_abs_error"], fit["worst_abs_error"]
    # The reported TFLOP/s count formula F1 (with recompute): 96 l h^2 (1 + s/6h + V/16lh) per
    # token.
    layers, h, s, v = 96, 12288, 2048, 51200
    f1_per_token = 96 * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))
    sc21_tokens = SC21_REPORTED_TFLOPS * 1e12 * cluster.num_gpus / f1_per_token
    anchor = a.tokens_per_s / sc21_tokens - 1
    free_pick = ("" if cols[2].layout.compression != "none"
                 else ", and the free planner picks no compression")
    head = "| | " + " | ".join(c.title for c in cols) + " |"
    rule = "|---" * (len(cols) + 1) + "|"

    def row(name: str, cells: list[str]) -> str:
        return f"| {name} | " + " | ".join(cells) + " |"

    lines = [
        "# The seed's results table, redone",
        "",
        "Generated by `python -m mcpar.sim.seed_table > docs/seed_table.md` from mcpar's cost "
        "model (`mcpar.sim`, see [cost_model.md](cost_model.md)); do not edit by hand.",
        "",
        f"GPT-3 175B (96 layers, hidden 12288, 96 heads, vocabulary 51200, sequence 2048) on "
        f"{cluster.num_gpus} A100-80GB ({cluster.num_nodes} nodes of 8, NVSwitch 300 GB/s per "
        f"GPU and direction, one 200 Gb/s NIC per GPU), global batch {PRESET.global_batch} "
        "sequences, fp16 with the 2021 Megatron kernels in every column.",
        "",
        head, rule,
        row("layout and settings", [_settings(c.layout) for c in cols]),
        row("throughput (tokens/s)", [f"{c.pred.tokens_per_s:,.0f}" for c in cols]),
        row("step time (s)", [f"{c.pred.step_s:.2f}" for c in cols]),
        row("memory utilization (of 80 GiB)",
            [f"{c.pred.memory.total / c.pred.memory_limit:.0%} "
             f"({c.pred.memory.total / GIB:.1f} GiB)" for c in cols]),
        row("communication share (exposed)", [f"{c.pred.comm_fraction:.1%}" for c in cols]),
        row("scaling efficiency at 1024 GPUs",
            [f"{c.scaling:.0%} (vs {c.reference_gpus} GPUs)" for c in cols]),
        row("pipeline bubble", [f"{c.pred.bubble_fraction:.1%}" for c in cols]),
        row("MFU", [f"{c.pred.mfu:.1%}" for c in cols]),
        row("gain over A", [f"{cols[0].pred.step_s / c.pred.step_s - 1:+.0%}" for c in cols]),
        "",
        "## What the numbers say",
        "",
        f"- Anchor: SC21 reports {SC21_REPORTED_TFLOPS:.0f} TFLOP/s per GPU for this model, "
        f"batch and GPU count, i.e. about {sc21_tokens:,.0f} tokens/s; column A predicts "
        f"{a.tokens_per_s:,.0f} ({anchor:+.0%}). The seed's table "
        "claims 12,345 tokens/s for classic 3D parallelism: an order of magnitude below what "
        "was published for this very setting.",
        f"- Most of C's gain over A comes from choosing the layout and from memory-saving "
        f"mechanisms that are not MCP's (sequence parallelism and selective recompute, "
        f"Korthikanti et al. 2022, let it drop full recompute): compare B "
        f"({cols[0].pred.step_s / cols[1].pred.step_s - 1:+.0%}) and C "
        f"({cols[0].pred.step_s / cols[2].pred.step_s - 1:+.0%}).",
        f"- The seed's communication features (hierarchical collectives, 1-bit compression) "
        f"do not pay here: the best layout that uses them (D) is "
        f"{cols[3].pred.step_s / cols[2].pred.step_s - 1:+.1%} slower than C{free_pick}"
        f". With tensor parallelism inside the node and pipelining, each GPU's data-parallel "
        "gradient is small and its all-reduce hides behind the backward pass, so there is "
        "little communication left to save; 1-bit Adam exchanges momentum in the optimizer "
        "step, where nothing hides it, and needs ZeRO 0, whose memory forces a layout with "
        "more model parallelism.",
        "- The seed's \"+90% throughput, communication share 41% -> 18%, scaling 63% -> 89%\" "
        "is not what this model predicts for GPT-3 on A100s: the classic layout is not "
        "communication-bound to begin with. MCP's gain here, honestly counted, is the layout "
        "search and the memory settings it picks, not its communication features.",
        "",
        "## What each number assumes",
        "",
        "- Throughput: global batch x 2048 tokens / predicted step time. The step time is the "
        f"cost model's, fitted on published runs (median error {fit_median:.1%}, worst "
        f"{fit_worst:.1%} on the calibration rows, {anchor:+.0%} on the SC21 anchor above; see "
        "cost_model.md).",
        "- Memory utilization: predicted peak per GPU (weights, gradients, optimizer state per "
        "ZeRO stage, activations per recompute mode and schedule, logits, a 2 GiB reserve) / "
        "80 GiB. No fragmentation beyond the reserve.",
        "- Communication share: communication on the critical path that no compute hides "
        "(tensor-parallel all-reduces, pipeline sends, exposed data-parallel traffic), over the "
        "step time. Traffic hidden behind compute is not counted.",
        "- Scaling efficiency: per-GPU throughput on 1024 GPUs over that of one data-parallel "
        "replica of the same layout (the GPU count in brackets), same global batch (strong "
        "scaling). It falls with the pipeline bubble (fewer micro-batches per replica) and with "
        "exposed data-parallel traffic.",
        "- Compression is priced as 1-bit Adam's compression stage or PowerSGD rank 4 after "
        "their warm-up; their effect on convergence is not modelled.",
    ]
    return "\n".join(lines) + "\n"


def main() -> int:
    sys.stdout.write(render())
    return 0


if __name__ == "__main__":
    sys.exit(main())
