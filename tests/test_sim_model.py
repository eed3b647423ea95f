"""The cost model: collective formulas by hand, accuracy on the calibration rows, the fit's
reproducibility, and physical sanity (monotonicity) of every term."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from mcpar.errors import UserError
from mcpar.sim import ablation
from mcpar.sim.calibration import (
    accuracy_table,
    fit,
    group_summaries,
    leave_one_out,
    naive_constant,
    ratios,
    summary,
)
from mcpar.sim.collectives import (
    Group,
    Link,
    hierarchical_all_reduce,
    onebit_all_reduce,
    pairwise_all_to_all,
    point_to_point,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
)
from mcpar.sim.compute import layer_times, pipelined_exposed, roofline
from mcpar.sim.costmodel import model_flops_per_token, simulate
from mcpar.sim.hardware import GIB, cluster_preset, load_accelerators, make_cluster
from mcpar.sim.memory import memory_per_gpu
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.runs import (
    RUN_COLUMNS,
    formula_flops,
    packaged_runs,
    predict_run,
    read_runs_text,
)
from mcpar.sim.workload import MODEL_PRESETS, Layout, ModelShape

ACC = load_accelerators()
RUNS = packaged_runs(ACC)
GPT3 = MODEL_PRESETS["gpt3-175b"].shape


def resources_text(name: str) -> str:
    from importlib import resources

    return resources.files("mcpar.sim").joinpath(f"data/{name}").read_text()


def a100(n: int, gbps: float = 200) -> object:
    return make_cluster(ACC["a100-80gb"], n, 8, gbps)


# --- collectives, against hand-computed values ---------------------------------------------------

def test_ring_formulas_match_the_alpha_beta_table() -> None:
    link = Link(alpha=1e-5, bandwidth=1e10)
    # 2(p-1) alpha + 2 (p-1)/p n beta
    assert ring_all_reduce(1e9, 4, link) == pytest.approx(6e-5 + 0.15)
    # (p-1) alpha + (p-1)/p n beta
    assert ring_reduce_scatter(8e6, 8, Link(2e-6, 1e11)) == pytest.approx(1.4e-5 + 7e-5)
    assert ring_all_gather(8e6, 8, Link(2e-6, 1e11)) == pytest.approx(1.4e-5 + 7e-5)
    assert pairwise_all_to_all(4e6, 4, link) == pytest.approx(3e-5 + 3e-4)
    assert point_to_point(1e6, link) == pytest.approx(1e-5 + 1e-4)
    assert ring_all_reduce(1e9, 1, link) == 0.0


def test_hierarchical_all_reduce_by_hand() -> None:
    cluster = a100(32)  # 4 nodes of 8
    eff = 0.5
    n = 1e9
    hier = hierarchical_all_reduce(n, Group(32, 1), cluster, eff)
    b_l, b_r = 300e9 * eff, 25e9 * eff
    a_l, a_r = cluster.alpha_intra, cluster.alpha_inter
    intra = 2 * (7 * a_l + 7 / 8 * n / b_l)
    inter = 2 * 3 * a_r + 2 * 3 / 4 * (n / 8) / b_r
    assert hier.intra == pytest.approx(intra)
    assert hier.inter == pytest.approx(inter)


def test_groups_know_where_their_ranks_sit() -> None:
    assert Group(32, 1).per_node(8) == 8 and Group(32, 1).nodes(8) == 4
    assert Group(16, 8).per_node(8) == 1 and Group(16, 8).nodes(8) == 16
    assert Group(8, 2).per_node(8) == 4 and Group(8, 2).nodes(8) == 2


def test_onebit_sends_about_a_thirty_second_of_fp32() -> None:
    cluster = a100(64)
    values = 1e9
    group = Group(8, 8)  # one rank per node: all traffic inter-node
    slow = Link(0.0, cluster.inter_bw)
    fp32 = ring_all_reduce(4 * values, 8, slow)
    onebit = onebit_all_reduce(values, group, replace(cluster, alpha_inter=0.0), 1.0, False)
    assert onebit == pytest.approx(fp32 / 32, rel=0.01)


# --- accuracy on the calibration rows ----------------------------------------------------------

def test_calibration_rows_within_issue_bounds() -> None:
    ratios = [predict_run(r).step_s / r.measured_step_s for r in RUNS]
    stats = summary(ratios)
    assert stats["median_abs_error"] <= 0.05, ratios
    assert stats["worst_abs_error"] <= 0.15, ratios


def test_shipped_parameters_are_the_documented_fit() -> None:
    fitted = fit(RUNS)
    for name in ("gemm", "attention", "memory", "network", "overlap", "layer_overhead_s"):
        assert getattr(fitted, name) == pytest.approx(getattr(GPU_EFFICIENCY, name), rel=0.03)


def test_holdout_runs_beat_the_one_constant_baseline() -> None:
    """Published runs the parameters were never fitted on (FSDP-only, GQA/SwiGLU, deep
    interleaved pipelines with cp, MoE, fp8, Megatron-Core's H100 weak-scaling table;
    docs/cost_model.md): the model's median error stays near its documented 6.4%, below half
    the one-constant baseline's, and each source within its documented figure (before
    tensor-parallel overlap, the H100 attention share and BLOOM's unfused attention were
    priced: weak scaling 11.3%, BLOOM 15.6%; before MPT's Triton flash kernel, llm-foundry
    14.6%; before Megatron's unfused cross-entropy, weak scaling 5.1%; before torchtitan's
    op-level checkpointing, torchtitan 12.3%; before BLOOM's whole-gradient all-reduce, BLOOM
    10.6%)."""
    holdout = packaged_runs(ACC, "holdout_runs.csv")
    assert len(holdout) >= 36
    assert not {r.id for r in holdout} & {r.id for r in RUNS}
    table = accuracy_table(holdout, GPU_EFFICIENCY, naive_constant(RUNS))
    model = summary([row["ratio"] for row in table])
    naive = summary([row["naive_ratio"] for row in table])
    assert model["median_abs_error"] <= 0.065, table
    assert model["median_abs_error"] <= naive["median_abs_error"] / 2, (model, naive)
    groups = group_summaries(holdout, [row["ratio"] for row in table])  # type: ignore[misc]
    bounds = {"megatron-core-h100-weak": 0.048, "nvidia-dgxc": 0.063, "bigscience-bloom": 0.095,
              "llmfoundry-mpt-fsdp": 0.082, "torchtitan": 0.10}
    for group, bound in bounds.items():
        assert groups[group]["median_abs_error"] <= bound, (group, groups[group])


@pytest.mark.parametrize("term", ["attention", "recompute", "ep_comm", "dp_comm", "bubble"])
def test_dropping_a_term_and_refitting_worsens_the_heldout_rows_it_touches(term: str) -> None:
    """The terms docs/cost_model.md says earn their place: without one, parameters refitted on
    the calibration rows predict the held-out rows where it matters worse than the model."""
    holdout = packaged_runs(ACC, "holdout_runs.csv")
    rows = ablation.touched(holdout, term)
    assert rows
    refit = fit(RUNS, restarts=1, step=ablation.without(term))
    ablated = summary(ratios(rows, refit, ablation.without(term)))
    full = summary(ratios(rows, GPU_EFFICIENCY))
    assert ablated["median_abs_error"] > full["median_abs_error"] + 0.01, (ablated, full)


@pytest.mark.slow
def test_leave_one_out_stays_within_the_issue_bounds() -> None:
    """Each calibration row predicted with the parameters refitted without it: median <= 4%,
    every source's median <= 10% (documented: 2.5%; sc21 1.9%, the dgxc row 5.2%)."""
    loo = leave_one_out(RUNS, restarts=1)
    rs = [r for _, r in loo]
    assert summary(rs)["worst_abs_error"] <= 0.15, loo
    assert summary(rs)["median_abs_error"] <= 0.04, loo
    for group, stats in group_summaries(RUNS, rs).items():
        assert stats["median_abs_error"] <= 0.10, (group, stats)


def test_named_formulas_reproduce_the_published_tflops() -> None:
    for run in RUNS:
        flops = formula_flops(run)
        assert flops is not None
        tflops = flops / (run.measured_step_s * run.layout.num_gpus) / 1e12
        assert tflops == pytest.approx(run.measured_tflops, rel=0.01), run.id


def test_model_flops_match_f2_for_a_gpt3_shape() -> None:
    m = GPT3
    f2 = 72 * m.layers * m.hidden**2 * (1 + m.seq_len / (6 * m.hidden)
                                         + m.vocab / (12 * m.layers * m.hidden))
    assert model_flops_per_token(m) == pytest.approx(f2, rel=1e-3)


# --- sanity: every term moves the right way -----------------------------------------------------

BASE = Layout(tp=8, pp=8, dp=16, global_batch=1536, micro_batch=1, recompute="selective",
              seq_parallel=True, precision="bf16")


def step(lay: Layout, m: ModelShape = GPT3, cluster: object = None) -> float:
    return simulate(m, lay, cluster or a100(lay.num_gpus)).step_s


def mem(lay: Layout, m: ModelShape = GPT3) -> float:
    return memory_per_gpu(m, lay).total


def test_more_tensor_or_pipeline_parallelism_means_less_memory_per_gpu() -> None:
    assert mem(BASE.with_(tp=4, dp=32)) > mem(BASE) > mem(BASE.with_(tp=8, pp=16, dp=8))


def test_zero_stages_and_recompute_shrink_memory() -> None:
    values = [mem(BASE.with_(zero_stage=z)) for z in range(4)]
    assert values == sorted(values, reverse=True) and values[0] > values[3]
    acts = [memory_per_gpu(GPT3, BASE.with_(recompute=r, attention="unfused")).activations
            for r in ("none", "selective", "full")]
    assert acts[0] > acts[1] > acts[2]


def test_recompute_costs_time() -> None:
    times = [step(BASE.with_(recompute=r)) for r in ("none", "selective", "full")]
    assert times[0] < times[1] < times[2]
    assert times[2] / times[0] == pytest.approx(4 / 3, abs=0.08)  # one more forward


def test_more_micro_batches_and_interleaving_shrink_the_bubble() -> None:
    small = simulate(GPT3, BASE.with_(global_batch=256), a100(1024)).bubble_fraction
    large = simulate(GPT3, BASE, a100(1024)).bubble_fraction
    inter = simulate(GPT3, BASE.with_(vp=2), a100(1024)).bubble_fraction
    assert small > large > inter > 0
    assert large == pytest.approx(7 / (96 + 7), abs=0.02)  # (p-1)/(m+p-1)


def test_faster_network_never_slows_a_step() -> None:
    dp_heavy = Layout(tp=1, pp=1, dp=64, global_batch=256, micro_batch=4, zero_stage=3,
                      recompute="full", precision="bf16")
    m = MODEL_PRESETS["llama2-7b"].shape
    times = [step(dp_heavy, m, a100(64, gbps)) for gbps in (5, 25, 100, 400)]
    assert times == sorted(times, reverse=True) and times[0] > 1.05 * times[-1]


def test_compression_and_hierarchy_cut_data_parallel_time_on_a_slow_fabric() -> None:
    m = MODEL_PRESETS["gpt3-1.3b"].shape
    lay = Layout(tp=1, pp=1, dp=256, global_batch=512, micro_batch=2, precision="bf16",
                 topology="flat")
    slow = a100(256, 10)
    plain = simulate(m, lay, slow)
    onebit = simulate(m, lay.with_(compression="1bit"), slow)
    half = simulate(m, lay.with_(compression="bf16"), slow)
    assert onebit.dp_comm_s < half.dp_comm_s < plain.dp_comm_s
    assert onebit.step_s < plain.step_s
    hier = simulate(m, lay.with_(topology="hierarchical"), slow)
    assert hier.dp_comm_s < plain.dp_comm_s  # fewer inter-node latency steps


def test_grouped_query_attention_and_swiglu_are_priced() -> None:
    mha = ModelShape(32, 4096, 32, 32, 11008, "swiglu", 32000, 4096)
    gqa = replace(mha, kv_heads=8)
    gelu = replace(mha, ffn_kind="gelu")
    lay = Layout(tp=8, pp=1, dp=1, global_batch=8, micro_batch=1, precision="bf16")
    cluster = a100(8)
    assert simulate(gqa, lay, cluster).step_s < simulate(mha, lay, cluster).step_s
    assert simulate(gelu, lay, cluster).step_s < simulate(mha, lay, cluster).step_s
    assert gqa.num_params() < mha.num_params()


def test_moe_all_to_all_grows_with_expert_parallelism_across_nodes() -> None:
    m = MODEL_PRESETS["mixtral-8x7b"].shape
    cluster = cluster_preset("h100x64", ACC)
    lay = Layout(tp=1, pp=1, dp=64, ep=8, global_batch=256, micro_batch=1, precision="bf16",
                 zero_stage=1, recompute="full")
    inside = simulate(m, lay, cluster)
    across = simulate(m, lay, replace(cluster, gpus_per_node=4))
    assert across.breakdown["ep_comm"] > inside.breakdown["ep_comm"] > 0
    # Experts are split over ep ranks: far less weight memory than replicating them.
    assert memory_per_gpu(m, lay).weights < memory_per_gpu(m, lay.with_(ep=1)).weights / 3


def test_context_parallelism_splits_long_sequences() -> None:
    m = MODEL_PRESETS["llama3-8b"].shape
    cluster = cluster_preset("h100x64", ACC)
    lay = Layout(tp=2, pp=1, dp=32, global_batch=64, micro_batch=1, seq_parallel=True,
                 precision="bf16")
    with_cp = lay.with_(cp=4, dp=8)
    assert memory_per_gpu(m, with_cp).activations < memory_per_gpu(m, lay).activations / 3
    pred = simulate(m, with_cp, cluster)
    assert math.isfinite(pred.step_s) and pred.step_s > 0


def test_fp8_and_newer_gpus_are_faster() -> None:
    m = MODEL_PRESETS["llama2-70b"].shape
    lay = Layout(tp=8, pp=4, dp=2, global_batch=64, micro_batch=1, seq_parallel=True,
                 precision="bf16")
    t_a100 = step(lay, m, cluster_preset("a100x64", ACC))
    t_h100 = step(lay, m, cluster_preset("h100x64", ACC))
    t_fp8 = step(lay.with_(precision="fp8"), m, cluster_preset("h100x64", ACC))
    assert t_a100 > 2 * t_h100 > 2 * t_fp8


def test_memory_fits_where_published_runs_ran() -> None:
    for run in RUNS:
        if run.layout.tp > 1 and not run.layout.seq_parallel and run.row["group"].startswith(
                "nvidia-dgxc"):
            continue  # see cost_model.md: that row almost surely ran with sequence parallelism
        assert predict_run(run).memory.total < 80 * GIB, run.id


def test_dropout_masks_cost_their_draw_where_it_is_a_kernel_of_its_own() -> None:
    """On a CPU (a measured mask rate) dropout adds the masks' draw: the embedding's, two per
    layer and, under the math kernel, the attention probabilities', at one thread's rate however
    many threads the worker runs (torch's CPU generator draws in one); on a GPU (rate 0, the
    draw fused into the element-wise kernels) it adds nothing."""
    from mcpar.sim.hardware import LocalProfile
    from mcpar.sim.localprofile import local_cluster

    shape = ModelShape(name="t", layers=4, hidden=256, heads=4, kv_heads=4, ffn=1024,
                       ffn_kind="gelu", vocab=512, seq_len=128)
    lay = Layout(tp=1, pp=1, dp=1, micro_batch=8, global_batch=8, precision="fp32")
    rate = 1.6e8
    cpu = local_cluster(LocalProfile(
        cores=2, flops_per_thread=5e10, attention_flops_per_thread=2e10, mem_bw_per_thread=1e10,
        mem_bw_total=2e10, op_overhead_s=1e-5, layer_overhead_s=1e-4, mask_rate_per_thread=rate,
        collectives={"ar": [1e-4, 1e-9]}, notes={}))

    def step(m: ModelShape, layout: Layout, cluster: object) -> float:
        return simulate(m, layout, cluster, validate=False).step_s  # type: ignore[arg-type]

    off, on = replace(shape, dropout=False), replace(shape, dropout=True)
    tokens = 8 * 128
    hidden_masks = (1 + 2 * 4) * tokens * 256  # the embedding's, then two per layer
    per_rank = rate  # one worker on two cores runs two threads, and draws in one
    assert step(on, lay, cpu) - step(off, lay, cpu) == pytest.approx(hidden_masks / per_rank,
                                                                      rel=1e-6)
    math_lay = replace(lay, attention="math")
    scores = 4 * 8 * 4 * 128 * 128  # layers x micro-batch x heads x s x s
    extra = step(on, math_lay, cpu) - step(off, math_lay, cpu)
    assert extra == pytest.approx((hidden_masks + scores) / per_rank, rel=1e-6)
    gpu = make_cluster(load_accelerators()["a100-80gb"], 1, 1, 200)
    bf16 = replace(lay, precision="bf16")
    assert step(on, bf16, gpu) == step(off, bf16, gpu)


# --- mechanisms of the published stacks ----------------------------------------------------------

def test_pipelined_collective_exposes_the_longer_side_and_one_chunk() -> None:
    assert pipelined_exposed(3.0, 5.0, 4) == pytest.approx(0.75)  # hidden but the first chunk
    assert pipelined_exposed(5.0, 3.0, 4) == pytest.approx(2.75)  # the wire is the long side


def test_tensor_parallel_overlap_hides_collectives_behind_their_gemms() -> None:
    """Megatron-Core's --tp-comm-overlap: the layer's exposed tensor-parallel time shrinks to
    the chunks that cannot overlap plus the SMs the pipelined reduce-scatters keep from their
    GEMMs; on a GPU with no SM count known nothing is kept, so less is exposed."""
    h100 = make_cluster(ACC["h100-80gb"], 384, 8, 400)
    m = ModelShape(layers=48, hidden=7168, heads=56, kv_heads=56, ffn=28672, ffn_kind="gelu",
                   vocab=131072, seq_len=4096)
    lay = Layout(tp=8, dp=48, seq_parallel=True, global_batch=192, micro_batch=1, zero_stage=1)
    plain = simulate(m, lay, h100).breakdown["tp_comm"]
    overlapped = simulate(m, lay.with_(tp_comm_overlap=True), h100).breakdown["tp_comm"]
    free_sms = replace(h100, accel=replace(h100.accel, sms=0))
    no_margin = simulate(m, lay.with_(tp_comm_overlap=True), free_sms).breakdown["tp_comm"]
    assert 0 < no_margin < overlapped < plain / 2, (no_margin, overlapped, plain)


def test_h100_attention_runs_at_flash_attention_2s_share_of_its_peak() -> None:
    lay = Layout()
    eff = GPU_EFFICIENCY
    h100 = roofline(make_cluster(ACC["h100-80gb"], 8, 8, 400), lay, eff)
    a100_cluster = make_cluster(ACC["a100-80gb"], 8, 8, 200)
    a100 = roofline(a100_cluster, lay, eff)
    assert a100.attn_flops == pytest.approx(a100_cluster.accel.peak("bf16") * eff.attention)
    assert h100.attn_flops == pytest.approx(989e12 * 0.35 / 0.615 * eff.attention)
    assert h100.gemm_flops == pytest.approx(989e12 * eff.gemm)  # GEMMs keep the whole peak


def test_older_flash_kernels_run_at_their_published_speed_against_flash_attention_2() -> None:
    """FlashAttention-2 paper (section 4.1): 2x FlashAttention-1, 1.3-1.5x the Triton port
    forward and 2x backward; only the attention core moves, and MPT's rows name the Triton
    kernel their yamls set (attn_impl: triton)."""
    cluster = make_cluster(ACC["a100-80gb"], 8, 8, 200)
    m = replace(GPT3, seq_len=8192)
    lay = Layout(tp=8, global_batch=1)
    core = {k: simulate(m, lay.with_(flash_kernel=k), cluster).breakdown
            for k in ("fa2", "fa1", "triton")}
    fa2 = core["fa2"]["attention"]
    assert core["fa1"]["attention"] == pytest.approx(2 * fa2)
    fwd = fa2 / (1 + 2.5)  # the backward is FLASH_BWD_FACTOR forwards
    assert core["triton"]["attention"] == pytest.approx(1.4 * fwd + 2 * 2.5 * fwd)
    assert core["triton"]["gemm"] == core["fa2"]["gemm"]
    mpt = [r for r in packaged_runs(ACC, "holdout_runs.csv") if r.id.startswith("mpt-")]
    assert mpt and all(r.layout.flash_kernel == "triton" for r in mpt)
    assert all(r.layout.attention_kind == "flash" for r in mpt)


def test_megatrons_unfused_cross_entropy_moves_its_counted_bytes() -> None:
    """Megatron's vocab-parallel cross-entropy (52 bytes per logit element, counted from its
    code) against a fused kernel's 16: only the head's element-wise time moves, by the bytes'
    difference over the memory rate; the Megatron rows (SC21, BLOOM, the weak-scaling table)
    say so."""
    cluster = make_cluster(ACC["h100-80gb"], 8, 8, 400)
    m = ModelShape(layers=2, hidden=2048, heads=16, kv_heads=16, ffn=8192, ffn_kind="gelu",
                   vocab=131072, seq_len=4096)
    lay = Layout(tp=2, dp=4, global_batch=4, micro_batch=1)
    fused = simulate(m, lay, cluster)
    unfused = simulate(m, lay.with_(cross_entropy="megatron"), cluster)
    rl = roofline(cluster, lay, GPU_EFFICIENCY)
    extra = (52 - 16) * 4096 * 131072 / 2 / rl.mem_bw
    assert unfused.breakdown["elementwise"] - fused.breakdown["elementwise"] == pytest.approx(extra)
    assert unfused.breakdown["gemm"] == fused.breakdown["gemm"]
    megatron = {r.id for r in RUNS + packaged_runs(ACC, "holdout_runs.csv")
                if r.layout.cross_entropy == "megatron"}
    assert {r.id for r in RUNS if r.id.startswith("sc21")} <= megatron
    assert {"bloom-176b-384g", "mcore-weak-1.7b", "mcore-weak-462b"} <= megatron
    assert not any(i.startswith(("dgxc", "mpt", "tt")) for i in megatron)


def test_torchtitans_op_checkpointing_reruns_every_second_matrix_product() -> None:
    """torchtitan's 'selective op' policy keeps every compute op's output but every second mm:
    a Llama block's forward runs wq, wk, wv, wo, w1, w3, w2, so the backward reruns wk, wo and
    w3 and all element-wise work, not the attention core; the 8B row says so."""
    cluster = make_cluster(ACC["a100-80gb"], 8, 8, 200)
    m = ModelShape(layers=2, hidden=4096, heads=32, kv_heads=8, ffn=14336, ffn_kind="swiglu",
                   vocab=128256, seq_len=8192)
    lay = Layout(dp=8, global_batch=8, micro_batch=1)
    plain = simulate(m, lay, cluster)
    op = simulate(m, lay.with_(alternate_mm_recompute=True), cluster)
    rl = roofline(cluster, lay, GPU_EFFICIENCY)
    tok, h = 8192, 4096
    mms = rl.gemm(tok, 1024, h) + rl.gemm(tok, h, h) + rl.gemm(tok, 14336, h)
    elementwise_fwd = layer_times(m, lay, cluster, GPU_EFFICIENCY, rl).parts["elementwise"] / 3
    assert "recompute" not in plain.breakdown
    assert op.breakdown["recompute"] == pytest.approx(2 * (mms + elementwise_fwd))
    assert op.breakdown["attention"] == plain.breakdown["attention"]
    tt = {r.id: r for r in packaged_runs(ACC, "holdout_runs.csv") if r.id.startswith("tt-")}
    assert tt["tt-a100-llama3-8b-64g"].layout.alternate_mm_recompute
    assert tt["tt-a100-llama3-8b-64g"].layout.recompute == "none"
    assert not tt["tt-a100-llama3-70b-64g"].layout.alternate_mm_recompute


def test_data_parallel_traffic_not_overlapped_is_all_exposed() -> None:
    """``dp_overlap`` false (DeepSpeed's pipeline engine reduces gradients after the last
    backward): every second of the data-parallel exchange lands on the step; BLOOM's row says
    so, the other held-out rows overlap."""
    cluster = a100(384, 50)
    lay = Layout(tp=4, pp=12, dp=8, zero_stage=1, global_batch=2048, micro_batch=2,
                 recompute="full")
    m = replace(GPT3, layers=72)
    hidden = simulate(m, lay, cluster)
    serial = simulate(m, lay.with_(dp_overlap=False), cluster)
    assert hidden.breakdown["dp_comm"] < serial.breakdown["dp_comm"]
    assert serial.breakdown["dp_comm"] == pytest.approx(serial.dp_comm_s)
    assert serial.step_s - hidden.step_s == pytest.approx(
        serial.breakdown["dp_comm"] - hidden.breakdown["dp_comm"])
    holdout = packaged_runs(ACC, "holdout_runs.csv")
    assert [r.id for r in holdout if not r.layout.dp_overlap] == ["bloom-176b-384g"]


def test_bf16_optimizer_all_reduces_whole_gradients_beside_its_sharded_state() -> None:
    """DeepSpeed's BF16 optimizer (BLOOM: zero stage 0 in its config, 'it implements its own
    zero stage 1 equivalent') has its engine all-reduce the fp32 gradients, then gathers the
    updated bf16 weights: a ring all-reduce where ZeRO-1 reduce-scatters, twice the bytes."""
    cluster = a100(384, 50)
    lay = Layout(tp=4, pp=12, dp=8, zero_stage=1, global_batch=2048, micro_batch=2,
                 recompute="full", dp_overlap=False)
    m = replace(GPT3, layers=72)
    scatter = simulate(m, lay, cluster)
    whole = simulate(m, lay.with_(grad_all_reduce=True), cluster)
    rs = whole.dp_comm_s - scatter.dp_comm_s  # the all-reduce's second half: an all-gather
    assert 0.9 < rs / (scatter.dp_comm_s * 2 / 3) < 1.1  # fp32 gradients: 2/3 of RS + AG(bf16)
    assert whole.step_s - scatter.step_s == pytest.approx(rs)
    bloom = next(r for r in packaged_runs(ACC, "holdout_runs.csv") if r.id.startswith("bloom"))
    assert bloom.layout.grad_all_reduce
    header = resources_text("holdout_runs.csv").splitlines()[0]
    row = next(line for line in resources_text("holdout_runs.csv").splitlines()
               if line.startswith("mpt-70b-h100")).rsplit(",", 1)[0]
    with pytest.raises(UserError) as err:  # FSDP (ZeRO-3) has no whole-gradient all-reduce
        read_runs_text(header + "\n" + row + ",all_reduce", "t.csv", ACC)
    assert "mpt-70b-h100-64g-s2048.grad_reduce" in str(err.value)


def test_run_rows_take_the_stack_columns_and_name_a_bad_one() -> None:
    header = ",".join(RUN_COLUMNS)
    text = RUN_CSV_TEXT = resources_text("published_runs.csv")
    assert text.splitlines()[0] == header + ",tp_comm_overlap,attention,cross_entropy"
    bloom = next(r for r in packaged_runs(ACC, "holdout_runs.csv") if r.id.startswith("bloom"))
    assert bloom.layout.attention_kind == "unfused"
    assert bloom.layout.cross_entropy == "megatron"
    weak = next(r for r in packaged_runs(ACC, "holdout_runs.csv") if r.id == "mcore-weak-32b")
    assert weak.layout.tp_comm_overlap
    # The required columns alone still read (the stack's columns are optional).
    plain = "\n".join(line.rsplit(",", 3)[0] for line in RUN_CSV_TEXT.splitlines()[:2])
    alone = read_runs_text(plain, "t.csv", ACC)[0].layout
    assert not alone.tp_comm_overlap and alone.cross_entropy == "fused"
    row = RUN_CSV_TEXT.splitlines()[1].rsplit(",", 3)[0]
    header = text.splitlines()[0] + ",dp_overlap"
    for tail, column in ((",maybe,auto,fused,true", "tp_comm_overlap"),
                         (",true,auto,fused,true", "tp_comm_overlap"),
                         (",false,ring,fused,true", "attention"),
                         (",false,flash,fused,often", "dp_overlap"),
                         (",false,flash,apex,true", "cross_entropy")):
        with pytest.raises(UserError) as err:
            read_runs_text(header + "\n" + row + tail, "t.csv", ACC)
        assert f"sc21-1.7B.{column}" in str(err.value), err.value
    stack = read_runs_text(header + "\n" + row + ",false,flash_triton,megatron,false", "t.csv",
                           ACC)[0].layout
    assert (stack.flash_kernel, stack.cross_entropy, stack.dp_overlap) == (
        "triton", "megatron", False)
