"""The CLI contract: `check` prints the plan, user errors exit 2 with one line per problem."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_cli_in_process, run_mcpar, sets, worker_pids


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def test_check_seed_config_prints_the_1024_device_plan() -> None:
    proc = run_mcpar("check", "configs/seed_mcp.yaml")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "1024 devices = tensor 8 x pipeline 4 x data 32" in out
    assert "experts 16 within the data axis" in out
    assert re.search(r"per-rank memory estimate", out)
    assert re.search(r"total\s+\d+\.\d (KiB|MiB|GiB)", out)


def test_train_seed_config_says_how_many_devices_it_needs(
        capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "train", "configs/seed_mcp.yaml",
                              "--run-dir", "/nonexistent/never")
    have = os.cpu_count()
    assert_user_error(proc, "needs 1024 devices", f"has {have} CPU cores")


def test_unknown_key_on_the_command_line(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model:\n  hidden_sise: 64\n")
    proc = run_cli_in_process(capsys, "check", str(cfg))
    assert_user_error(proc, "model.hidden_sise: unknown key", "model.hidden_size")


def test_set_override_is_validated(capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "check", "configs/seed_mcp.yaml", "--set",
                              "model.num_heads=3")
    assert_user_error(proc, "model.num_heads")


def test_missing_config_file() -> None:
    # Through `python -m mcpar.cli` (as the seed config's check above): the module's exit
    # status is main's, 2 for a user error.
    proc = run_mcpar("check", "nope.yaml")
    assert_user_error(proc, "nope.yaml: config file not found")


def test_missing_data_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, "data.source=/no/such/corpus*.txt"),
                              "--nproc", "1", "--run-dir", str(tmp_path / "run"))
    assert_user_error(proc, "data.source", "/no/such/corpus*.txt")


def test_cuda_requested_without_cuda(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "train", *sets("training.device=cuda"),
                              "--run-dir", str(tmp_path / "r"))
    assert_user_error(proc, "training.device")


def test_unimplemented_setting_is_refused_not_ignored(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, "controllers.memory.offload=cpu"),
                              "--nproc", "1", "--run-dir", str(tmp_path / "r"))
    assert_user_error(proc, "controllers.memory.offload: 'cpu' is not available")


def test_nproc_must_match_the_layout(tmp_path: Path,
                                     capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, "parallelism.data=2"),
                              "--nproc", "3", "--run-dir", str(tmp_path / "r"))
    assert_user_error(proc, "parallelism:", "has 3")


def test_existing_run_dir_is_not_overwritten(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "r"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    proc = run_cli_in_process(capsys, "train", *sets(*TINY), "--nproc", "1",
                              "--run-dir", str(run))
    assert_user_error(proc, "--run-dir", "already holds a run")
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


def test_worker_killed_by_a_signal_stops_the_job(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcpar.cli", "train", *sets(*TINY, "training.steps=100000"),
         "--nproc", "2", "--run-dir", str(run)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            metrics = run / "metrics.jsonl"
            if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                break
            time.sleep(0.2)
        pids = worker_pids(run)
        assert sorted(pids) == [0, 1]
        os.kill(pids[1], signal.SIGKILL)
        killed_at = time.time()
        _, stderr = proc.communicate(timeout=30)
        stopped_in = time.time() - killed_at
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert "rank 1 was killed by signal SIGKILL" in stderr, stderr
    assert stopped_in < 15
    assert worker_pids(run) == {}


LAYOUT_ERRORS = [
    # (settings, workers, key named in the error)
    (["model.num_heads=6", "model.hidden_size=96", "parallelism.tensor=4"], 4, "model.num_heads"),
    (["model.ffn_hidden_size=100", "parallelism.tensor=8"], 8, "model.ffn_hidden_size"),
    (["model.num_layers=3", "parallelism.pipeline=2", "parallelism.virtual_stages=2",
      "parallelism.schedule=interleaved_1f1b"], 2, "model.num_layers"),
    (["model.num_layers=4", "parallelism.pipeline=2", "parallelism.virtual_stages=2",
      "parallelism.schedule=interleaved_1f1b", "optimization.micro_batch_size=4",
      "optimization.gradient_accumulation=3"], 2, "optimization.gradient_accumulation"),
    (["model.num_layers=4", "parallelism.pipeline=2", "parallelism.virtual_stages=2"], 2,
     "parallelism.schedule"),
    (["parallelism.tensor=2", "parallelism.pipeline=2"], 2, "parallelism:"),
    (["parallelism.sequence_parallel=true"], 1, "parallelism.sequence_parallel"),
    # PowerSGD has no hierarchical path: refused, never run flat under a hierarchical label.
    (["controllers.communication.compression=powersgd",
      "controllers.communication.topology=hierarchical", "cluster.ranks_per_node=1"], 2,
     "controllers.communication.topology: 'hierarchical' cannot be combined with compression "
     "'powersgd'"),
    (["controllers.communication.compression=powersgd",
      "controllers.communication.topology=hybrid"], 2,
     "controllers.communication.topology: 'hybrid' cannot be combined"),
]


def test_layout_errors_name_the_key(tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    for settings, workers, key in LAYOUT_ERRORS:
        proc = run_cli_in_process(capsys, "train", *sets(*TINY, *settings), "--nproc",
                                  str(workers), "--run-dir", str(tmp_path / "never"))
        assert_user_error(proc, key)
        assert not (tmp_path / "never").exists()


def test_check_train_and_simulate_refuse_the_same_plan(capsys: pytest.CaptureFixture[str],
                                                       tmp_path: Path) -> None:
    # One plan resolution: a combination the trainer cannot run is neither checked as valid
    # nor priced by the cost model.
    bad = sets("controllers.communication.compression=powersgd",
               "controllers.communication.topology=hierarchical")
    key = "controllers.communication.topology: 'hierarchical' cannot be combined"
    for command in (["check", "configs/moe.yaml", *bad],
                    ["simulate", "configs/moe.yaml", *bad],
                    ["train", "configs/moe.yaml", *bad, "--run-dir", str(tmp_path / "never")]):
        assert_user_error(run_cli_in_process(capsys, *command), key)
    # The cost model alone refuses to price it too (the planner skips it the same way).
    from mcpar.sim.workload import Layout, ModelShape, layout_problems

    model = ModelShape(layers=2, hidden=64, heads=4, kv_heads=4, ffn=256, ffn_kind="gelu",
                       vocab=256, seq_len=32)
    layout = Layout(tp=1, pp=1, dp=8, global_batch=8, micro_batch=1, compression="powersgd",
                    topology="hierarchical")
    assert any("'powersgd'" in p for p in layout_problems(model, layout, 8, 4, "layout"))


_IMPORTS_OF_HELP = """
import sys, time
start = time.perf_counter()
from mcpar.cli import main
for argv in (["--help"], ["train", "--help"], ["check", "--help"], ["trian"]):
    try:
        main(argv)
    except SystemExit as stop:
        assert stop.code == (2 if argv == ["trian"] else 0), (argv, stop.code)
print(time.perf_counter() - start, "torch" in sys.modules)
"""


def test_help_answers_at_once_without_importing_torch() -> None:
    """`mcpar --help`, a command's --help and a mistyped command parse without importing torch
    (which alone takes seconds): each command's module is imported only when it runs. The
    whole `mcpar --help` process, interpreter start included, is timed against 1 s."""
    proc = subprocess.run([sys.executable, "-c", _IMPORTS_OF_HELP], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert proc.returncode == 0, proc.stderr
    seconds, torch_imported = proc.stdout.split()[-2:]
    assert torch_imported == "False", "parsing imported torch"
    assert "invalid choice: 'trian'" in proc.stderr
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mcpar.cli", "--help"], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    wall = time.perf_counter() - start
    assert proc.returncode == 0 and "prepare" in proc.stdout and "simulate" in proc.stdout
    assert wall < 1.0, f"mcpar --help took {wall:.2f} s"


_CHECK_WITHOUT_TORCH = """
import sys, time
from mcpar.cli import main
for path in sys.argv[1:]:
    start = time.perf_counter()
    code = main(["check", path])
    print("checked", path, code, f"{time.perf_counter() - start:.2f}", file=sys.stderr)
print("torch" in sys.modules)
"""


def test_check_plans_every_shipped_config_without_importing_torch(tmp_path: Path) -> None:
    """`mcpar check` needs no tensor: the built-in default and every config under configs/ are
    validated and planned (layout, controllers' plans, memory estimate and placement) without
    importing torch, which alone takes seconds. The registries' built-in entries load without
    it (their builds import it); the device probe of training.device 'auto' asks torch only
    where CUDA is possible (``mcpar.device_select``), so on a GPU machine it may import it."""
    from mcpar.device_select import cuda_ruled_out

    default = tmp_path / "default.yaml"
    default.write_text("{}\n")  # the schema's defaults: the built-in default job
    configs = sorted(str(p) for p in (REPO / "configs").glob("*.yaml"))
    assert len(configs) >= 3
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _CHECK_WITHOUT_TORCH, str(default), *configs],
                          capture_output=True, text=True, cwd=REPO, timeout=120)
    wall = time.perf_counter() - start
    assert proc.returncode == 0, proc.stderr
    for path in (str(default), *configs):
        assert f"mcpar check: {path} is valid" in proc.stdout
        assert f"checked {path} 0 " in proc.stderr, proc.stderr
    if cuda_ruled_out():
        assert proc.stdout.split()[-1] == "False", (
            f"mcpar check imported torch ({wall:.2f} s for {1 + len(configs)} configs)")
