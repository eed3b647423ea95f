"""A CPU job over several nodes: the cost model prices what crosses the link between them on
that link and what stays inside a node on the profile's loopback lines; the planner ranks the
layouts over it (the ``cluster`` keys, or the link the workers measure at start)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import TINY, spawn_workers

from mcpar.auto_layout import choose_layout, config_node_link
from mcpar.comm.node_link_probe import fit_round_trips, measure_node_link
from mcpar.commands.train import worker_nodes
from mcpar.config import load_config
from mcpar.launch.env import DistEnv, find_free_port
from mcpar.sim.collectives import (
    Group,
    Link,
    all_reduce,
    all_to_all,
    p2p,
    reduce_scatter,
    ring_all_reduce,
)
from mcpar.sim.hardware import LocalProfile, NodeLink
from mcpar.sim.localprofile import local_cluster
from mcpar.sim.profilestore import PROFILE_ENV

LINK = NodeLink(ranks_per_node=2, latency_s=2e-4, bandwidth=30e6, source="test")
LINES = {"ar": [1e-3, 4e-10], "rs": [8e-4, 3e-10], "ag": [7e-4, 2e-10], "p2p": [1e-4, 1e-10]}


def _profile() -> LocalProfile:
    return LocalProfile(cores=2, flops_per_thread=50e9, attention_flops_per_thread=15e9,
                        mem_bw_per_thread=10e9, mem_bw_total=10e9, op_overhead_s=5e-5,
                        layer_overhead_s=7e-4, collectives=LINES)


def test_what_crosses_nodes_is_priced_on_the_link_and_the_rest_on_the_profile() -> None:
    one_node = local_cluster(_profile(), 4)
    two_nodes = local_cluster(_profile(), 4, nodes=LINK)
    n = 4e6
    alpha, beta = LINES["ar"]
    inside = 1 * alpha + 2 * 1 / 2 * n * beta  # the profile's line for 2 ranks
    # A tensor pair (neighbouring ranks) stays inside a node: the loopback line, as on one node.
    assert all_reduce(n, Group(2, 1), two_nodes, 1.0, "flat") == pytest.approx(inside)
    assert all_reduce(n, Group(2, 1), one_node, 1.0, "flat") == pytest.approx(inside)
    # Four data ranks over two nodes: a ring whose two crossing hops run on the node's link.
    ring = ring_all_reduce(n, 4, Link(LINK.latency_s, LINK.bandwidth))
    assert all_reduce(n, Group(4, 1), two_nodes, 1.0, "flat") == pytest.approx(ring)
    assert all_reduce(n, Group(4, 1), one_node, 1.0, "flat") < ring / 10
    # Pipeline stages two ranks apart, one per node: both of a node's ranks send at once and
    # share its link.
    assert p2p(n, Group(2, 2), two_nodes, 1.0) == pytest.approx(
        LINK.latency_s + n / (LINK.bandwidth / 2))
    # gloo's reduce-scatter is the runtime's all-to-all: each rank sends the half of the buffer
    # owned by the other node's ranks, on its half of the link.
    rs = reduce_scatter(n, Group(4, 1), two_nodes, 1.0, "flat")
    assert rs == pytest.approx(all_to_all(n, Group(4, 1), two_nodes, 1.0))
    assert rs == pytest.approx(LINK.latency_s * 2 + two_nodes.alpha_intra
                               + (n / 2) / (LINK.bandwidth / 2), rel=1e-6)


@pytest.fixture
def declared_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No saved profile: the planner ranks on the declared CPU figures, the same everywhere."""
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "absent.json"))


AUTO = [*TINY, "parallelism.auto=true", "optimization.global_batch_size=8",
        "controllers.communication.compression=none"]


@pytest.mark.usefixtures("declared_profile")
def test_over_a_slow_link_the_planner_keeps_the_gradients_off_it() -> None:
    """Over a slow link between two nodes of two, the planner's pick keeps its gradient group
    (data x context x tensor ranks, the innermost axes) inside a node, so that only a
    pipeline's activations cross; the ranking says which link it priced."""
    cfg = load_config(None, AUTO)
    slow = NodeLink(2, 1e-4, 1e6, "test")
    spread = choose_layout(cfg, 4, slow)
    s = spread.chosen.settings
    assert s["parallelism.data"] * s["parallelism.context"] * s["parallelism.tensor"] <= 2
    assert "nodes of 2 rank(s) joined by a 8 Mbit/s link" in spread.ranked_on
    assert "joined by" not in choose_layout(cfg, 4).ranked_on
    # Every gradient over the link (data 4) is priced several times slower than the pick.
    forced = choose_layout(load_config(None, [*AUTO, "parallelism.data=4"]), 4, slow)
    assert forced.chosen.step_s > 2 * spread.chosen.step_s
    # On one node the same layout costs a fraction of that: the difference is the link.
    assert choose_layout(load_config(None, [*AUTO, "parallelism.data=4"]), 4).chosen.step_s \
        < forced.chosen.step_s / 4


@pytest.mark.usefixtures("declared_profile")
def test_over_a_slow_link_a_compressed_exchange_brings_data_parallelism_back() -> None:
    """Pass one prices every core under each codec: the data-parallel core the link puts last
    without compression is first with it, and is refined (not lost before pass two)."""
    cfg = load_config(None, [*TINY, "parallelism.auto=true", "optimization.global_batch_size=8",
                             "controllers.memory.zero_stage=0", "training.steps=100",
                             "optimization.freeze_step=5"])
    auto = choose_layout(cfg, 4, NodeLink(2, 1e-4, 1e6, "test"))
    assert auto.chosen.settings["controllers.communication.compression"] in ("1bit",
                                                                              "powersgd")


def test_the_cluster_keys_describe_the_nodes() -> None:
    keys = ["cluster.ranks_per_node=2", "cluster.inter_node_bandwidth_gbps=0.5",
            "cluster.inter_node_latency_us=50", "cluster.intra_node_bandwidth_gbps=100",
            "cluster.intra_node_latency_us=5"]
    link = config_node_link(load_config(None, [*TINY, *keys]), 4)
    assert link is not None and link.ranks_per_node == 2
    assert (link.latency_s, link.bandwidth) == pytest.approx((50e-6, 0.5e9 / 8))
    # One node holds the whole world, or no bandwidth is given: nothing to price.
    assert config_node_link(load_config(None, [*TINY, *keys]), 2) is None
    assert config_node_link(load_config(None, [*TINY, "cluster.ranks_per_node=2"]), 4) is None


def test_round_trips_give_the_latency_and_the_rate() -> None:
    small, large = 1 << 12, 1 << 22
    latency, bandwidth = 3e-4, 37.5e6
    fitted = fit_round_trips(2 * latency + small / bandwidth, 2 * latency + large / bandwidth,
                             small, large)
    assert fitted == pytest.approx((latency, bandwidth))


def _probe(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=4)
    try:
        link = measure_node_link(2)
        Path(out, f"{rank}.txt").write_text(f"{link.latency_s!r} {link.bandwidth!r}")
    finally:
        dist.destroy_process_group()


def test_every_worker_gets_the_link_rank_0_measured(tmp_path: Path) -> None:
    """Two 'nodes' of two on loopback: the figures are finite, positive and the same on every
    rank, so every worker prices the same cluster."""
    spawn_workers(_probe, args=(find_free_port(), str(tmp_path)), nprocs=4)
    figures = {Path(tmp_path, f"{r}.txt").read_text() for r in range(4)}
    assert len(figures) == 1
    latency, bandwidth = map(float, figures.pop().split())
    assert latency >= 0 and math.isfinite(latency) and bandwidth > 1e6


def test_a_worker_measures_only_what_the_planner_needs() -> None:
    """No probe (None, no process group) for a single node, a plan not chosen by the planner,
    or nodes the cluster keys already describe."""
    one_node = DistEnv(0, 4, 0, 4, "127.0.0.1", 1, "torchrun")
    two_nodes = DistEnv(0, 4, 0, 2, "127.0.0.1", 1, "torchrun")
    auto = load_config(None, [*TINY, "parallelism.auto=true", "training.device=cpu"])
    assert worker_nodes(auto, one_node) is None
    assert worker_nodes(load_config(None, [*TINY, "training.device=cpu"]), two_nodes) is None
    keyed = load_config(None, [*TINY, "parallelism.auto=true", "training.device=cpu",
                               "cluster.ranks_per_node=2",
                               "cluster.inter_node_bandwidth_gbps=1",
                               "cluster.inter_node_latency_us=50",
                               "cluster.intra_node_bandwidth_gbps=100",
                               "cluster.intra_node_latency_us=5"])
    assert worker_nodes(keyed, two_nodes) is None
    assert not dist.is_initialized()


def test_a_message_on_the_wire_delays_only_the_rank_that_waits_for_it() -> None:
    """1F1B over two stages, each micro-batch's work 1 s per rank: a message's 0.1 s on the
    wire is paid where a rank waits for it (the first forward's activation, the last backward's
    gradient, ...), not by every send as rank work; shared cores or not, the replay agrees with
    the critical path when the cores are enough."""
    from mcpar.registry.schedule import SCHEDULES
    from mcpar.registry.schedule_replay import replay

    entry, work, m = SCHEDULES.get("1f1b"), [1.0, 1.0], 8
    alone = replay(entry, work, m, 1, 0.5)
    wired = replay(entry, work, m, 1, 0.5, latency=0.1)
    serial = 2 * m * 0.1  # every send and receive paid as work
    assert alone + 2 * 0.1 <= wired + 1e-9
    assert wired - alone < serial / 2
    assert replay(entry, work, m, 1, 0.5, cores=8, latency=0.1) == pytest.approx(wired)
    # Two workers on one core: the wait frees the core, so the wire costs no more than alone.
    shared = replay(entry, work, m, 1, 0.5, cores=1, latency=0.1)
    assert shared - replay(entry, work, m, 1, 0.5, cores=1) <= wired - alone + 1e-9


def test_a_pipeline_over_nodes_pays_the_wire_it_cannot_hide() -> None:
    """pp2 x dp2 with a stage per node: the cost model's exposed pipeline traffic is less than
    every message serialized, and more than none."""
    from dataclasses import replace as dc_replace

    from mcpar.sim.costmodel import simulate
    from mcpar.sim.fromconfig import config_layout, config_model

    cfg = load_config(None, [*TINY, "parallelism.pipeline=2", "parallelism.data=2",
                             "optimization.micro_batch_size=1",
                             "optimization.gradient_accumulation=4"])
    lay = dc_replace(config_layout(cfg, 4), precision="fp32")
    model = config_model(cfg)
    profile = _profile()
    slow = NodeLink(2, 1e-4, 2e5, "test")
    host = simulate(model, lay, local_cluster(profile, 4))
    spread = simulate(model, lay, local_cluster(profile, 4, nodes=slow))
    msg = 1 * 32 * 32 * 4  # a micro-batch's activations: tokens x hidden x fp32
    per_message = slow.latency_s + msg / (slow.bandwidth / 2)
    serialized = 2 * lay.num_microbatches * per_message
    extra = spread.step_s - host.step_s
    assert per_message < extra < serialized


def test_the_profile_reports_prediction_prices_the_nodes_the_planner_priced(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The report's plan-vs-measured row re-prices the run over the nodes ``parallelism.auto``
    ranked it on (``AutoLayout.nodes``), and says so; a choice on one node keeps none."""
    from mcpar.auto_layout import resolve_job
    from mcpar.profiler.predict import predicted
    from mcpar.sim.profilestore import save_profile

    path = tmp_path / "profile.json"
    save_profile(_profile(), path)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    cfg = load_config(None, [*TINY, "parallelism.auto=true", "optimization.global_batch_size=8",
                             "parallelism.data=4", "controllers.communication.compression=none"])
    slow = NodeLink(2, 1e-4, 1e6, "test")
    plan = resolve_job(cfg, 4, slow)
    assert plan.auto is not None and plan.auto.nodes == slow
    assert resolve_job(cfg, 4).auto.nodes is None  # type: ignore[union-attr]
    alone, _ = predicted(plan.config, 4, torch.device("cpu"))
    spread, source = predicted(plan.config, 4, torch.device("cpu"), plan.auto.nodes)
    assert alone is not None and spread is not None
    assert spread["step_s"] > 2 * alone["step_s"]  # every gradient crosses the 8 Mbit/s link
    assert "joined by a 8 Mbit/s link" in source
    assert spread["step_s"] == pytest.approx(plan.auto.predicted_step_s, rel=0.05)
