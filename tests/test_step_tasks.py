"""The ComputeController owns the step: its task log shows, on data 2 x pipeline 2, each stage's
data-parallel reduction starting during its last backward, before the schedule ends."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import TINY, spawn_workers

from mcpar.config import apply_overrides, parse_config
from mcpar.launch.env import DistEnv, find_free_port
from mcpar.plan import resolve_plan
from mcpar.trainer import Trainer

WORLD = 4
LAYOUT = ["parallelism.pipeline=2", "model.num_layers=4", "optimization.micro_batch_size=2",
          "optimization.gradient_accumulation=4", "parallelism.schedule=1f1b",
          # Small buckets: each stage has several, so the first fills early in the backward.
          "controllers.communication.bucket_size_mb=0.02"]


def worker(rank: int, port: int, overlap: bool, out_dir: str) -> None:
    torch.set_num_threads(1)
    cfg = parse_config(apply_overrides({}, [
        *TINY, *LAYOUT, f"controllers.communication.overlap={str(overlap).lower()}"]))
    plan = resolve_plan(cfg, WORLD)
    run_dir = Path(out_dir) / "run"
    env = DistEnv(rank, WORLD, rank, WORLD, "127.0.0.1", port, "mcpar")
    trainer = Trainer(plan, run_dir, env)
    try:
        trainer.train_step(0)
        trainer.train_step(1)  # the second step: nothing left of start-up
        log = [vars(r) for r in trainer.compute.task_log]
        exposed = trainer.compute.exposed_comm_s()
        trainer.logger.close()
    finally:
        trainer.close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps({"log": log, "exposed": exposed}))


def task_logs(tmp: Path, overlap: bool) -> list[dict]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    out = tmp / ("overlap" if overlap else "no_overlap")
    out.mkdir()
    (out / "run").mkdir()
    spawn_workers(worker, args=(find_free_port(), overlap, str(out)), nprocs=WORLD, join=True)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def logs(tmp_path_factory: pytest.TempPathFactory) -> dict[bool, list[dict]]:
    tmp = tmp_path_factory.mktemp("step_tasks")
    return {overlap: task_logs(tmp, overlap) for overlap in (True, False)}


def _last_backward_end(log: list[dict]) -> float:
    return max(r["end"] for r in log if r["name"] == "backward")


@pytest.mark.slow
def test_reductions_start_before_the_last_backward_ends(logs: dict[bool, list[dict]]) -> None:
    for rank, rec in enumerate(logs[True]):
        log = rec["log"]
        starts = [r["start"] for r in log if r["name"] == "reduce_start"]
        assert starts, f"rank {rank}: no bucket reduction was started"
        armed = [r["start"] for r in log if r["name"] == "sync_grads"]
        assert len(armed) == 1  # one chunk per rank: armed once, before its last backward
        assert armed[0] <= min(starts)
        # The first bucket's reduction starts while the last micro-batch's backward runs.
        assert min(starts) < _last_backward_end(log), rank
        names = [r["name"] for r in log if r["name"] != "reduce_start"]
        assert names[-3:] == ["wait_sends", "wait_grads", "optimizer_step"]
        assert names.count("forward") == names.count("backward") == 4


@pytest.mark.slow
def test_without_overlap_every_reduction_waits_for_the_schedule(
        logs: dict[bool, list[dict]]) -> None:
    # The baseline the overlap is measured against: the same test must be able to fail.
    for rec in logs[False]:
        log = rec["log"]
        starts = [r["start"] for r in log if r["name"] == "reduce_start"]
        assert starts and min(starts) >= _last_backward_end(log)
