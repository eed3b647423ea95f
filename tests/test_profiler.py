"""The profiler's definitions on known inputs: nccl-tests' algbw/busbw, the step-time split,
the pipeline bubble of an ideal 1F1B timeline, MFU, and the metrics sinks (TensorBoard scalars
of every numeric field, W&B's clear refusal when it is not installed)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mcpar.comm.communicator import broadcast_bytes, ring_all_gather_bytes, ring_all_reduce_bytes
from mcpar.config import WandbConfig
from mcpar.errors import UserError
from mcpar.metrics import RunLogger, flatten_scalars
from mcpar.profiler.bandwidth import bandwidth, from_sent
from mcpar.profiler.mfu import Peak, device_peak, mfu
from mcpar.profiler.timeline import CATEGORIES, pipeline_bubble, split_step, theoretical_bubble


@pytest.mark.parametrize(("op", "n", "factor"), [
    ("all_reduce", 4, 1.5), ("all_reduce", 2, 1.0), ("all_gather", 8, 0.875),
    ("reduce_scatter", 4, 0.75), ("all_to_all", 2, 0.5), ("broadcast", 8, 1.0),
    ("send", 2, 1.0)])
def test_algbw_busbw_follow_nccl_tests(op: str, n: int, factor: float) -> None:
    # 1 GB in 0.5 s: algbw = S / t = 2 GB/s, busbw = algbw x the collective's factor.
    bw = bandwidth(op, 1e9, 0.5, n)
    assert bw.algbw == pytest.approx(2e9)
    assert bw.busbw == pytest.approx(2e9 * factor)


def test_bandwidth_from_the_communicators_books() -> None:
    # The Communicator counts the bytes each rank sends under the ring; S is recovered from them.
    size, n = 4 << 20, 4
    cases = [("all_reduce", ring_all_reduce_bytes(size, n), size),
             ("all_gather", ring_all_gather_bytes(size // n, n), size),
             ("broadcast", broadcast_bytes(size, n), size)]
    for op, sent, expected in cases:
        bw = from_sent(op, sent, 2.0, n)
        assert bw.size_bytes == pytest.approx(expected), op
        assert bw.algbw == pytest.approx(expected / 2.0), op
    # A ring all-reduce's bus bandwidth is what each rank pushes through its link.
    assert from_sent("all_reduce", 3e6, 1.0, 2).busbw == pytest.approx(3e6)


def test_step_split_adds_up_and_counts_waits_inside_tasks_as_communication() -> None:
    tasks = [{"name": "forward", "start": 0.0, "end": 0.3},
             {"name": "recv_grad", "start": 0.3, "end": 0.4},
             {"name": "backward", "start": 0.4, "end": 1.0},
             {"name": "wait_grads", "start": 1.0, "end": 1.5},
             {"name": "optimizer_step", "start": 1.5, "end": 1.8}]
    waits = [(0.1, 0.15), (1.6, 1.7)]  # a tensor-parallel collective; the gradient norm's
    split = split_step(tasks, waits, data_s=0.05, step_s=2.0)
    assert set(split) == set(CATEGORIES)
    assert split["compute"] == pytest.approx(0.85)
    assert split["exposed_comm"] == pytest.approx(0.5 + 0.05 + 0.1)
    assert split["bubble"] == pytest.approx(0.1)
    assert split["optimizer"] == pytest.approx(0.2)
    assert split["data"] == pytest.approx(0.05)
    assert sum(split.values()) == pytest.approx(2.0)


def _ideal_1f1b(p: int, m: int, f: float, b: float) -> list[list[dict]]:
    """Each rank's forward/backward intervals of an ideal 1F1B step (equal stages), as the
    ComputeController logs them, with the waits as receive tasks."""
    fwd_end: dict[tuple[int, int], float] = {}
    bwd_end: dict[tuple[int, int], float] = {}
    ranks: list[list[dict]] = [[] for _ in range(p)]
    # Event-driven: each rank runs its 1F1B order; a task starts when its input is ready.
    order = {s: [("f", i) for i in range(min(p - s, m))] for s in range(p)}
    for s in range(p):
        fw, bw = min(p - s, m), 0
        while bw < m:
            order[s].append(("b", bw))
            bw += 1
            if fw < m:
                order[s].append(("f", fw))
                fw += 1
    clock = dict.fromkeys(range(p), 0.0)
    pending = {s: list(order[s]) for s in range(p)}
    while any(pending.values()):
        for s in range(p):
            while pending[s]:
                kind, i = pending[s][0]
                dep = (fwd_end.get((s - 1, i)) if s > 0 else 0.0) if kind == "f" else \
                    (bwd_end.get((s + 1, i)) if s < p - 1 else fwd_end.get((s, i)))
                if dep is None:
                    break
                start = max(clock[s], dep)
                if start > clock[s]:
                    ranks[s].append({"name": "recv_grad" if kind == "b" else "recv_activation",
                                     "start": clock[s], "end": start})
                end = start + (f if kind == "f" else b)
                ranks[s].append({"name": "forward" if kind == "f" else "backward",
                                 "start": start, "end": end})
                (fwd_end if kind == "f" else bwd_end)[(s, i)] = end
                clock[s] = end
                pending[s].pop(0)
    return ranks


def test_pipeline_bubble_of_an_ideal_schedule_is_the_theory() -> None:
    for p, m in ((4, 8), (2, 4), (4, 4)):
        measured = pipeline_bubble(_ideal_1f1b(p, m, 0.01, 0.02))
        assert measured == pytest.approx(theoretical_bubble(p, m), abs=1e-9), (p, m)
    assert pipeline_bubble([[{"name": "forward", "start": 0.0, "end": 1.0}]]) == 0.0


def test_mfu_against_a_measured_cpu_peak() -> None:
    import torch

    peak = device_peak(torch.device("cpu"), "float32", devices=2)
    assert "measured" in peak.source and peak.flops_per_device > 1e8
    assert peak.total == pytest.approx(2 * peak.flops_per_device)
    assert mfu(1e6, 1e3, Peak(1e10, 2, "x")) == pytest.approx(0.05)


def test_every_numeric_field_is_a_scalar() -> None:
    record = {"step": 3, "loss": 2.5, "mfu": 0.1, "skipped": False,
              "comm_bytes_by_axis": {"dp": 10.0, "world": 2.0}, "note": "text",
              "moe": {"imbalance": 1.2, "layers": [{"max": 5, "tokens_per_expert": [1, 2]}]}}
    flat = flatten_scalars(record)
    assert flat["comm_bytes_by_axis/dp"] == 10.0 and flat["mfu"] == 0.1
    assert flat["moe/layers/0/tokens_per_expert/1"] == 2.0 and flat["skipped"] == 0.0
    assert "step" not in flat and "note" not in flat
    # TensorBoard's grouped tags of these: tests/test_tensorboard.py.


def test_wandb_asked_for_but_not_installed_names_the_key(tmp_path, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(UserError) as err:
        RunLogger(tmp_path, enabled=True, tensorboard=False, wandb=WandbConfig(enabled=True))
    assert "training.wandb.enabled" in str(err.value.problems)
    # Off (the default) it is never imported.
    RunLogger(tmp_path, enabled=True, tensorboard=False, wandb=WandbConfig()).close()


def test_datasheet_peak_of_a_known_gpu() -> None:
    from mcpar.profiler.mfu import datasheet_peak

    assert datasheet_peak("NVIDIA H200", "bfloat16") == (989e12, "H200-141GB datasheet bf16")
    assert datasheet_peak("NVIDIA A100-SXM4-80GB", "float32")[0] == 156e12  # TF32
    assert datasheet_peak("Some GPU", "bfloat16") is None


def test_profile_refuses_zero_steps(capsys) -> None:
    from conftest import run_cli_in_process

    proc = run_cli_in_process(capsys, "profile", "--steps", "0")
    assert proc.returncode == 2 and "--steps" in proc.stderr and "Traceback" not in proc.stderr


def test_wandb_offline_writes_a_local_run(tmp_path) -> None:
    pytest.importorskip("wandb", reason="the optional 'wandb' extra is not installed")
    logger = RunLogger(tmp_path, enabled=True, tensorboard=False, wandb=WandbConfig(enabled=True))
    logger.log({"step": 1, "loss": 3.0, "comm_bytes_by_axis": {"dp": 8.0}})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1 and runs[0].stat().st_size > 0


def test_bandwidths_and_sizes_print_with_a_unit_that_suits_them() -> None:
    from mcpar.profiler.bandwidth import format_bytes, format_rate

    # A tiny collective read "0.0000 GB/s" with the fixed unit; each figure gets its own now.
    assert format_rate(2.5e9) == "2.5 GB/s" and format_rate(123.4e6) == "123 MB/s"
    assert format_rate(4.2e4) == "42 KB/s" and format_rate(1234) == "1.23 KB/s"
    assert format_rate(12.0) == "12 B/s" and format_rate(0.0) == "0 B/s"
    assert format_rate(999.7e3) == "1 MB/s"  # rounds up into the next unit, not "1e+03 KB/s"
    assert format_bytes(8461) == "8.46 KB" and format_bytes(2.6e7) == "26 MB"


def _split_report(step_s: float) -> dict:
    shares = {"compute": 0.6, "exposed_comm": 0.25, "bubble": 0.0, "optimizer": 0.1,
              "data": 0.05, "idle": 0.0}
    return {"split": [{"rank": r, "step_s": step_s, **{c: step_s * shares[c] for c in CATEGORIES}}
                      for r in range(2)],
            "collectives": [{"op": "all_reduce", "axis": "dp", "time_s": 0.01}]}


def test_the_step_split_legend_covers_no_bar() -> None:
    from mcpar.profiler import plots

    fig = plots.comm_breakdown_figure(_split_report(0.05))
    fig.canvas.draw()
    ax = fig.axes[0]
    renderer = fig.canvas.get_renderer()
    legend = ax.get_legend().get_window_extent(renderer)
    bars = [p.get_window_extent(renderer) for p in ax.patches if p.get_height() > 0]
    assert len(bars) == 2 * 4  # two ranks, four categories of non-zero time
    # Above the axes (the bars reach the top of the plot: any place inside hides one) and
    # under the title.
    assert legend.y0 >= ax.get_window_extent(renderer).y1
    assert not any(legend.overlaps(bar) for bar in bars)
    assert legend.y1 <= ax.title.get_window_extent(renderer).y0 + 1
    plots._plt().close(fig)


def _traced_steps(tmp_path, detail: str) -> tuple[Path, list]:
    import torch

    from mcpar.profiler.trace import WindowTrace

    trace = WindowTrace(torch.device("cpu"), detail)
    layer = torch.nn.Linear(64, 64)
    for step in (1, 2):
        trace.begin_step(step)
        with torch.profiler.record_function("mcpar.forward(chunk 0, micro 0)"):
            loss = layer(torch.randn(8, 64)).square().sum()
        with torch.profiler.record_function("mcpar.backward(chunk 0, micro 0)"):
            loss.backward()
        trace.end_step()
    (path,) = trace.stop(tmp_path / detail, rank=0)
    return path, trace.memory


def test_trace_detail_steps_keeps_the_ranges_in_a_far_smaller_file(tmp_path) -> None:
    import json

    from mcpar.profiler.trace import KEPT_CATEGORIES

    ops, ops_memory = _traced_steps(tmp_path, "ops")
    steps, steps_memory = _traced_steps(tmp_path, "steps")
    assert steps.stat().st_size * 10 < ops.stat().st_size, (steps.stat(), ops.stat())
    full, small = (json.loads(p.read_text())["traceEvents"] for p in (ops, steps))
    assert any(e.get("cat") == "cpu_op" for e in full)
    assert {e.get("cat") for e in small} <= KEPT_CATEGORIES["steps"] | {None}

    def ranges(events: list) -> list:
        return sorted(e["name"] for e in events if str(e.get("name")).startswith("mcpar."))

    assert ranges(small) == ranges(full) and "mcpar.step#2" in ranges(small)
    # The report's memory over a step reads the allocator's events, which the file drops.
    assert ops_memory and steps_memory


def test_kineto_markers_are_held_back_and_nothing_else(capfd) -> None:
    import os

    from mcpar.profiler.trace import _without_kineto_marks

    with _without_kineto_marks():
        os.write(2, b"USDT:2026-12-03 14:49:52 26726:26726 SyncActivityProfilerHandler.cpp:59]"
                 b" profiler_stop\nERROR: something that matters\n")
    err = capfd.readouterr().err
    assert "profiler_stop" not in err and "ERROR: something that matters" in err


def test_a_bad_trace_detail_is_refused_naming_the_key(capsys) -> None:
    from conftest import run_cli_in_process

    proc = run_cli_in_process(capsys, "check", "configs/seed_mcp.yaml", "--set",
                              "training.profile.trace_detail=everything")
    assert proc.returncode == 2, proc
    assert "training.profile.trace_detail" in proc.stderr + proc.stdout
    assert "Traceback" not in proc.stderr
