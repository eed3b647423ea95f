"""Inputs of `mcpar simulate` and `mcpar plan` that used to crash or price nonsense: a bad row
of a --runs file is named by id and column while the others are still predicted; broken hardware
tables and cluster presets are refused naming the input; the planner's search is bounded.

Every command runs in this process through ``mcpar.cli.main`` (exit 2, one line per problem,
no traceback)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from conftest import REPO, expect_exit, run_cli_in_process
from conftest import read_csv_rows as read_rows
from conftest import write_csv_rows as write_rows

from mcpar.sim.runs import OPTIONAL_COLUMNS, PREDICTION_COLUMNS, RUN_COLUMNS

RUNS_CSV = REPO / "src" / "mcpar" / "sim" / "data" / "published_runs.csv"
HARDWARE_CSV = REPO / "src" / "mcpar" / "sim" / "data" / "hardware.csv"


def partly_predicted(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    """Some rows refused, the others predicted: exit 0, every refused row named on stderr."""
    expect_exit(proc, 0, *needles)


def user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    expect_exit(proc, 2, *needles)


# (column, bad value, what the message says) for one row of published_runs.csv.
BAD_CELLS = [
    ("num_gpus", "", "expected an integer"),
    ("hidden", "lots", "expected an integer"),
    ("layers", "1e400", "give a whole number"),
    ("seq_len", "nan", "give a whole number"),
    ("micro_batch", "0", "give a whole number from 1"),
    ("tp", "-2", "give a whole number from 1"),
    ("heads", "2.5", "give a whole number"),
    ("gpus_per_node", "0", "give a whole number from 1"),
    ("inter_node_gbps_per_gpu", "0", "give a finite number > 0"),
    ("inter_node_gbps_per_gpu", "inf", "give a finite number > 0"),
    ("measured_step_s", "-3", "give a finite number > 0 or leave it empty"),
    ("gpu", "V100-32GB", "unknown GPU 'V100-32GB'"),
    ("dp", "5", "num_gpus: tp 2 x pp 1 x cp 1 x dp 5 = 10, not 64"),  # the layout's GPU count
    ("seq_parallel", "maybe", "expected true or false"),
]


@pytest.mark.parametrize(("column", "value", "says"), BAD_CELLS)
def test_a_bad_row_is_named_and_the_others_are_predicted(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], column: str, value: str,
        says: str) -> None:
    header, data = read_rows(RUNS_CSV)
    data = data[:4]
    data[1][column] = value
    bad_id = data[1]["id"]
    runs, out = tmp_path / "runs.csv", tmp_path / "out.csv"
    write_rows(runs, header, data)
    proc = run_cli_in_process(capsys, "simulate", "--runs", str(runs), "--out", str(out))
    named = "num_gpus" if column == "dp" else column
    partly_predicted(proc, f"{bad_id}.{named}: ", says, "1 row(s) refused")
    header_out, rows_out = read_rows(out)
    assert tuple(header_out) == tuple(header) + PREDICTION_COLUMNS
    assert set(header[len(RUN_COLUMNS):]) <= set(OPTIONAL_COLUMNS)
    assert [r["id"] for r in rows_out] == [data[i]["id"] for i in (0, 2, 3)]
    assert all(float(r["predicted_step_s"]) > 0 for r in rows_out)


def test_a_row_of_a_million_pipeline_stages_is_refused_at_once(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import time

    import mcpar.cli  # noqa: F401  (imported before the clock starts)

    header, data = read_rows(RUNS_CSV)
    data = data[:3]
    # A consistent layout (tp 2 x pp 10^6 x dp 32 GPUs), priced stage by stage: 8 s per row.
    data[1].update(layers="1000000", pp="1000000", num_gpus=str(64 * 10**6))
    runs, out = tmp_path / "runs.csv", tmp_path / "out.csv"
    write_rows(runs, header, data)
    start = time.process_time()
    proc = run_cli_in_process(capsys, "simulate", "--runs", str(runs), "--out", str(out))
    partly_predicted(proc,
                     f"{data[1]['id']}.pp: pp 1000000 x vp 1 is more than 65536 pipeline stages")
    assert time.process_time() - start < 3
    assert len(read_rows(out)[1]) == 2


def test_a_short_row_and_a_long_row_are_named(tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    lines = RUNS_CSV.read_text().splitlines()[:4]
    short = lines[2].rsplit(",", 3)[0]
    longer = lines[3] + ",extra"
    runs, out = tmp_path / "runs.csv", tmp_path / "out.csv"
    runs.write_text("\n".join([lines[0], lines[1], short, longer]) + "\n")
    proc = run_cli_in_process(capsys, "simulate", "--runs", str(runs), "--out", str(out))
    ids = [line.split(",", 1)[0] for line in lines[2:4]]
    partly_predicted(proc, f"{ids[0]}: ", f"{ids[1]}: ", "where the header has 33",
               "2 row(s) refused")
    assert [r["id"] for r in read_rows(out)[1]] == [lines[1].split(",", 1)[0]]


def test_no_valid_row_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header, data = read_rows(RUNS_CSV)
    data = data[:2]
    for row in data:
        row["gpus_per_node"] = "0"
    runs, out = tmp_path / "runs.csv", tmp_path / "out.csv"
    write_rows(runs, header, data)
    proc = run_cli_in_process(capsys, "simulate", "--runs", str(runs), "--out", str(out))
    user_error(proc, f"{data[0]['id']}.gpus_per_node", f"{data[1]['id']}.gpus_per_node",
               "no row could be predicted")
    assert not out.exists()


# --- hardware tables, cluster presets, the local profile ----------------------------------------

@pytest.mark.parametrize(("column", "value"), [
    ("hbm_gbs", "0"), ("nvlink_gbs_per_gpu_bidirectional", "-600"),
    ("typical_inter_node_gbps_per_gpu", "nan"), ("peak_tflops_bf16", "inf"), ("hbm_gb", "lots"),
])
def test_a_broken_hardware_table_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            column: str, value: str) -> None:
    header, data = read_rows(HARDWARE_CSV)
    for row in data:
        if row["gpu"] == "H100-80GB":
            row[column] = value
    table = tmp_path / "hw.csv"
    write_rows(table, header, data)
    for command in (["plan", "--model", "gpt3-1.3b"],
                    ["simulate", str(REPO / "configs" / "seed_mcp.yaml")]):
        proc = run_cli_in_process(capsys, *command, "--cluster", "a100x8", "--hardware",
                                  str(table))
        user_error(proc, f"{table}[H100-80GB].{column}: expected a finite number > 0, "
                         f"got '{value}'")


def test_a_duplicate_or_unnamed_hardware_row_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    header, data = read_rows(HARDWARE_CSV)
    table = tmp_path / "hw.csv"
    write_rows(table, header, [*data, dict(data[0]), dict(data[1], gpu=" ")])
    proc = run_cli_in_process(capsys, "plan", "--model", "gpt3-1.3b", "--cluster", "a100x8",
                              "--hardware", str(table))
    user_error(proc, f"{table}[{data[0]['gpu']}]: a second row", f"{table}:{len(data) + 3}.gpu")


GOOD_PROFILE = {
    "cores": 2, "flops_per_thread": 5e10, "attention_flops_per_thread": 2e10,
    "mem_bw_per_thread": 1e10, "mem_bw_total": 2e10, "op_overhead_s": 1e-5,
    "layer_overhead_s": 1e-4, "collectives": {"ar": [1e-4, 1e-9], "p2p": [5e-5, 5e-10]},
    "notes": {},
}


@pytest.mark.parametrize(("field", "value", "named"), [
    ("mem_bw_total", 0, "mem_bw_total"),
    ("flops_per_thread", -1.0, "flops_per_thread"),
    ("cores", 0, "cores"),
    ("collectives", {"ar": [1e-4, 0]}, "collectives.ar"),
    ("collectives", {"p2p": [1e-4, 1e-9]}, "collectives.ar"),
    ("notes", {"flops_all_cores": 0}, "notes.flops_all_cores"),
    ("unknown_field", 1, ""),
])
def test_a_broken_local_profile_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch, field: str,
                                           value: object, named: str) -> None:
    """A profile of this machine, its checksum intact, whose measured figures are no rates (an
    edited one is stale instead, and measured again: test_profilestore.py)."""
    import json

    from mcpar.sim import localprofile
    from mcpar.sim.hardware import LocalProfile
    from mcpar.sim.profilestore import profile_document, save_profile

    path = tmp_path / "profile.json"
    monkeypatch.setenv("MCPAR_LOCAL_PROFILE", str(path))
    monkeypatch.setattr(localprofile, "measure", _never_measured)
    save_profile(LocalProfile(**GOOD_PROFILE), path)  # a sound profile is still accepted
    proc = run_cli_in_process(capsys, "simulate", str(REPO / "configs" / "moe.yaml"),
                              "--cluster", "local")
    assert proc.returncode == 0 and "local-cpu" in proc.stdout, proc.stderr
    if named:
        save_profile(LocalProfile(**{**GOOD_PROFILE, field: value}), path)
    else:  # not a field of a profile: refused before its checksum is read
        doc = profile_document(LocalProfile(**GOOD_PROFILE))
        path.write_text(json.dumps({**doc, field: value}))
    proc = run_cli_in_process(capsys, "simulate", str(REPO / "configs" / "moe.yaml"),
                              "--cluster", "local")
    user_error(proc, f"{path}.{named}:" if named else f"{path}: not a local profile",
               "python -m mcpar.sim.localprofile")


def _never_measured() -> None:
    raise AssertionError("measured although a profile of this machine is saved")


# --- the planner's bounds -----------------------------------------------------------------------

@pytest.mark.parametrize(("args", "says"), [
    (["--cluster", "h100x1048576"], "--cluster: 1,048,576 GPUs is more than the planner"),
    (["--cluster", "h100x512", "--top", "1000000"], "--top: must be 1..100"),
    (["--cluster", "h100x512", "--top", "0"], "--top: must be 1..100"),
    (["--cluster", "h100x512", "--global-batch", str(10**400)], "--global-batch: must be 1.."),
    (["--cluster", "h100x512", "--global-batch", "0"], "--global-batch: must be 1.."),
])
def test_plan_refuses_unbounded_searches_at_once(capsys: pytest.CaptureFixture[str],
                                                 args: list[str], says: str) -> None:
    import time

    import mcpar.cli  # noqa: F401  (imported before the clock starts)

    start = time.process_time()
    proc = run_cli_in_process(capsys, "plan", "--model", "mixtral-8x7b", *args)
    user_error(proc, says)
    assert time.process_time() - start < 2


def test_plan_refuses_a_search_over_its_layout_budget() -> None:
    import time
    from dataclasses import replace

    from mcpar.errors import UserError
    from mcpar.sim.hardware import cluster_preset
    from mcpar.sim.planner import plan
    from mcpar.sim.workload import model_preset

    # 120 layers, 24 experts, 20160 GPUs and a batch with many divisors: 151k cores to price,
    # about a minute; refused after counting.
    preset = model_preset("mixtral-8x7b")
    model = replace(preset.shape, layers=120, experts=24)
    start = time.process_time()
    with pytest.raises(UserError, match="--global-batch: 3628800 sequences on 20160 GPUs leave "
                                        "more than 20,000 layouts"):
        plan(model, cluster_preset("h100x20160"), 20160 * 180, preset.precision, keep=10,
             budget_key="--global-batch")
    assert time.process_time() - start < 5


def test_plan_divisors_do_not_scan_to_the_gpu_count() -> None:
    import time

    from mcpar.sim.hardware import cluster_preset
    from mcpar.sim.planner import _divisors, plan
    from mcpar.sim.workload import model_preset

    assert _divisors(360) == [d for d in range(1, 361) if 360 % d == 0]
    assert _divisors(49) == [1, 7, 49] and _divisors(1) == [1]
    # A batch of 2^40 sequences per data-parallel rank used to be scanned one by one.
    preset = model_preset("gpt3-1.3b")
    start = time.process_time()
    result = plan(preset.shape, cluster_preset("h100x8"), 2**43, preset.precision, keep=3)
    assert result.candidates and time.process_time() - start < 5
