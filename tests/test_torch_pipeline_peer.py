"""bench/torch_pipeline_peer.py, the torch peer of the pipeline bubble bench: on two real gloo
worker processes every schedule runs, its bubble is a fraction, each rank's busy time is the sleep
total the fixed costs add up to, and torch's split backward runs exactly one sleeping path in
each of its two parts (the design the zero-bubble figures rest on)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
PP, MICRO, FWD_MS = 2, 4, 5.0


@pytest.fixture(scope="module")
def result() -> dict:
    sys.path.insert(0, str(BENCH))  # the bench imports its sibling bench_workers
    try:
        spec = importlib.util.spec_from_file_location("torch_pipeline_peer",
                                                      BENCH / "torch_pipeline_peer.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # dataclasses look their module up
        spec.loader.exec_module(module)
        return module.run_torch_schedules(PP, MICRO, FWD_MS, repeats=1, warmup=1,
                                          schedules=list(module.SCHEDULES))
    finally:
        sys.path.remove(str(BENCH))
        sys.modules.pop("torch_pipeline_peer", None)


def test_every_schedule_runs_with_a_bubble_fraction_and_the_expected_busy_time(
        result: dict) -> None:
    expected_busy = 3 * FWD_MS / 1000 * MICRO  # F + B + W per micro-batch on every rank
    assert set(result["schedules"]) == {
        "Schedule1F1B", "ScheduleInterleaved1F1B", "ScheduleInterleavedZeroBubble",
        "ScheduleZBVZeroBubble", "ScheduleDualPipeV"}
    for name, figures in result["schedules"].items():
        assert "error" not in figures, (name, figures.get("error"))
        assert 0 <= figures["bubble"] < 1, name
        assert figures["step_time_s_median"] > 0, name
        assert len(figures["busy_s_per_rank"]) == PP
        for busy in figures["busy_s_per_rank"]:
            # a sleep never ends early; oversleeping by a fraction of a ms per call is normal
            assert expected_busy <= busy <= 1.3 * expected_busy, (name, busy)
        assert figures["step_time_s_median"] >= max(figures["busy_s_per_rank"]), name


def test_split_backward_runs_one_path_per_part(result: dict) -> None:
    # Rank 0 holds stage 0 and, under the looped interleaved zero-bubble schedule, stage 2.
    actions = result["schedules"]["ScheduleInterleavedZeroBubble"]["rank0_action_ms"]
    middle = actions["stage2"]
    assert middle["backward_input"]["input_grad_sleep_ms"] > 0
    assert middle["backward_input"]["weight_grad_sleep_ms"] == 0
    assert middle["backward_weight"]["weight_grad_sleep_ms"] > 0
    assert middle["backward_weight"]["input_grad_sleep_ms"] == 0
    # 1F1B's full backward runs both sleeps in one call.
    full = result["schedules"]["Schedule1F1B"]["rank0_action_ms"]["stage0"]["backward_full"]
    assert full["input_grad_sleep_ms"] > 0 and full["weight_grad_sleep_ms"] > 0
