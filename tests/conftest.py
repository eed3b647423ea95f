"""Shared helpers: run the real `mcpar` CLI in a subprocess on a tiny model."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mcpar.config import load_config
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.launch.env import DistEnv
from mcpar.launch.local import local_worker_pids
from mcpar.metrics import read_metrics
from mcpar.plan import resolve_plan
from mcpar.topology import ParallelDims
from mcpar.trainer import Trainer

REPO = Path(__file__).resolve().parents[1]

# A model small enough that a 20-step multi-process run takes seconds on 2 cores.
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5",
]


def run_mcpar(*args: str, timeout: float = 300, cwd: Path | None = None,
              env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "mcpar.cli", *args], capture_output=True, text=True,
        timeout=timeout, cwd=cwd or REPO, env=full_env,
    )


def run_cli_in_process(capsys: pytest.CaptureFixture[str],
                       *args: str) -> subprocess.CompletedProcess[str]:
    """``mcpar ARGS`` through ``mcpar.cli.main`` in this process: for commands that stop at a
    user error before starting workers, without a Python start-up per case."""
    from mcpar.cli import main

    capsys.readouterr()
    code = main(list(args))
    out, err = capsys.readouterr()
    return subprocess.CompletedProcess(["mcpar", *args], code, out, err)


def launch_in_process(*args: str) -> int:
    """``mcpar train ARGS`` of a multi-worker job through ``mcpar.cli.main`` in this process: the
    launcher's validation, run directory and ``launch_local`` as ever, its workers real
    processes, without a Python start-up and torch import for the launcher itself (about 4 s of
    CPU per job). The exit status; the output goes where the test's output goes (``capfd``).
    Single-process jobs train inside the launcher: run those with ``run_mcpar``."""
    from mcpar.cli import main

    assert args[0] == "train" and "--nproc" in args and int(args[args.index("--nproc") + 1]) > 1
    with contextlib.chdir(REPO):
        return main(list(args))


def sets(*items: str) -> list[str]:
    out: list[str] = []
    for item in items:
        out += ["--set", item]
    return out


def train_metrics(run_dir: Path, nproc: int, settings: list[str]) -> list[dict]:
    """Train with ``settings`` on ``nproc`` workers; the run's metrics.jsonl records."""
    args = ["train", *sets(*settings), "--nproc", str(nproc), "--run-dir", str(run_dir)]
    if nproc > 1:
        assert launch_in_process(*args) == 0, "see the captured output"
    else:
        proc = run_mcpar(*args, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return read_metrics(run_dir)


def assert_loss_parity(reference: list[dict], records: list[dict], label: str) -> None:
    """DESIGN.md §5: the same number of steps, |dloss| <= 1e-4 over the first 10 steps and
    <= 1e-3 through the rest, and a loss that really went down."""
    assert len(records) == len(reference)
    for ref, rec in zip(reference, records, strict=True):
        diff = abs(ref["loss"] - rec["loss"])
        bound = 1e-4 if rec["step"] <= 10 else 1e-3
        assert diff <= bound, f"{label} step {rec['step']}: |dloss| = {diff:.2e}"
    assert records[-1]["loss"] < records[0]["loss"] - 0.5


@pytest.fixture
def tiny_sets() -> list[str]:
    return sets(*TINY)


def step_losses(run_dir: Path) -> list[tuple[int, float]]:
    """(step, loss) of every step a run logged, in order."""
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def recovery_events(run_dir: Path) -> list[dict]:
    """The run's recovery log (saves, loads, failures, fallbacks), one dict per line."""
    return [json.loads(line)
            for line in (run_dir / "recovery.jsonl").read_text().splitlines()]


def worker_pids(run_dir: Path) -> dict[int, int]:
    """RANK -> pid of the live mcpar workers of the job whose run directory is ``run_dir``."""
    return local_worker_pids(run_dir)


def spawn_workers(fn: Callable[..., None], args: tuple = (), nprocs: int = 1,
                  join: bool = True) -> None:
    """``mp.spawn(fn, args, nprocs, join)``, the workers forked from this process instead of
    started afresh: real processes on gloo all the same, without a Python start-up and torch
    import per worker (about 4 s of CPU each, most of a multi-process test's time on 2 cores).
    Every worker sets its own thread count (one) before computing, as under spawn."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="fork")


def train_in_turn(rank: int, port: int, root: str, runs: dict[str, list[str]],
                  world: int) -> None:
    """One worker of a ``spawn_workers`` launch: every named run's settings trained in turn
    (``Trainer.train`` into ``root/name``) on one process group, then closed."""
    torch.set_num_threads(1)
    env = DistEnv(rank, world, rank, world, "127.0.0.1", port, "mcpar")
    for name, settings in runs.items():
        run_dir = Path(root) / name
        run_dir.mkdir(exist_ok=True)
        Trainer(resolve_plan(load_config(None, settings), world), run_dir, env).train()
    dist.barrier()
    dist.destroy_process_group()


@contextlib.contextmanager
def data_parallel_comm(rank: int, world: int, port: int) -> Iterator[CommunicationController]:
    """Inside a ``spawn_workers`` worker: a gloo process group of ``world`` ranks on loopback, one
    thread, and a CommunicationController over a pure data-parallel mesh; torn down after."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        dims = ParallelDims(dp=world, tp=1, pp=1, ep=1, world_size=world)
        dims.build_mesh("cpu")
        yield CommunicationController(dims)
    finally:
        dist.destroy_process_group()


def expect_exit(proc: subprocess.CompletedProcess[str], code: int, *needles: str) -> None:
    """``proc`` exited with ``code``, without a traceback, its stderr holding every needle."""
    assert proc.returncode == code, (proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr
    for needle in needles:
        assert needle in proc.stderr, proc.stderr


def read_csv_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(header, rows) of a CSV file."""
    with path.open() as fh:
        reader = csv.DictReader(fh)
        return list(reader.fieldnames or []), list(reader)


def write_csv_rows(path: Path, header: list[str], data: list[dict[str, str]]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=header, lineterminator="\n")
        writer.writeheader()
        writer.writerows(data)


class TimeLimitExceeded(BaseException):
    """A block ran past its ``time_limit``. Not an OSError (TimeoutError is one, so an ``except
    OSError`` in the code under test would swallow the hang it should report), nor an Exception
    (which a broad ``except Exception`` would swallow): only the test sees it."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise TimeLimitExceeded in this thread when the block runs past ``seconds`` (a hang, e.g.
    a FIFO opened for reading, fails the fuzz case instead of the suite)."""
    def expire(signum: int, frame: object) -> None:
        raise TimeLimitExceeded(f"no answer within {seconds} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
