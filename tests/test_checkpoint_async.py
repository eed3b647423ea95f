"""Asynchronous and compressed checkpoints: the staged snapshot is the step's state (bitwise, as
a synchronous save writes it), a kill while a save is in flight never leaves a valid checkpoint,
zstd round-trips and shrinks the files, and a background failure is raised, not lost."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    launch_in_process,
    recovery_events,
    sets,
    step_losses,
    worker_pids,
)

import mcpar.checkpoint.manager as checkpoint
from mcpar.checkpoint import packing
from mcpar.checkpoint.async_save import (
    TEST_DELAY_ENV,
    BackgroundSave,
    CheckpointSaveError,
    StagingBuffers,
)
from mcpar.checkpoint.manager import (
    FaultRecoveryManager,
    SafeFileSystemReader,
    find_latest_valid,
    load_tensors,
    verify_checkpoint,
    zstd_available,
)
from mcpar.config import load_config
from mcpar.errors import UserError
from mcpar.metrics import read_metrics
from mcpar.plan import resolve_plan

BASE = [*TINY, "training.steps=40", "parallelism.data=2", "optimization.checkpoint.interval=10"]
ASYNC = ["optimization.checkpoint.async_save=true"]


def _train(run: Path, settings: list[str], *extra: str) -> None:
    assert launch_in_process("train", *sets(*BASE, *settings), "--nproc", "2",
                             "--run-dir", str(run), *extra) == 0


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """40 uninterrupted steps with synchronous saves at 10, 20, 30, 40."""
    run = tmp_path_factory.mktemp("sync") / "run"
    _train(run, ["optimization.checkpoint.async_save=false",
                 "optimization.checkpoint.keep=4"])
    assert {e["asynchronous"] for e in recovery_events(run) if e["event"] == "save"} == {False}
    return run


def _same_tensors(run: Path, reference: Path, step: int) -> None:
    for prefix in ("model/", "optim/", "rng/"):
        got = load_tensors(run / "checkpoints" / f"step-{step}", prefix)
        want = load_tensors(reference / "checkpoints" / f"step-{step}", prefix)
        assert want and got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), (step, prefix)


def _steps_logged(run: Path) -> int:
    """Lines of metrics.jsonl so far (a line being written counts as not yet there)."""
    try:
        return (run / "metrics.jsonl").read_text().count("\n")
    except OSError:
        return 0


def test_kill_during_async_save_leaves_no_valid_checkpoint(
        reference: Path, tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    ckpts = run / "checkpoints"
    # Saves every 5 steps; the save of step 10 sleeps (test hook) after its shards are written
    # and before rank 0 commits it. Rank 0 is killed in that window, training having gone on.
    settings = [*ASYNC, "optimization.checkpoint.interval=5",
                "optimization.checkpoint.max_restarts=0"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcpar.cli", "train", *sets(*BASE, *settings),
         "--nproc", "2", "--run-dir", str(run)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=dict(os.environ, **{TEST_DELAY_ENV: "10:60"}),
    )
    try:
        deadline = time.time() + 120
        # Shards and DCP metadata of step 10 written; the training thread is past step 12.
        while time.time() < deadline and not (
                (ckpts / "step-10.tmp" / ".metadata").exists() and _steps_logged(run) >= 12):
            time.sleep(0.05)
        assert (ckpts / "step-10.tmp" / ".metadata").exists(), "the save of step 10 never ran"
        os.kill(worker_pids(run)[0], signal.SIGKILL)
        proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert len(read_metrics(run)) >= 12  # the step loop did not wait for the save
    assert not (ckpts / "step-10").exists()
    assert "no manifest" in (verify_checkpoint(ckpts / "step-10.tmp") or "")
    found = find_latest_valid(ckpts)
    assert found is not None and found[0] == 5
    capfd.readouterr()
    _train(run, settings, "--resume")
    assert "Traceback" not in capfd.readouterr().err
    assert [e["step"] for e in recovery_events(run) if e["event"] == "load"] == [5]
    assert step_losses(run) == step_losses(reference)
    assert not list(ckpts.glob("*.tmp"))  # the killed save's leftover was cleaned up
    saves = [e for e in recovery_events(run) if e["event"] == "save"]
    assert all(e["asynchronous"] for e in saves) and saves[-1]["step"] == 40
    # The resumed run stepped on while its saves were written: each checkpoint still holds its
    # step's state, bit for bit what a synchronous save wrote, and resume's data position.
    for step in (30, 40):
        assert verify_checkpoint(ckpts / f"step-{step}") is None
        _same_tensors(run, reference, step)
        meta = json.loads((ckpts / f"step-{step}" / "meta.json").read_text())
        ref = json.loads((reference / "checkpoints" / f"step-{step}" / "meta.json").read_text())
        assert meta["step"] == step and meta["data_stream"] == ref["data_stream"]


def test_async_stop_resume_with_zstd_is_bitwise(reference: Path, tmp_path: Path,
                                                capfd: pytest.CaptureFixture[str]) -> None:
    """Stop at 20 (its save waited for), resume, finish: the same losses and checkpoints as the
    synchronous run. With zstd when a zstd module is installed (else uncompressed, and the
    compression checks are left out): the files are smaller and load transparently."""
    run = tmp_path / "run"
    zstd = zstd_available()
    settings = [*ASYNC, f"optimization.checkpoint.compression={'zstd' if zstd else 'none'}"]
    capfd.readouterr()
    _train(run, settings, "--stop-after", "20")
    assert "stopped after step 20 of 40" in capfd.readouterr().out
    _train(run, settings, "--resume")
    assert step_losses(run) == step_losses(reference)
    assert [e["step"] for e in recovery_events(run) if e["event"] == "load"] == [20]
    for step in (30, 40):
        path = run / "checkpoints" / f"step-{step}"
        assert verify_checkpoint(path) is None
        _same_tensors(run, reference, step)
        if not zstd:
            continue
        assert json.loads((path / "meta.json").read_text())["compression"] == "zstd"
        assert checkpoint.is_compressed(SafeFileSystemReader(path).read_metadata())

        def shard_bytes(ckpt: Path) -> int:
            return sum(p.stat().st_size for p in ckpt.glob("*.distcp"))

        assert shard_bytes(path) < 0.95 * shard_bytes(reference / "checkpoints" / f"step-{step}")


def test_missing_zstd_is_a_user_error(reference: Path, monkeypatch: pytest.MonkeyPatch,
                                      tmp_path: Path) -> None:
    monkeypatch.setattr(checkpoint, "zstd_available", lambda: False)
    cfg = load_config(None, ["optimization.checkpoint.interval=10",
                             "optimization.checkpoint.compression=zstd"])
    dims = SimpleNamespace(dp=1, tp=1, pp=1, ep=1, world_size=1)
    with pytest.raises(UserError, match="optimization.checkpoint.compression.*pip install "
                                        "zstandard"):
        FaultRecoveryManager(resolve_plan(cfg, 1), tmp_path, dims, [], None,  # type: ignore[arg-type]
                             None, 0,
                             barrier=lambda: None, agree=lambda v: v)
    # An uncompressed checkpoint reads without it.
    assert load_tensors(reference / "checkpoints" / "step-40", "model/")


def test_staging_is_a_packed_snapshot_in_reused_buffers() -> None:
    live = {"model/c/w": torch.arange(6.0).reshape(2, 3), "optim/c/w/step": torch.tensor(3.0),
            "optim/c/w/exp_avg": torch.ones(2, 3), "rng/rank0/cpu": torch.arange(4).byte()}
    entries, _ = packing.plan(live)

    def view(packs: dict[str, torch.Tensor], key: str) -> torch.Tensor:
        e = entries[key]
        return packs[e.pack].narrow(0, e.offset, e.numel).view(e.shape)

    stager = StagingBuffers()
    staged, ready = stager.stage(live)
    assert ready is None
    # One flat tensor per key group and dtype, plus one index per group.
    assert sorted(staged) == sorted([
        "model/c/__packed__/float32", "model/c/__packed__/index",
        "optim/c/__packed__/float32", "optim/c/__packed__/index",
        "rng/rank0/__packed__/uint8", "rng/rank0/__packed__/index"])
    live["model/c/w"].add_(100.0)  # the optimizer steps on after staging
    assert torch.equal(view(staged, "model/c/w"), torch.arange(6.0).reshape(2, 3))
    again, _ = stager.stage(live)
    pack = entries["model/c/w"].pack
    assert again[pack].data_ptr() == staged[pack].data_ptr()  # no new allocation per save
    assert torch.equal(view(again, "model/c/w"), live["model/c/w"])
    assert torch.equal(view(again, "optim/c/w/step"), torch.tensor(3.0))


def test_background_failure_is_raised_at_wait() -> None:
    def fail() -> None:
        raise OSError("disk full")

    save = BackgroundSave(7, fail)
    with pytest.raises(CheckpointSaveError, match="step 7.*disk full"):
        save.wait()
    assert BackgroundSave(8, lambda: None).wait() >= 0.0
