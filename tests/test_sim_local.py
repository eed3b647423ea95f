"""The 'local' profile: workers sharing cores, and one real check of a prediction here."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO

from mcpar.config import load_config
from mcpar.registry.schedule import SCHEDULES
from mcpar.registry.schedule_replay import replay
from mcpar.sim.costmodel import simulate
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.hardware import LocalProfile
from mcpar.sim.localprofile import local_cluster, measure

PROFILE = LocalProfile(
    cores=2, flops_per_thread=80e9, attention_flops_per_thread=25e9, mem_bw_per_thread=12e9,
    mem_bw_total=20e9, op_overhead_s=8e-5, layer_overhead_s=7e-4,
    collectives={"ar": [2.5e-3, 1e-9], "ag": [2e-3, 8e-10], "rs": [3e-3, 1e-9],
                 "p2p": [1.5e-3, 1e-10]},
    notes={"flops_all_cores": 140e9},
)
SMALL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4",
         "model.seq_len=128", "optimization.micro_batch_size=8",
         "optimization.global_batch_size=32"]


def predict(overrides: list[str], workers: int) -> float:
    cfg = load_config(None, SMALL + overrides)
    cluster = replace(local_cluster(PROFILE), num_gpus=workers)
    return simulate(config_model(cfg), config_layout(cfg, workers), cluster).step_s


def test_1f1b_order_and_ideal_pipeline_time() -> None:
    one_f_one_b = SCHEDULES.get("1f1b")
    assert [(a.kind, a.micro) for a in one_f_one_b.actions(0, 4, 4, 1)[:4]] == [
        ("F", 0), ("F", 1), ("F", 2), ("F", 3)]
    assert [(a.kind, a.micro) for a in one_f_one_b.actions(3, 4, 4, 1)[:2]] == [
        ("F", 0), ("B", 0)]
    # Enough cores: (m + p - 1) x (forward + backward), as the closed form says.
    for name in ("1f1b", "gpipe"):
        assert replay(SCHEDULES.get(name), [3.0] * 4, 4, 1, 1 / 3, 100, 1) == pytest.approx(21)
        assert SCHEDULES.get(name).span(4, 3.0, 12.0, [3.0] * 4, 1, 1 / 3) == pytest.approx(21)


def test_shared_cores_sit_between_the_two_naive_bounds() -> None:
    # 4 ranks on 2 cores: at least total work / cores (24), at most everything at half speed.
    shared = replay(SCHEDULES.get("1f1b"), [3.0] * 4, 4, 1, 1 / 3, 2, 1)
    assert 24 < shared < 42


def test_oversubscribed_workers_are_slower_per_worker() -> None:
    # Same global batch: 2 workers on 2 cores share the batch; 4 on 2 cores cannot go faster.
    two = predict([], 2)
    four = predict([], 4)
    assert four > 0.9 * two
    # The local profile's threads run at the all-core rate over the cores.
    assert local_cluster(PROFILE).accel.peak_flops["fp32"] == pytest.approx(70e9)


def test_gloo_reduce_scatter_pricing_makes_sequence_parallelism_dearer_here() -> None:
    plain = predict(["parallelism.tensor=2"], 2)
    seq = predict(["parallelism.tensor=2", "parallelism.sequence_parallel=true"], 2)
    assert seq > plain


def predicted_and_measured(run_dir: Path) -> tuple[float, float]:
    """The step the local profile predicts for SMALL, and the median step of a real run."""
    profile = measure()
    cfg = load_config(None, SMALL)
    cluster = replace(local_cluster(profile), num_gpus=1)
    predicted = simulate(config_model(cfg), config_layout(cfg, 1), cluster).step_s
    cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", "1", "--steps", "8",
           "--run-dir", str(run_dir)]
    for item in SMALL + ["training.eval_interval=0", "training.eval_batches=1",
                         "training.progress=false"]:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    times = [json.loads(line)["step_time_s"]
             for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return predicted, statistics.median(times[3:])


@pytest.mark.slow
@pytest.mark.skipif("PYTEST_XDIST_WORKER" in os.environ,
                    reason="measures this machine's speed: needs its cores to itself, not shared "
                           "with another test process (run this file alone)")
def test_local_profile_predicts_a_real_run(tmp_path: Path) -> None:
    # A loose bound: other jobs may share this machine's cores (the bench,
    # bench/local_sim_check.py, waits for an idle machine and holds the 25% target). The profile
    # and the run are measured at different moments, so a burst of other work can land on one
    # of them only: a second attempt, measured afresh, must then agree. Under the suite's two
    # test processes the other one's jobs kept the run 2.3x slower than predicted in both
    # attempts: there it is skipped.
    attempts = []
    for attempt in range(2):
        predicted, measured = predicted_and_measured(tmp_path / f"run{attempt}")
        attempts.append((predicted, measured))
        if 0.5 < predicted / measured < 2.0:
            break
    assert 0.5 < predicted / measured < 2.0, attempts


def test_a_measured_gather_overlap_hides_zero3s_prefetched_gathers_only() -> None:
    """The profile's share of a prefetched all-gather that hides behind compute prices ZeRO-3's
    gathers; its reductions, and every exchange of a layout without ZeRO-3, stay unhidden."""
    def step(overrides: list[str], hidden: float | None) -> tuple[float, dict[str, float]]:
        notes = {**PROFILE.notes, **({} if hidden is None else {"gather_overlap": hidden})}
        cluster = replace(local_cluster(replace(PROFILE, notes=notes)), num_gpus=4)
        cfg = load_config(None, SMALL + overrides)
        pred = simulate(config_model(cfg), config_layout(cfg, 4), cluster)
        return pred.step_s, pred.breakdown

    zero3 = ["controllers.memory.zero_stage=3"]
    assert local_cluster(PROFILE).gather_overlap is None  # measured before the note existed
    unhidden, _ = step(zero3, None)
    assert step(zero3, 0.0)[0] == pytest.approx(unhidden)
    half, full = step(zero3, 0.5)[1]["zero_comm"], step(zero3, 1.0)[1]["zero_comm"]
    assert full < half < step(zero3, 0.0)[1]["zero_comm"]
    # Fully hidden gathers leave the reduce-scatters (and the last gather, which nothing hides).
    assert full > 0.2 * step(zero3, 0.0)[1]["zero_comm"]
    assert step([], 1.0)[0] == pytest.approx(step([], 0.0)[0])


def test_the_gather_overlap_is_measured_as_a_share() -> None:
    from mcpar.sim.microbench import collective_costs

    lines, hidden = collective_costs(sizes=(16384, 262144))
    assert set(lines) == {"ar", "ag", "rs", "p2p"} and hidden is not None and 0.0 <= hidden <= 1.0


def test_the_attention_rate_follows_the_measured_head_dimension() -> None:
    """A CPU's attention kernel runs small heads well below its rate at head dimension 64; the
    profile times it by head dimension and the model's heads are priced at theirs."""
    from mcpar.sim.compute import head_dim_factor
    from mcpar.sim.localprofile import attention_note

    ref = PROFILE.attention_flops_per_thread
    notes = {**PROFILE.notes, attention_note(16): 0.6 * ref, attention_note(64): ref,
             attention_note(128): 1.2 * ref}
    measured = local_cluster(replace(PROFILE, notes=notes))
    assert measured.attention_head_dims == {16: 0.6, 64: 1.0, 128: 1.2}
    assert head_dim_factor(measured, 32) == pytest.approx(0.8)  # halfway in log2
    assert head_dim_factor(measured, 8) == 0.6 and head_dim_factor(measured, 256) == 1.2
    assert head_dim_factor(local_cluster(PROFILE), 16) == 1.0  # not measured: one rate

    def attention_s(cluster: object, heads: int) -> float:
        cfg = load_config(None, SMALL + [f"model.num_heads={heads}"])
        pred = simulate(config_model(cfg), config_layout(cfg, 1),
                        replace(cluster, num_gpus=1))  # type: ignore[type-var]
        return pred.breakdown["attention"]

    # 16 heads of 16 on hidden 256: the same FLOPs as 4 heads of 64, at 0.6 of the rate.
    assert attention_s(measured, 16) == pytest.approx(attention_s(measured, 4) / 0.6)
    assert attention_s(local_cluster(PROFILE), 16) == pytest.approx(
        attention_s(local_cluster(PROFILE), 4))


def test_the_profile_times_attention_at_each_head_dimension(monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    from mcpar.sim import localprofile as lp

    timed: list[tuple[int, int]] = []
    monkeypatch.setattr(lp, "_attention_rate",
                        lambda heads, dh: timed.append((heads, dh)) or 1e9 * dh)
    rates = lp._attention_rates()
    assert timed == [(16, 16), (8, 32), (4, 64), (2, 128)]  # hidden 256 in each
    assert rates[lp.REFERENCE_HEAD_DIM] == 64e9


def test_the_profile_prices_the_reduce_scatter_the_runtime_runs(monkeypatch) -> None:
    """On gloo the Communicator reduce-scatters by an all-to-all and a local sum; the profile's
    reduce-scatter line must time that, not gloo's own (an all-reduce's bytes, 2-4x slower),
    or every ZeRO and sequence-parallel layout is priced for traffic the runtime does not run."""
    import torch
    import torch.distributed as dist

    from mcpar import all_to_all_reduce_scatter as by_all_to_all
    from mcpar.sim.microbench import profiled_reduce_scatter

    calls: list[str] = []
    monkeypatch.setattr(by_all_to_all, "all_to_all_reduce_scatter",
                        lambda out, full, n: (calls.append(f"all-to-all {n}"), lambda: None))
    monkeypatch.setattr(dist, "reduce_scatter_single",
                        lambda out, full: calls.append("backend's own"))
    out, full = torch.empty(4), torch.ones(8)
    profiled_reduce_scatter(out, full, "gloo")
    profiled_reduce_scatter(out, full, "nccl")
    assert calls == ["all-to-all 2", "backend's own"]
