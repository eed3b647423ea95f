"""Fault recovery: bitwise-exact resume, automatic restart after a kill, corruption fallback, and
resharding onto another layout, and the refusals (changed model, existing run dir), with real
worker processes."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    REPO,
    TINY,
    launch_in_process,
    recovery_events,
    run_cli_in_process,
    run_mcpar,
    sets,
    step_losses,
    worker_pids,
)

from mcpar.checkpoint.manager import SafeFileSystemReader, load_tensors, verify_checkpoint
from mcpar.metrics import read_metrics

# Losses after a resume must be bitwise equal to the uninterrupted run: compare with ==.
# Saved at step 20 of 40: every layout's state is restored at 20 and must replay the next 20 steps
# bit for bit (the compression and balancing layouts change state before and after the save).
STEPS, SAVED = 40, 20
BASE = [*TINY, f"training.steps={STEPS}", f"optimization.checkpoint.interval={SAVED}"]
LAYOUTS = {
    "data2": ["parallelism.data=2"],
    "tensor2": ["parallelism.tensor=2"],
    "pipeline2": ["parallelism.pipeline=2", "optimization.gradient_accumulation=2",
                  "optimization.micro_batch_size=8"],
    "data2_tensor2": ["parallelism.data=2", "parallelism.tensor=2",
                      "optimization.micro_batch_size=8"],
    # ZeRO-3's shards cut over data x context (2 at data 1): each context rank saves and
    # restores its own, through the store's gathers.
    "context2_zero3": ["parallelism.context=2", "controllers.memory.zero_stage=3"],
    # Resumed past the freeze step: momentum, frozen variance and both error buffers restored,
    # with the momentum exchanged bucket by bucket from the backward pass (no clipping).
    "onebit_adam": ["parallelism.data=2", "controllers.communication.compression=1bit",
                    "optimization.freeze_step=8", "optimization.grad_clip=0",
                    "controllers.communication.bucket_size_mb=0.04"],
    # Resumed past the start: each rank's error feedback, Q and step count restored.
    "powersgd": ["parallelism.data=2", "controllers.communication.compression=powersgd",
                 "controllers.communication.powersgd_start_step=5",
                 "controllers.communication.powersgd_rank=2"],
    # MoE over 2 expert ranks whose learning balancer migrates experts before and after the
    # checkpoint: placement, router biases, the agent's values and RNG must all be restored.
    # Modeled costs: measured times differ from run to run, and so would the decisions; a
    # cheap migration and 8 experts (4 per rank: enough imbalance for the agent, which first
    # moves only what pays back within 10 steps, to move experts both before and after the
    # checkpoint).
    "moe_experts2": ["model.kind=moe", "model.num_experts=8", "model.top_k=2",
                     "parallelism.data=2", "parallelism.experts=2",
                     "controllers.compute.scheduler=reinforcement",
                     "controllers.compute.balance_costs=modeled",
                     "controllers.compute.migration_cost=0.005",
                     "controllers.compute.balance_interval=3",
                     "optimization.checkpoint.strategy=selective"],
}
# Layouts whose checkpoints hold per-rank compression state (``rank<r>/`` keys).
COMPRESSED = {"onebit_adam", "powersgd"}


def _nproc(settings: list[str]) -> int:
    """The world size a layout's degrees multiply to (2 when only one degree is set)."""
    degrees = [int(s.split("=")[1]) for s in settings
               if s.split("=")[0] in ("parallelism.data", "parallelism.tensor",
                                      "parallelism.pipeline")]
    product = 1
    for d in degrees:
        product *= d
    return product if len(degrees) > 1 else 2


def _train(run: Path, settings: list[str], *extra: str) -> None:
    assert launch_in_process("train", *sets(*BASE, *settings), "--nproc", str(_nproc(settings)),
                             "--run-dir", str(run), *extra) == 0


@pytest.fixture(scope="module")
def straight(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Uninterrupted runs of STEPS steps, one per layout, shared by the tests below."""
    runs = {}
    for name, settings in LAYOUTS.items():
        runs[name] = tmp_path_factory.mktemp("straight") / name
        _train(runs[name], settings)
    return runs


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_is_bitwise_identical(layout: str, straight: dict[str, Path],
                                     tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    if layout == "data2":
        capfd.readouterr()
        _train(run, LAYOUTS[layout], "--stop-after", str(SAVED))
        assert f"stopped after step {SAVED} of {STEPS}" in capfd.readouterr().out
        assert len(read_metrics(run)) == SAVED
    else:
        # To keep the suite short, the other layouts stop by losing everything after step SAVED
        # of the straight run (what a crash leaves), which the resume must replay exactly.
        shutil.copytree(straight[layout], run)
        shutil.rmtree(run / "checkpoints" / f"step-{STEPS}")
        (run / "recovery.jsonl").unlink()
    _train(run, LAYOUTS[layout], "--resume")
    assert step_losses(run) == step_losses(straight[layout])
    assert [e["step"] for e in recovery_events(run) if e["event"] == "load"] == [SAVED]
    # Final parameters and optimizer state of every rank, exactly. (RNG states are not compared
    # across the two runs: the global generator is not seeded by the trainer, and training on
    # these settings draws nothing from it.)
    for prefix in ("model/", "optim/"):
        resumed = load_tensors(run / "checkpoints" / f"step-{STEPS}", prefix)
        reference = load_tensors(straight[layout] / "checkpoints" / f"step-{STEPS}", prefix)
        assert reference and resumed.keys() == reference.keys()
        assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    if layout == "moe_experts2":
        records = read_metrics(straight[layout])
        assert records[SAVED - 1]["moe"]["migrations_total"] > 0
        assert (records[-1]["moe"]["migrations_total"]
                > records[SAVED - 1]["moe"]["migrations_total"])
        assert read_metrics(run)[-1]["moe"] == records[-1]["moe"]
        resumed = load_tensors(run / "checkpoints" / f"step-{STEPS}", "rank")
        reference = load_tensors(straight[layout] / "checkpoints" / f"step-{STEPS}", "rank")
        assert any("balancer/" in k for k in reference)
        assert all(torch.equal(resumed[k], reference[k]) for k in reference)
    if layout in COMPRESSED:
        resumed = load_tensors(run / "checkpoints" / f"step-{STEPS}", "rank")
        reference = load_tensors(straight[layout] / "checkpoints" / f"step-{STEPS}", "rank")
        assert {k.split("/")[0] for k in reference} == {"rank0", "rank1"}
        assert resumed.keys() == reference.keys()
        assert all(torch.equal(resumed[k], reference[k]) for k in reference)
        # The replicas' errors differ: they are per-rank state, not copies.
        names = {k.split("/", 1)[1] for k in reference if "error" in k}
        assert any(not torch.equal(reference[f"rank0/{n}"], reference[f"rank1/{n}"])
                   for n in names)


def test_killed_worker_restarts_from_checkpoint(straight: dict[str, Path],
                                                tmp_path: Path) -> None:
    run = tmp_path / "run"
    # Checkpoints every 2 steps. The interval is not part of the computation, so the data-2
    # straight run is the reference. Rank 1 hangs at step 5 on the first start, so the kill
    # lands mid-run however late this process sees the step-2 checkpoint on busy cores.
    # Selective checkpoints: rank 1 (a data-parallel replica) restores from rank 0's single copy.
    proc = subprocess.Popen(
        [sys.executable, "-m", "mcpar.cli", "train",
         *sets(*BASE, *LAYOUTS["data2"], "optimization.checkpoint.interval=2",
               "optimization.checkpoint.strategy=selective"),
         "--nproc", "2", "--run-dir", str(run)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "MCPAR_FAULT_STALL_STEP": "5", "MCPAR_FAULT_RANK": "1"},
    )
    try:
        deadline = time.time() + 120
        while not (run / "checkpoints" / "step-2").exists() and time.time() < deadline:
            time.sleep(0.02)
        pids = worker_pids(run)
        os.kill(pids[1], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, stderr[-3000:]
    assert "restart: attempt 1/3" in stderr and "SIGKILL" in stderr
    events = recovery_events(run)
    restart = next(i for i, e in enumerate(events) if e["event"] == "restart")
    load = next(e for e in events[restart:] if e["event"] == "load")
    assert load["step"] in (2, 4)  # the last checkpoint before the hang
    assert step_losses(run) == step_losses(straight["data2"])
    keys = load_tensors(run / "checkpoints" / f"step-{STEPS}").keys()
    assert {k.split("/")[1] for k in keys if k.startswith("model/")} == {"pp0-tp0"}
    assert {"rng/rank0/cpu", "rng/rank1/cpu"} <= keys


def _flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_corrupt_newest_checkpoint_falls_back(tmp_path: Path) -> None:
    settings = [*TINY, "training.steps=8", "optimization.checkpoint.interval=2",
                "optimization.checkpoint.keep=4"]
    run = tmp_path / "run"
    proc = run_mcpar("train", *sets(*settings), "--nproc", "1", "--run-dir", str(run),
                     "--stop-after", "6")
    assert proc.returncode == 0, proc.stderr
    before = step_losses(run)
    ckpts = run / "checkpoints"
    # Newest: a flipped byte; next: a truncated file; a save killed before its manifest and a
    # leftover .tmp folder must never be taken either.
    _flip_byte(next((ckpts / "step-6").glob("*.distcp")))
    shard = next((ckpts / "step-4").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    shutil.copytree(ckpts / "step-2", ckpts / "step-7")
    (ckpts / "step-7" / "manifest.json").unlink()
    shutil.copytree(ckpts / "step-2", ckpts / "step-8.tmp")
    assert "checksum" in (verify_checkpoint(ckpts / "step-6") or "")
    assert "bytes" in (verify_checkpoint(ckpts / "step-4") or "")
    proc = run_mcpar("train", *sets(*settings), "--nproc", "1", "--run-dir", str(run),
                     "--resume")
    assert proc.returncode == 0, proc.stderr
    events = recovery_events(run)
    invalid = {e["step"]: e["reason"] for e in events if e["event"] == "invalid_checkpoint"}
    assert set(invalid) == {7, 6, 4}
    assert "no manifest" in invalid[7]
    assert [e["step"] for e in events if e["event"] in ("fallback", "load")] == [2, 2]
    assert "fallback" in proc.stderr
    # Steps 3-6 replayed from step 2 give the same losses as the first time, bitwise.
    assert step_losses(run)[:6] == before and len(step_losses(run)) == 8


def test_resume_refuses_another_model(straight: dict[str, Path], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # Both refusals come from the launcher before any worker starts: the CLI's main in this
    # process (were either check gone, workers would start and the exit status would be 0/1).
    run = tmp_path / "run"
    shutil.copytree(straight["data2"], run)
    proc = run_cli_in_process(capsys, "train",
                              *sets(*BASE, *LAYOUTS["data2"], "model.hidden_size=64"),
                              "--nproc", "2", "--run-dir", str(run), "--resume")
    assert proc.returncode == 2 and "model.hidden_size" in proc.stderr
    assert "Traceback" not in proc.stderr
    proc = run_cli_in_process(capsys, "train", *sets(*BASE, *LAYOUTS["data2"]), "--nproc", "2",
                              "--run-dir", str(run))
    assert proc.returncode == 2 and "--resume" in proc.stderr


# Saved at data 4 (global batch 8), resumed under other degrees with the same global batch.
RESHARD_BASE = [*TINY, "training.steps=14", "optimization.checkpoint.interval=10",
                "optimization.global_batch_size=8"]
RESHARD_TARGETS = {
    "data2_tensor2": ["parallelism.data=2", "parallelism.tensor=2",
                      "optimization.micro_batch_size=4"],
    "tensor2_pipeline2": ["parallelism.tensor=2", "parallelism.pipeline=2",
                          "optimization.micro_batch_size=4"],
}


@pytest.fixture(scope="module")
def data4_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("reshard") / "data4"
    assert launch_in_process("train", *sets(*RESHARD_BASE, "parallelism.data=4",
                                            "optimization.micro_batch_size=2"),
                             "--nproc", "4", "--run-dir", str(run)) == 0
    return run


@pytest.mark.parametrize("target", list(RESHARD_TARGETS))
def test_resume_on_another_layout_reshards(data4_run: Path, target: str,
                                           tmp_path: Path) -> None:
    """Saved at data 4, resumed at step 10 under another layout: the first loss after the
    resume equals the data-4 run's at that step within 1e-5, and training continues."""
    run = tmp_path / "run"
    shutil.copytree(data4_run, run)
    assert launch_in_process("train", *sets(*RESHARD_BASE, *RESHARD_TARGETS[target]),
                             "--nproc", "4", "--run-dir", str(run), "--resume") == 0
    (load,) = [e for e in recovery_events(run) if e["event"] == "load"]
    assert load["step"] == 10 and load["resharded_from"]["data"] == 4
    reference = dict(step_losses(data4_run))
    resumed = dict(step_losses(run))
    assert abs(resumed[11] - reference[11]) <= 1e-5, (resumed[11], reference[11])
    for step in (12, 13, 14):  # the next steps follow closely too (fp32 reduction order)
        assert abs(resumed[step] - reference[step]) <= 1e-4


def test_metadata_with_code_is_refused(tmp_path: Path) -> None:
    class Evil:
        def __reduce__(self) -> tuple:
            return (os.system, (f"touch {tmp_path / 'pwned'}",))

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(pickle.UnpicklingError, match="refusing"):
        SafeFileSystemReader(tmp_path).read_metadata()
    # A dotted name must not reach through an allowed module either.
    module, name = b"torch.distributed.checkpoint.filesystem", b"os.system"
    payload = (b"\x80\x04\x8c" + bytes([len(module)]) + module + b"\x94\x8c"
               + bytes([len(name)]) + name + b"\x94\x93\x94.")
    (tmp_path / ".metadata").write_bytes(payload)
    with pytest.raises(pickle.UnpicklingError):
        SafeFileSystemReader(tmp_path).read_metadata()
    assert not (tmp_path / "pwned").exists()


def test_nonfinite_steps_are_skipped_and_counted(tmp_path: Path) -> None:
    """A NaN loss on one rank (injected at steps 3 and 4) poisons the all-reduced gradients:
    every rank skips those updates, the run goes on and counts them."""
    run = tmp_path / "run"
    proc = run_mcpar("train", *sets(*TINY, "training.steps=8"), "--nproc", "2",
                     "--run-dir", str(run), env={"MCPAR_FAULT_NONFINITE_STEPS": "3,4",
                                                 "MCPAR_FAULT_RANK": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    records = read_metrics(run)
    assert [r["skipped"] for r in records] == [False, False, True, True] + [False] * 4
    assert all(r["loss"] == r["loss"] for r in records[4:])  # finite again (not NaN)
    assert json.loads((run / "summary.json").read_text())["skipped_steps"] == 2
    assert "step 3: non-finite loss or gradients" in proc.stdout


def test_too_many_nonfinite_steps_stop_without_restart(tmp_path: Path) -> None:
    run = tmp_path / "run"
    proc = run_mcpar("train", *sets(*TINY, "training.steps=8", "training.max_nonfinite_steps=2",
                                    "optimization.checkpoint.interval=2"),
                     "--nproc", "2", "--run-dir", str(run),
                     env={"MCPAR_FAULT_NONFINITE_STEPS": "4,5,6"})
    assert proc.returncode == 1
    assert "TrainingDiverged: 2 steps in a row had non-finite loss" in proc.stderr
    assert "restart" not in [e["event"] for e in recovery_events(run)]
    assert "restart" not in proc.stdout + proc.stderr


def test_stalled_rank_times_out_names_it_and_the_job_restarts(straight: dict[str, Path],
                                                              tmp_path: Path) -> None:
    """Rank 1 hangs at step 6 (first start only): rank 0's next collective times out after
    training.collective_timeout_s, the failure names the operation and rank 1, and the job
    restarts from the step-4 checkpoint and finishes with the uninterrupted run's losses.
    Neither the checkpoint interval nor the timeout is part of the computation: the data-2
    straight run is the reference."""
    settings = [*BASE, *LAYOUTS["data2"], "optimization.checkpoint.interval=4",
                "training.collective_timeout_s=8"]
    run = tmp_path / "run"
    start = time.monotonic()
    proc = run_mcpar("train", *sets(*settings), "--nproc", "2", "--run-dir", str(run),
                     env={"MCPAR_FAULT_STALL_STEP": "6", "MCPAR_FAULT_RANK": "1"})
    elapsed = time.monotonic() - start
    assert proc.returncode == 0, proc.stderr[-2000:]
    events = recovery_events(run)
    (restart,) = [e for e in events if e["event"] == "restart"]
    assert "timed out" in restart["cause"] and "rank(s) [1] never timed out" in restart["cause"]
    # The collective that stalled is named, not the closing barrier, and the restart follows
    # within the timeout plus the launcher's 2 s wait for other ranks' timeouts and 3 s stop
    # grace: the stall began right after step 5, milliseconds after the step-4 save (a closing
    # barrier would add a second timeout).
    assert "all_reduce on axis 'dp'" in restart["cause"] and "barrier" not in restart["cause"]
    (save_4,) = [e for e in events if e["event"] == "save" and e.get("step") == 4]
    # 7 s for the steps themselves on two busy cores (the suite runs two test files at once):
    # still under the 8 s a second timeout would add.
    assert restart["time"] - save_4["time"] < 8 + 2 + 3 + 7
    assert step_losses(run) == step_losses(straight["data2"])
    # Three starts of Python and torch on loaded cores; a run left to the default 300 s
    # timeout would be far over.
    assert elapsed < 90
