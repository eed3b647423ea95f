"""CPU workers that share cores: compute slows by the crowding and the measured time-slicing
penalty, a pipeline's bubble lending its cores to the other ranks; the collectives do not slow,
since every group of an SPMD program reaches them together; each posted point-to-point exchange
of the ring costs the measured crowded handoff."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
from test_sim_local import PROFILE, SMALL

from mcpar.config import load_config
from mcpar.sim.costmodel import oversubscription, simulate
from mcpar.sim.hardware import CROWDED_EXCHANGE_NOTE, TIME_SLICING_NOTE, Cluster
from mcpar.sim.localprofile import local_cluster
from mcpar.sim.profilestore import field_problems
from mcpar.sim.shared_cores_bench import crowded_exchange_cost, time_slicing_penalty

# Compute priced at per-thread rates (element-wise work is not: its bandwidth is the cores'
# total over the cores, which a cluster of more cores divides further).
COMPUTE = ("gemm", "attention", "overhead")


def _cluster(penalty: float | None, workers: int, cores: int = 2,
             exchange: float | None = None) -> Cluster:
    notes = dict(PROFILE.notes)
    if penalty is not None:
        notes[TIME_SLICING_NOTE] = penalty
    if exchange is not None:
        notes[CROWDED_EXCHANGE_NOTE] = exchange
    # The same per-thread rates whatever the cores: only the sharing differs.
    return replace(local_cluster(replace(PROFILE, notes=notes)), num_gpus=workers, cores=cores)


def _breakdown(overrides: list[str], cluster: Cluster, workers: int) -> dict[str, float]:
    cfg = load_config(None, SMALL + overrides)
    from mcpar.sim.fromconfig import config_layout, config_model

    return simulate(config_model(cfg), config_layout(cfg, workers), cluster).breakdown


@pytest.mark.parametrize("layout", [["parallelism.tensor=2"], ["parallelism.tensor=4"],
                                    ["controllers.memory.zero_stage=3"], []])
def test_crowded_collectives_cost_what_they_cost_with_a_core_a_worker(layout: list[str]) -> None:
    """4 workers on 2 cores against 4 on 4: every collective's time is the same, compute
    doubles (no penalty measured) or doubles and grows by the penalty (10%)."""
    alone = _breakdown(layout, _cluster(None, 4, cores=4), 4)
    for penalty, factor in ((None, 2.0), (0.1, 2.2)):
        crowded = _breakdown(layout, _cluster(penalty, 4), 4)
        comm = [k for k in alone if k.endswith("_comm")]
        assert comm, alone
        for k in comm:
            assert crowded[k] == pytest.approx(alone[k]), k
        for k in COMPUTE:
            if k in alone:
                assert crowded[k] == pytest.approx(alone[k] * factor), (k, penalty)


def test_the_penalty_grows_from_none_at_a_core_a_worker_to_whole_at_two() -> None:
    """3 workers on 2 cores: crowding 1.5, half the penalty measured at two a core."""
    batch = ["optimization.global_batch_size=24"]
    alone = _breakdown(batch, _cluster(0.2, 3, cores=3), 3)
    three = _breakdown(batch, _cluster(0.2, 3), 3)
    assert oversubscription(_cluster(0.2, 3), 3) == 1.5
    assert three["gemm"] == pytest.approx(alone["gemm"] * 1.5 * 1.1)
    batch = ["optimization.global_batch_size=64"]
    eight = _breakdown(batch, _cluster(0.2, 8), 8)
    alone8 = _breakdown(batch, _cluster(0.2, 8, cores=8), 8)
    assert eight["gemm"] == pytest.approx(alone8["gemm"] * 4 * 1.2)  # capped at the measured


def test_a_pipeline_replayed_on_shared_cores_keeps_its_collectives_and_sums_up() -> None:
    """Pipeline 2 x data 2 on 2 cores: the replay shares the cores among the stages; the p2p
    and data-parallel exchange keep their time; the breakdown still sums to the step."""
    cfg = load_config(None, SMALL + ["parallelism.pipeline=2", "parallelism.data=2",
                                     "optimization.micro_batch_size=4"])
    from mcpar.sim.fromconfig import config_layout, config_model

    m, lay = config_model(cfg), config_layout(cfg, 4)
    crowded = simulate(m, lay, _cluster(0.1, 4))
    alone = simulate(m, lay, _cluster(0.1, 4, cores=4))
    for k in ("p2p_comm", "dp_comm"):
        assert crowded.breakdown[k] == pytest.approx(alone.breakdown[k])
    assert sum(crowded.breakdown.values()) == pytest.approx(crowded.step_s)
    assert crowded.step_s > 1.5 * alone.step_s
    assert 0.0 <= crowded.bubble_s < crowded.pipeline_s


def test_a_profile_without_the_penalty_prices_none() -> None:
    assert _cluster(None, 4).time_slicing_penalty == 0.0
    assert _cluster(0.07, 4).time_slicing_penalty == 0.07


@pytest.mark.parametrize("note", [TIME_SLICING_NOTE, CROWDED_EXCHANGE_NOTE])
@pytest.mark.parametrize("bad", [-0.1, math.nan])
def test_a_sharing_cost_no_measurement_gives_is_named(note: str, bad: float, tmp_path) -> None:
    profile = replace(PROFILE, notes={**PROFILE.notes, note: bad})
    problems = field_problems(profile, tmp_path / "p.json", "measure it again")
    assert any(f"notes.{note}" in p for p in problems), problems


def test_the_time_slicing_penalty_is_measured_as_a_share() -> None:
    """Four one-thread workers against two (on this 2-core machine, two a core): a finite share
    of the time, at least 0 and far below what a second copy of the work would cost."""
    penalty = time_slicing_penalty(2, seconds=0.05, repeats=1)
    assert math.isfinite(penalty) and 0.0 <= penalty < 1.0


@pytest.mark.parametrize(("cp", "data"), [(2, 2), (4, 1)])
def test_each_ring_exchange_pays_the_crowded_handoff(cp: int, data: int) -> None:
    """Context ``cp`` x data ``data`` (mcpar's ring) on 4 workers: with a measured crowded
    exchange of 3 ms, the context traffic grows by 3 ms for each exchange of the step, (cp - 1)
    K/V hops forward and again backward plus cp dK/dV, per layer and micro-batch; at a core a
    worker nothing changes, and neither do the other terms."""
    layout = [f"parallelism.context={cp}", f"parallelism.data={data}",
              "parallelism.context_mode=ring", "model.seq_len=256"]
    plain = _breakdown(layout, _cluster(0.1, 4), 4)
    handoff = _breakdown(layout, _cluster(0.1, 4, exchange=3e-3), 4)
    layers, micro_batches = 4, 32 // (data * 8)  # context shards tokens, not sequences
    exchanges = (cp - 1) + (cp - 1) + cp
    assert handoff["cp_comm"] - plain["cp_comm"] == pytest.approx(
        3e-3 * exchanges * layers * micro_batches)
    assert {k: v for k, v in handoff.items() if k != "cp_comm"} == pytest.approx(
        {k: v for k, v in plain.items() if k != "cp_comm"})
    assert _breakdown(layout, _cluster(0.1, 4, cores=4, exchange=3e-3), 4) == pytest.approx(
        _breakdown(layout, _cluster(0.1, 4, cores=4), 4))


def test_the_crowded_exchange_is_measured_as_a_time() -> None:
    """Pairs of one-thread workers exchanging around bursts of compute, 2 then 4 on this
    2-core machine: a finite time, at least 0 and under a burst's few milliseconds several
    times over."""
    cost = crowded_exchange_cost(2, iters=10, repeats=1)
    assert math.isfinite(cost) and 0.0 <= cost < 0.05


@pytest.mark.parametrize(("schedule", "chunks"), [("1f1b", 1), ("interleaved_1f1b", 2),
                                                   ("zbv", 2), ("zb_h1", 1)])
def test_every_schedule_lends_its_bubble_to_the_other_ranks(schedule: str, chunks: int) -> None:
    """Pipeline 2 x data 2 on 2 cores, two micro-batches: a rank waiting in its bubble frees
    its share of the cores, for schedules of one chunk a rank and of several alike, so the
    crowded pipeline's compute takes less than twice the uncrowded one's (the uniform slowdown,
    which priced the interleaved schedule and ZBV before, doubled it)."""
    cfg = load_config(None, SMALL + ["parallelism.pipeline=2", "parallelism.data=2",
                                     f"parallelism.schedule={schedule}",
                                     f"parallelism.virtual_stages={chunks}",
                                     "optimization.micro_batch_size=8"])
    from mcpar.sim.fromconfig import config_layout, config_model

    m, lay = config_model(cfg), config_layout(cfg, 4)
    crowded = simulate(m, lay, _cluster(0.0, 4))
    alone = simulate(m, lay, _cluster(0.0, 4, cores=4))
    assert alone.bubble_s > 0.05 * alone.pipeline_s
    # Compute alone (the collectives keep their time): the uniform slowdown doubles it.
    slowed = crowded.breakdown["gemm"] / alone.breakdown["gemm"]
    assert 1.2 < slowed < 1.95
    assert sum(crowded.breakdown.values()) == pytest.approx(crowded.step_s)
