"""The cost model of ZeRO-3 through the hierarchical parameter store and its codecs: inter-node
bytes by hand, step time and memory moving the way the mechanisms say, and the config mapping."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcpar.config import load_config
from mcpar.sim.collectives import Group
from mcpar.sim.compute import roofline
from mcpar.sim.costmodel import simulate
from mcpar.sim.fromconfig import config_layout, config_model, unpriced_settings
from mcpar.sim.hardware import cluster_preset, load_accelerators
from mcpar.sim.memory import memory_per_gpu, rank_params, root_params
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.workload import MODEL_PRESETS, Layout, layout_problems
from mcpar.sim.zero3 import INT8_BYTES, zero3_traffic

ACC = load_accelerators()
M = MODEL_PRESETS["gpt3-13b"].shape
FAST = cluster_preset("a100x64", ACC)
SLOW = replace(FAST, inter_bw=100e9 / 8 / 8)  # one 100 Gb/s NIC shared by a node's 8 GPUs
# mcpar's own arithmetic (autocast: fp32 weights and gradients on the wire), ZeRO-3, 8 nodes.
Z3 = Layout(tp=2, pp=1, dp=32, global_batch=256, micro_batch=2, zero_stage=3,
            recompute="full", precision="bf16", topology="flat", autocast=True)
STORE = Z3.with_(allocation="topology_aware")


def traffic(lay: Layout, cluster=SLOW):  # noqa: ANN201 (a test helper)
    group = Group(lay.dp, lay.tp)
    rl = roofline(cluster, lay, GPU_EFFICIENCY, 1.0)
    return zero3_traffic(1e9, 4.0, 4.0, group, lay, cluster, 0.8, "flat", 40, rl)


def test_store_keeps_the_backward_gather_inside_the_node() -> None:
    plain, store = traffic(Z3), traffic(STORE)
    # Plain: forward gather, backward gather, reduce-scatter each send (p-1)/p of the block out
    # of every node; the store: the forward gather and the reduce-scatter's inter-node stage.
    p, nodes = 32, 8
    assert plain.inter_node_bytes == pytest.approx(3 * (p - 1) / p * 4e9)
    assert store.inter_node_bytes == pytest.approx(((p - 1) / p + (nodes - 1) / nodes) * 4e9)
    assert 0.6 < store.inter_node_bytes / plain.inter_node_bytes <= 0.7  # about 2/3
    assert store.backward < plain.backward
    assert store.forward == plain.forward  # the forward gather still crosses every node


def test_int8_codecs_cut_the_inter_node_bytes_below_a_third() -> None:
    plain = traffic(Z3)
    both = traffic(STORE.with_(weight_gather="int8", compression="int8"))
    half = traffic(STORE.with_(compression="bf16"))
    assert both.inter_node_bytes / plain.inter_node_bytes < 1 / 3
    assert both.inter_node_bytes == pytest.approx(
        (31 / 32 + 7 / 8) * 1e9 * INT8_BYTES)
    assert half.inter_node_bytes < traffic(STORE).inter_node_bytes
    assert both.encode > traffic(STORE).encode > 0  # codec passes are paid for


def test_store_and_codecs_shorten_the_step_on_a_slow_fabric_only() -> None:
    steps = {name: simulate(M, lay, SLOW).step_s for name, lay in (
        ("plain", Z3), ("gather8", Z3.with_(weight_gather="int8")), ("store", STORE),
        ("store+rs8", STORE.with_(compression="int8")),
        ("all", STORE.with_(compression="int8", weight_gather="int8")))}
    assert steps["gather8"] < steps["plain"]
    assert steps["store"] < steps["plain"]
    assert steps["all"] < steps["store+rs8"] < steps["store"]
    assert steps["all"] < 0.8 * steps["plain"]
    # Inside one node the store has nothing to keep local: the same step as plain ZeRO-3.
    one_node = cluster_preset("a100x8", ACC)
    lay = Z3.with_(dp=4, global_batch=32)
    assert simulate(M, lay.with_(allocation="topology_aware"), one_node).step_s == \
        pytest.approx(simulate(M, lay, one_node).step_s)


def test_store_memory_is_the_secondary_copy_and_zero3_holds_its_root_params() -> None:
    dense, expert = rank_params(M, Z3)[0]
    per_node = 8 // Z3.tp  # data ranks per node
    plain = memory_per_gpu(M, Z3, 0.0, 8)
    store = memory_per_gpu(M, STORE, 0.0, 8)
    assert expert == 0
    # The copy is held between steps, with the shards: a parameter row, as held.py counts it.
    assert store.weights - plain.weights == pytest.approx(dense * 4 / per_node)
    assert store.other == plain.other
    # Without a node size the copy is priced whole (the most it can cost).
    assert memory_per_gpu(M, STORE, 0.0).weights - plain.weights == pytest.approx(dense * 4)
    # ZeRO-3's working set: two blocks and the root parameters.
    z2 = memory_per_gpu(M, Z3.with_(zero_stage=2), 0.0, 8)
    assert plain.other - z2.other > root_params(M, Z3) * 4 > 0
    ef = memory_per_gpu(M, STORE.with_(compression="int8"), 0.0, 8)
    assert ef.gradients - store.gradients == pytest.approx(4.0 * dense / per_node)


def test_store_settings_outside_zero3_are_refused() -> None:
    def problems(lay: Layout) -> list[str]:
        return layout_problems(M, lay, 64, 8, "layout")

    assert problems(STORE) == [] and problems(STORE.with_(compression="int8")) == []
    assert any("allocation" in p for p in problems(STORE.with_(zero_stage=2)))
    assert any("weight_gather" in p for p in problems(Z3.with_(zero_stage=1,
                                                               weight_gather="int8")))
    assert any("compression" in p for p in problems(Z3.with_(compression="int8")))
    assert any("allocation" in p for p in problems(Z3.with_(allocation="nearby")))


def test_config_store_and_weight_gather_reach_the_layout_and_are_priced() -> None:
    cfg = load_config(None, ["controllers.memory.zero_stage=3",
                             "controllers.memory.allocation=topology_aware",
                             "controllers.communication.weight_gather=int8",
                             "controllers.communication.compression=int8"])
    lay = config_layout(cfg, 16)
    assert (lay.allocation, lay.weight_gather, lay.compression) == (
        "topology_aware", "int8", "int8")
    assert not any("allocation" in note for note in unpriced_settings(cfg))
    cluster = replace(cluster_preset("a100x16", ACC), inter_bw=1e9)
    plain = simulate(config_model(cfg), lay.with_(allocation="default", compression="none",
                                                  weight_gather="none"), cluster)
    assert simulate(config_model(cfg), lay, cluster).dp_comm_s < plain.dp_comm_s


def test_grouped_gathers_are_priced_for_small_layers_only() -> None:
    """``controllers.memory.gather_mb``: a GPT of 16 small blocks (0.2 MB) gathered in groups
    of 1 MiB pays fewer collectives' latency (less data-parallel time) and holds more
    gathered blocks (6 + 1 instead of 2); GPT-3 13B's layers (hundreds of MB) are gathered
    one at a time whatever it says."""
    small = [f"model.{k}" for k in ("num_layers=16", "hidden_size=64", "num_heads=4")]
    cfgs = {mb: load_config(None, [*small, "controllers.memory.zero_stage=3",
                                   f"controllers.memory.gather_mb={mb}"]) for mb in (0, 1)}
    runs = {mb: simulate(config_model(cfg), config_layout(cfg, 8), FAST, validate=False)
            for mb, cfg in cfgs.items()}
    assert runs[1].dp_comm_s < 0.8 * runs[0].dp_comm_s
    root = 4.0 * root_params(config_model(cfgs[0]), config_layout(cfgs[0], 8))  # fp32
    layer = (runs[0].memory.gathered - root) / 2
    assert runs[1].memory.gathered - runs[0].memory.gathered == pytest.approx(5 * layer)
    big = {mb: simulate(M, Z3.with_(gather_mb=mb), FAST) for mb in (0, 1)}
    assert big[1] == big[0]
