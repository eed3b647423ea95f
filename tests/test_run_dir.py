"""A run directory belongs to one job at a time, is never overwritten by another model's run, and a
resume finishes after a process died in the middle of writing a log line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_cli_in_process, run_mcpar, sets

from mcpar.config import load_config, to_yaml
from mcpar.errors import UserError
from mcpar.launch.run_dir import LOCK_FILE, RunDirLock, config_differences, repair_jsonl
from mcpar.metrics import read_metrics
from mcpar.plan import resolve_plan


def resolved(*settings: str):
    return resolve_plan(load_config(None, [*TINY, *settings]), 1).config


def finished_run(run: Path, steps: int = 4, metrics: bool = True) -> dict[str, bytes]:
    """A run directory as a finished TINY run of ``steps`` steps leaves it, without checkpoints;
    returns its files' bytes."""
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(resolved(f"training.steps={steps}")))
    if metrics:
        (run / "metrics.jsonl").write_text("".join(
            json.dumps({"step": s, "loss": 5.0 - s}) + "\n" for s in range(1, steps + 1)))
    (run / "summary.json").write_text(json.dumps({"final_step": steps, "final_loss": 1.0}))
    return snapshot(run)


def snapshot(run: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in run.iterdir() if p.name != LOCK_FILE}


def assert_user_error(proc: subprocess.CompletedProcess[str], *needles: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


# --- 1. ownership -------------------------------------------------------------------------------

def test_lock_is_exclusive_and_names_its_owner(tmp_path: Path) -> None:
    run = tmp_path / "new" / "run"
    held = RunDirLock(run).acquire()  # creates the directory; the lock file comes first
    assert [p.name for p in run.iterdir()] == [LOCK_FILE]
    with pytest.raises(UserError) as err:
        RunDirLock(run).acquire()  # another open file: flock refuses it, even in this process
    (line,) = err.value.problems
    assert line.startswith("--run-dir: ")
    assert f"host {socket.gethostname()}, pid {os.getpid()}, started 20" in line
    assert "another --run-dir" in line
    held.release()
    RunDirLock(run).acquire().release()


def test_lock_of_a_dead_owner_is_free(tmp_path: Path) -> None:
    run = tmp_path / "run"
    # The owner is killed (no cleanup runs): the kernel drops its lock, its record stays.
    code = ("import os, signal; from pathlib import Path; "
            "from mcpar.launch.run_dir import RunDirLock; "
            f"RunDirLock(Path({str(run)!r})).acquire(); os.kill(os.getpid(), signal.SIGKILL)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO)
    assert proc.returncode == -9
    dead = json.loads((run / LOCK_FILE).read_text())["pid"]
    lock = RunDirLock(run).acquire()
    assert dead != os.getpid() and json.loads((run / LOCK_FILE).read_text())["pid"] == os.getpid()
    lock.release()


def test_a_second_train_in_the_same_run_dir_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    steps = 20
    first = subprocess.Popen(
        [sys.executable, "-m", "mcpar.cli", "train", *sets(*TINY, f"training.steps={steps}"),
         "--nproc", "2", "--run-dir", str(run)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.time() + 120
        owner = None
        while owner is None and time.time() < deadline and first.poll() is None:
            try:
                owner = json.loads((run / LOCK_FILE).read_text())
            except (OSError, ValueError):
                time.sleep(0.05)
        assert owner is not None and owner["pid"] == first.pid
        config = (run / "config.yaml").read_bytes() if (run / "config.yaml").exists() else None
        second = run_cli_in_process(capsys, "train", *sets(*TINY, "model.num_layers=3"),
                                    "--nproc", "1", "--run-dir", str(run))
        assert first.poll() is None, "the first run ended before the second was tried"
        assert_user_error(second, "--run-dir", "in use by another mcpar train",
                          f"pid {first.pid}", f"started {owner['started']}")
        assert len(second.stderr.strip().splitlines()) == 1
        if config is not None:
            assert (run / "config.yaml").read_bytes() == config
        _, stderr = first.communicate(timeout=300)
    finally:
        first.kill()
    assert first.returncode == 0, stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, steps + 1))
    assert "num_layers: 2" in (run / "config.yaml").read_text()


# --- 2. resume and plain runs never overwrite another run ---------------------------------------

def test_resume_may_change_steps_and_layout_but_not_the_model_or_data_order() -> None:
    saved = to_yaml(resolved("training.steps=4"))
    assert config_differences(saved, resolved("training.steps=40")) == []
    # Another layout of the same global batch (16 sequences) continues the same data order.
    same_batch = resolve_plan(load_config(None, [*TINY, "optimization.micro_batch_size=8",
                                                 "parallelism.data=2"]), 2).config
    assert config_differences(saved, same_batch) == []
    changed = resolved("model.num_layers=3", "data.tokenizer=bpe", "training.seed=7",
                       "optimization.micro_batch_size=8", "data.val_fraction=0.02")
    assert [key for key, _, _ in config_differences(saved, changed)] == [
        "data.tokenizer", "data.val_fraction", "model.num_layers",
        "optimization.global_batch_size", "training.seed"]


def test_resume_with_another_model_is_refused_and_writes_nothing(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    before = finished_run(run)  # no checkpoint: only config.yaml knows what was trained
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, "model.num_layers=3",
                                                     "training.seed=7"),
                              "--steps", "6", "--nproc", "1", "--run-dir", str(run), "--resume")
    assert_user_error(proc, "model.num_layers: --resume would change the run",
                      "training.seed: --resume would change the run", "with 2, this run has 3")
    assert "training.steps" not in proc.stderr
    assert snapshot(run) == before


def test_plain_run_never_overwrites_a_finished_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for metrics in (True, False):  # a summary alone marks a run too
        run = tmp_path / f"run-{metrics}"
        before = finished_run(run, metrics=metrics)
        proc = run_cli_in_process(capsys, "train", *sets(*TINY), "--steps", "4", "--nproc", "1",
                                  "--run-dir", str(run))
        name = "metrics.jsonl" if metrics else "summary.json"
        assert_user_error(proc, f"--run-dir: {run} already holds a run ({name})", "--resume")
        assert snapshot(run) == before


# --- 3. torn last lines -------------------------------------------------------------------------

def test_repair_drops_only_a_torn_last_line(tmp_path: Path) -> None:
    path = tmp_path / "log.jsonl"
    assert repair_jsonl(path) is None  # no file: nothing to do
    path.write_text('{"step": 1}\n{"step": 2}\n{"step": 3, "lo')
    assert repair_jsonl(path) == (3, '{"step": 3, "lo')
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    assert repair_jsonl(path) is None and path.read_text() == '{"step": 1}\n{"step": 2}\n'
    path.write_text('{"step": 1}\n{"step": 2}')  # cut exactly before its newline: kept
    assert repair_jsonl(path) is None
    assert path.read_text() == '{"step": 1}\n{"step": 2}\n'
    bad = '{"step": 1}\n{"st\n{"step": 3}\n'
    path.write_text(bad)
    with pytest.raises(UserError) as err:
        repair_jsonl(path)
    assert err.value.problems == [f"{path}: line 2 is not a JSON object (the file is corrupted, "
                                  "not just cut short); fix or delete that line, or start a new "
                                  "--run-dir"]
    assert path.read_text() == bad


def test_resume_refuses_a_log_corrupted_in_the_middle(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    finished_run(run)
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join([lines[0], "garbage\n", *lines[2:]]))
    before = snapshot(run)
    proc = run_cli_in_process(capsys, "train", *sets(*TINY), "--steps", "6", "--nproc", "1",
                              "--run-dir", str(run), "--resume")
    assert_user_error(proc, f"{run / 'metrics.jsonl'}: line 2 is not a JSON object")
    assert snapshot(run) == before


def test_resume_after_a_torn_last_line_finishes(tmp_path: Path) -> None:
    run = tmp_path / "run"
    settings = sets(*TINY, "optimization.checkpoint.interval=4")
    proc = run_mcpar("train", *settings, "--steps", "8", "--nproc", "1", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # Killed while writing step 9's metrics and a log event: both files end in half a line.
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 9, "loss": 3.')
    with open(run / "recovery.jsonl", "a") as f:
        f.write('{"time": 1.5, "event": "sa')
    proc = run_mcpar("train", *settings, "--steps", "12", "--nproc", "1", "--run-dir", str(run),
                     "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in read_metrics(run)] == list(range(1, 13))
    events = [json.loads(line) for line in (run / "recovery.jsonl").read_text().splitlines()]
    repairs = [(e["file"], e["line"]) for e in events if e["event"] == "repair"]
    assert repairs[0][0] == "recovery.jsonl" and repairs[1] == ("metrics.jsonl", 9)
    assert "dropped its torn last line" in proc.stderr
    assert [e["step"] for e in events if e["event"] == "load"] == [8]


def test_default_run_dirs_started_in_the_same_second_differ(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mcpar.commands.train import new_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(time, "strftime", lambda fmt: "20260101-000000")
    first, second = new_run_dir(None, None), new_run_dir(None, None)
    assert (first, second) == (Path("runs/20260101-000000"), Path("runs/20260101-000000-1"))
    assert first.is_dir() and second.is_dir()  # claimed at once, before either run locks it


def test_rank_0_of_a_torchrun_job_takes_the_lock(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    held = RunDirLock(run).acquire()  # another job owns the directory
    # What torchrun sets for each worker (a partial set is refused as a stale environment).
    for key, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29511", "TORCHELASTIC_RUN_ID": "t1"}.items():
        monkeypatch.setenv(key, value)
    proc = run_cli_in_process(capsys, "train", *sets(*TINY), "--run-dir", str(run))
    assert_user_error(proc, "--run-dir", f"pid {os.getpid()}", "in use by another mcpar train")
    assert snapshot(run) == {}
    held.release()
