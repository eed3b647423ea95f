"""`simulate` and `plan` on the command line: the CSV round trip with exact columns, config
simulation with presets, and every user error exiting 2 with the row or key named.

The commands run through ``python -m mcpar.sim.cli`` (the same parsers ``mcpar`` mounts)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, expect_exit, run_mcpar
from conftest import read_csv_rows as rows
from conftest import write_csv_rows as write_rows

from mcpar.sim.runs import OPTIONAL_COLUMNS, PREDICTION_COLUMNS, RUN_COLUMNS

# The optional columns the packaged calibration table carries (dp_overlap and grad_reduce,
# which none of its rows needs, are left at their defaults there).
STACK_COLUMNS = tuple(c for c in OPTIONAL_COLUMNS if c not in ("dp_overlap", "grad_reduce"))

RUNS_CSV = REPO / "src" / "mcpar" / "sim" / "data" / "published_runs.csv"


def user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    expect_exit(proc, 2, *needles)


def sim_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcpar.sim.cli", *args], capture_output=True,
                          text=True, timeout=120, cwd=REPO)


def test_runs_round_trip_keeps_rows_and_adds_exact_columns(tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    proc = sim_cli("simulate", "--runs", str(RUNS_CSV), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    header_in, rows_in = rows(RUNS_CSV)
    header_out, rows_out = rows(out)
    assert tuple(header_in) == RUN_COLUMNS + STACK_COLUMNS
    assert tuple(header_out) == RUN_COLUMNS + STACK_COLUMNS + PREDICTION_COLUMNS
    assert len(rows_out) == len(rows_in)
    for before, after in zip(rows_in, rows_out, strict=True):
        assert {k: after[k] for k in RUN_COLUMNS + STACK_COLUMNS} == before
        step = float(after["predicted_step_s"])
        assert abs(step / float(before["measured_step_s"]) - 1) < 0.15
        # Same formula as the row: TFLOP/s scale inversely with the step time.
        ratio = float(after["predicted_tflops_per_gpu"]) / float(before["measured_tflops_per_gpu"])
        assert ratio == pytest.approx(float(before["measured_step_s"]) / step, rel=0.02)
        assert 0 < float(after["predicted_mfu"]) < 1
        assert 0 <= float(after["predicted_comm_fraction"]) < 1
        assert 0 <= float(after["predicted_bubble_fraction"]) < 1
        assert 1 < float(after["predicted_memory_gb_per_gpu"]) < 200


def test_unknown_gpu_names_the_row(tmp_path: Path) -> None:
    header, data = rows(RUNS_CSV)
    data[2]["gpu"] = "V100-32GB"
    bad = tmp_path / "bad.csv"
    write_rows(bad, header, data)
    proc = sim_cli("simulate", "--runs", str(bad), "--out", str(tmp_path / "o.csv"))
    # The bad row is named and left out; the others are predicted (exit 0: some rows were).
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{data[2]['id']}.gpu: unknown GPU 'V100-32GB'" in proc.stderr
    assert "A100-80GB" in proc.stderr
    assert len(rows(tmp_path / "o.csv")[1]) == len(data) - 1


def test_layout_not_multiplying_to_the_gpu_count_names_the_row(tmp_path: Path) -> None:
    header, data = rows(RUNS_CSV)
    data[0]["dp"] = "16"
    bad = tmp_path / "bad.csv"
    write_rows(bad, header, data)
    proc = sim_cli("simulate", "--runs", str(bad), "--out", str(tmp_path / "o.csv"))
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{data[0]['id']}.num_gpus: tp 1 x pp 1 x cp 1 x dp 16 = 16, not 32" in proc.stderr
    assert len(rows(tmp_path / "o.csv")[1]) == len(data) - 1


def test_wrong_columns_are_refused(tmp_path: Path) -> None:
    header, data = rows(RUNS_CSV)
    bad = tmp_path / "bad.csv"
    write_rows(bad, [c for c in header if c != "vp"], [{k: v for k, v in r.items() if k != "vp"}
                                                       for r in data])
    proc = sim_cli("simulate", "--runs", str(bad), "--out", str(tmp_path / "o.csv"))
    user_error(proc, "columns must be exactly", "missing ['vp']")


def test_simulate_a_config_with_presets(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallelism: {tensor: 8, pipeline: 8, virtual_stages: 2, data: 16,"
                   " schedule: interleaved_1f1b}\n"
                   "optimization: {micro_batch_size: 1}\n"
                   "controllers: {memory: {activation_checkpointing: full}}\n")
    proc = sim_cli("simulate", str(cfg), "--model", "gpt3-175b", "--cluster", "a100x1024")
    assert proc.returncode == 0, proc.stderr
    assert "on 1024 x A100-80GB" in proc.stdout
    assert "tp8 pp8 vp2 dp16" in proc.stdout and "fits" in proc.stdout


def test_config_errors_name_the_config_key(tmp_path: Path) -> None:
    proc = sim_cli("simulate", "configs/seed_mcp.yaml", "--model", "gpt3-175b", "--cluster",
                   "a100x1024")
    user_error(proc, "parallelism.experts: expert parallelism needs an MoE model")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("parallelism: {tensor: 8, pipeline: 8, data: 8}\n")
    proc = sim_cli("simulate", str(cfg), "--model", "gpt3-175b", "--cluster", "a100x1024")
    user_error(proc, "parallelism: tp 8 x pp 8 x cp 1 x dp 8 = 512, not 1024")


def test_unknown_presets() -> None:
    user_error(sim_cli("plan", "--model", "gpt5", "--cluster", "a100x64"),
               "--model: unknown model preset 'gpt5'")
    user_error(sim_cli("plan", "--model", "gpt3-13b", "--cluster", "v100x64"),
               "--cluster: unknown GPU 'v100'")


def test_plan_prints_a_table_and_fits_nowhere_is_an_error() -> None:
    proc = sim_cli("plan", "--model", "gpt3-13b", "--cluster", "a100x64", "--top", "3")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "64 x A100-80GB" in lines[0]
    assert lines[1].split()[:2] == ["#", "layout"]
    assert len(lines) == 2 + 1 + 3
    proc = sim_cli("plan", "--model", "llama3-405b", "--cluster", "a100-40gbx8")
    user_error(proc, "--model llama3-405b: no layout on 8 x A100-40GB fits in 40 GiB")


def test_mcpar_mounts_simulate_and_plan(tmp_path: Path) -> None:
    out = tmp_path / "out.csv"
    proc = run_mcpar("simulate", "--runs", str(RUNS_CSV), "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert tuple(rows(out)[0]) == RUN_COLUMNS + STACK_COLUMNS + PREDICTION_COLUMNS
    proc = run_mcpar("plan", "--model", "gpt3-13b", "--cluster", "a100x64", "--top", "2")
    assert proc.returncode == 0, proc.stderr
    assert "layouts considered" in proc.stdout
