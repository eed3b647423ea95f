"""Context parallelism in the cost model, the memory estimate and the planners: mcpar's ring and
Ulysses priced as they run, the runtime's refusals read from their one rule, and a long-sequence
preset the planner puts on the context axis, which then trains."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_mcpar

from mcpar.auto_layout import choose_layout
from mcpar.config import load_config
from mcpar.errors import UserError
from mcpar.plan import resolve_plan
from mcpar.sim import planner as planner_module
from mcpar.sim.collectives import Group, all_to_all, p2p
from mcpar.sim.compute import layer_times, ring_core_times
from mcpar.sim.costmodel import rank_roofline
from mcpar.sim.fromconfig import CONFIG_KEYS, config_layout, config_model
from mcpar.sim.hardware import cluster_preset, load_accelerators
from mcpar.sim.memory import activation_bytes_per_layer, context_workspace_bytes, memory_per_gpu
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.planner import SearchSpace, plan, train_problems
from mcpar.sim.workload import Layout, ModelShape, layout_problems

PRESET = REPO / "examples" / "long_context" / "gpt_2k.yaml"
ACC = load_accelerators()
LONG = ModelShape(layers=4, hidden=1024, heads=16, kv_heads=16, ffn=4096, ffn_kind="gelu",
                  vocab=32000, seq_len=32768, dropout=False)


def _layer(m: ModelShape, lay: Layout, cluster_name: str = "h100x64") -> dict[str, float]:
    cluster = cluster_preset(cluster_name, ACC)
    rl = rank_roofline(cluster, lay, GPU_EFFICIENCY)
    return layer_times(m, lay, cluster, GPU_EFFICIENCY, rl).parts


def test_ulysses_pays_four_all_to_alls_per_pass_and_no_ring() -> None:
    """Q, K, V to head shards and the output back, forward and backward: 8 all-to-alls of one
    rank's [tokens, hidden / tp] tensor per layer, nothing hidden."""
    lay = Layout(tp=1, cp=4, dp=16, global_batch=16, micro_batch=1, context_mode="ulysses")
    cluster = cluster_preset("h100x64", ACC)
    tokens = LONG.seq_len / 4
    one = all_to_all(tokens * LONG.hidden * 2, Group(4, 1), cluster, GPU_EFFICIENCY.network)
    assert _layer(LONG, lay)["cp_comm"] == pytest.approx(8 * one)


def test_mcpar_ring_exposes_its_dkv_hops_where_a_published_ring_hides_them() -> None:
    """mcpar's ring sends each block's fp32 dK/dV after the block is computed and waits for it
    (cp hops per layer backward); a published ring (flash_ring) passes them on beside the next
    block. On a 32k sequence the K/V hops hide behind the blocks; the dK/dV hops do not."""
    base = Layout(tp=1, cp=4, dp=16, global_batch=16, micro_batch=1)
    cluster = cluster_preset("h100x64", ACC)
    slow = dataclasses.replace(cluster, gpus_per_node=1)  # the ring crosses nodes
    tokens = LONG.seq_len / 4
    dkv = p2p(2 * tokens * LONG.hidden * 4, Group(4, 1), slow, GPU_EFFICIENCY.network)
    rl = rank_roofline(slow, base, GPU_EFFICIENCY)
    ring = layer_times(LONG, base.with_(context_mode="ring"), slow, GPU_EFFICIENCY, rl)
    published = layer_times(LONG, base, slow, GPU_EFFICIENCY, rl)
    assert ring.parts["cp_comm"] == pytest.approx(4 * dkv)
    assert ring.parts["cp_comm"] > 3 * published.parts["cp_comm"]


def test_the_ring_blocks_do_balanced_work_and_shrink_with_the_axis() -> None:
    """Every rank computes the own 2c x 2c block and cp - 1 dense c x 2c blocks: (cp + 1) / 2
    c x 2c units of the sequence's 2cp^2, so a rank's share falls as (cp + 1) / cp^2."""
    cluster = cluster_preset("h100x64", ACC)
    times = {}
    for cp in (2, 4, 8):
        lay = Layout(cp=cp, dp=64 // cp, global_batch=64 // cp, context_mode="ring")
        times[cp] = ring_core_times(LONG, lay, cluster, rank_roofline(cluster, lay,
                                                                      GPU_EFFICIENCY))[0]
    assert times[2] > times[4] > times[8]
    # (the own block also builds and applies its mask: a little more than the units say)
    assert times[2] / times[4] == pytest.approx((3 / 4) / (5 / 16), rel=0.1)


def test_memory_holds_a_shard_of_tokens_and_the_ring_keeps_its_block_workspace() -> None:
    """Per layer, context parallelism keeps 1/cp of the tokens' activations (plus the ring's
    fp32 output, which at 16 bits is a copy of its own); the ring's backward works on its own
    2c x 2c block's fp32 scores, a workspace that falls as 1/cp^2 (Ulysses has none of it)."""
    lay = Layout(dp=8, global_batch=8, precision="bf16")
    kept_1 = activation_bytes_per_layer(LONG, lay)[0]
    ring2 = lay.with_(cp=2, dp=4, global_batch=4, context_mode="ring")
    kept_2 = activation_bytes_per_layer(LONG, ring2)[0]
    tokens_hidden = LONG.seq_len / 2 * LONG.hidden
    assert kept_2 == pytest.approx(kept_1 / 2 + 4 * tokens_hidden)
    ws2 = context_workspace_bytes(LONG, ring2)
    ws4 = context_workspace_bytes(LONG, ring2.with_(cp=4, dp=2, global_batch=2))
    own_block_scores = 16 * (LONG.seq_len / 2) ** 2 * 4
    assert ws2 > 4 * own_block_scores
    assert ws4 < ws2 / 3.5
    assert context_workspace_bytes(LONG, ring2.with_(context_mode="ulysses")) < ws2 / 100


def test_the_planner_reads_the_runtimes_context_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every cp > 1 layout the planner ranks passes the runtime's rule (no recompute, codec or
    hierarchical topology beside it; sequence parallelism composes, and ZeRO shards over data
    x context, so their variants are ranked too); and the planner consults that rule rather
    than a copy: with the rule relaxed, it ranks what it then allows."""
    cluster = dataclasses.replace(cluster_preset("h100x64", ACC), num_gpus=8)
    space = SearchSpace(cp=(1, 2, 4), tp=(1, 2))

    def ranked() -> list[Layout]:
        result = plan(LONG, cluster, 8, "bf16", space, keep=100)
        return [c.layout for c in result.candidates]

    layouts = ranked()
    context = [lay for lay in layouts if lay.cp > 1]
    assert context, layouts[:5]
    for lay in context:
        assert not train_problems(lay, LONG)
        assert (lay.recompute, lay.compression) == ("none", "none")
    assert {lay.zero_stage for lay in context} > {0}, context  # ZeRO composes with context
    monkeypatch.setattr(planner_module, "context_layout_problems", lambda facts: [])
    relaxed = [lay for lay in ranked() if lay.cp > 1]
    assert any(lay.recompute != "none" or lay.compression != "none" for lay in relaxed)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_memory_estimate_shards_zero_state_over_data_x_context(stage: int) -> None:
    """`mcpar check`'s estimate (the plan's) and the cost model's: under ZeRO the sharded state
    is divided by data x context, so context 2 x data 2 holds what data 4 holds, a quarter of
    the unsharded state; without the context axis in the divisor it would hold a half."""
    zero = f"controllers.memory.zero_stage={stage}"

    def estimate(world: int, *settings: str) -> dict[str, int]:
        cfg = load_config(None, [*TINY, "model.seq_len=64", *settings])
        return resolve_plan(cfg, world).to_json()["memory"]

    full = estimate(1)
    cp2_dp2 = estimate(4, "parallelism.context=2", "parallelism.data=2", zero)
    dp4 = estimate(4, "parallelism.data=4", zero)
    rows = ["optimizer state", "gradients", "parameters"][:stage]
    for row in rows:
        assert cp2_dp2[row] == dp4[row] == full[row] / 4, (row, cp2_dp2, full)
    for row in ["optimizer state", "gradients", "parameters"][stage:]:
        assert cp2_dp2[row] == full[row]  # what the stage does not shard
    plan = resolve_plan(load_config(None, [*TINY, "model.seq_len=64", "parallelism.context=2",
                                           zero]), 2)
    assert plan.to_json()["memory"]["optimizer state"] == full["optimizer state"] / 2
    lay = Layout(tp=1, pp=1, cp=4, dp=2, global_batch=8, micro_batch=1, precision="bf16",
                 zero_stage=stage)
    sharded = memory_per_gpu(LONG, lay)
    flat = memory_per_gpu(LONG, lay.with_(cp=1, dp=8))
    unsharded = memory_per_gpu(LONG, lay.with_(zero_stage=0))
    assert sharded.optimizer == flat.optimizer == pytest.approx(unsharded.optimizer / 8)


@pytest.mark.parametrize("settings", [
    ["parallelism.context_mode=ulysses"],
    ["parallelism.context_mode=ulysses", "model.num_heads=1", "model.hidden_size=32"],
    ["controllers.memory.zero_stage=1"],
    ["controllers.memory.zero_stage=3", "controllers.memory.allocation=topology_aware",
     "cluster.ranks_per_node=1"],
    ["controllers.memory.activation_checkpointing=selective"],
    ["controllers.communication.compression=bf16"],
    ["controllers.communication.topology=hierarchical", "cluster.ranks_per_node=1"],
    ["model.dropout=0.1"],
    ["model.seq_len=30"],
    [],
])
def test_check_and_the_planners_rule_agree_on_context_layouts(settings: list[str]) -> None:
    """`mcpar check` (the plan) and the planner (the cost model's rules and train's) accept or
    refuse the same context layouts with the same messages."""
    cfg = load_config(None, [*TINY, "model.dropout=0", "parallelism.context=2", *settings])
    try:
        resolve_plan(cfg, 2)
        check: list[str] = []
    except UserError as err:
        check = sorted(set(err.problems))
    lay = config_layout(cfg, 2)
    m = config_model(cfg)
    planned = sorted(set(layout_problems(m, lay, 2, 2, "config", CONFIG_KEYS))
                     | set(train_problems(lay, m)))
    context_lines = [p for p in check if "context" in p or "seq_len" in p]
    assert sorted(context_lines) == sorted(p for p in planned
                                           if "context" in p or "seq_len" in p), (check, planned)


def _test_profile(tmp_path: Path) -> dict[str, str]:
    """A fixed local profile (the profile store's test one), with collective costs of the order
    this 2-core machine measures (about 1 ms per call), saved as valid for this machine."""
    from test_profilestore import PROFILE

    from mcpar.sim.profilestore import PROFILE_ENV, save_profile

    path = tmp_path / "profile.json"
    save_profile(dataclasses.replace(PROFILE, collectives={"ar": [1e-3, 1.6e-9],
                                                           "p2p": [1e-3, 6.4e-10]}), path)
    return {PROFILE_ENV: str(path)}


@pytest.mark.slow
def test_plan_puts_the_long_sequence_preset_on_the_context_axis_and_it_trains(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """One 2,048-token sequence per step on two workers: no data axis to fill, a pipeline with
    one micro-batch has nothing to overlap, tensor parallelism all-reduces the residual stream
    twice per layer and pass, Ulysses moves half those bytes (and the ring's eager blocks are
    priced slower than the local kernel): the planner picks context 2 (Ulysses), `mcpar plan
    --world 2` prints it, and the chosen settings train."""
    env = _test_profile(tmp_path)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    auto = choose_layout(load_config(PRESET), 2)
    chosen = auto.chosen.settings
    assert (chosen["parallelism.context"], chosen["parallelism.context_mode"]) == (2, "ulysses")
    # Tensor 2 (the same halving of the work, twice the bytes on the wire) is the runner-up.
    assert any(c.settings["parallelism.tensor"] == 2 for c in auto.runners_up)
    shown = run_mcpar("plan", str(PRESET), "--world", "2", env=env, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert "context 2 (ulysses)" in shown.stdout.splitlines()[0] + shown.stderr

    run_dir = tmp_path / "run"
    sets = [arg for key, value in chosen.items() for arg in ("--set", f"{key}={value}")]
    out = run_mcpar("train", str(PRESET), "--nproc", "2", "--run-dir", str(run_dir), *sets,
                    "--set", "training.steps=2", "--set", "training.progress=false",
                    env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    resolved = json.loads((run_dir / "plan.json").read_text())
    assert resolved["context_mode"] == "ulysses"
    assert "context 2" in out.stdout + out.stderr
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and r["comm_bytes"] > 0 for r in rows)
