"""A node lost for good on the emulated cluster: the job shrinks and goes on (training.elastic).

Why this test: a 2-node job (2 ranks per node, data 4) under ``torchrun --nnodes 1:2`` loses one
node's agent and workers to SIGKILL. The surviving node must notice, re-rendezvous alone and
train on data 2 with twice the micro-batches, from the newest valid checkpoint, within 60 s of
the loss; its first step's loss must equal that of a 2-rank job resumed from the same
checkpoint by mcpar's own launcher (the same global batch, so the same sequences); the run
directory must hold each step once; recovery.jsonl must name both layouts. Without the
elastic re-plan the surviving node's workers refuse the 2-rank world (exit 2) and the job
ends.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

import netcluster
from mcpar.metrics import read_metrics
from netcluster import NetCluster
from netcluster.elastic import ElasticJob
from tests.conftest import REPO, launch_in_process, recovery_events

OK, WHY = netcluster.available()
needs_netns = pytest.mark.skipif(not OK, reason=f"emulated cluster unavailable: {WHY}")

STEPS, INTERVAL, KILL_AFTER = 150, 3, 7


def write_config(tmp_path: Path) -> Path:
    text = tmp_path / "corpus.txt"
    line = "the quick brown fox jumps over the lazy dog; pack my box with five dozen jugs. "
    text.write_text("".join(f"{i}: {line}\n" for i in range(3000)))
    cfg = {
        "model": {"num_layers": 2, "hidden_size": 32, "num_heads": 2, "seq_len": 32},
        "data": {"source": str(text)},
        "parallelism": {"data": 4},
        "optimization": {"micro_batch_size": 2, "warmup_steps": 5,
                         "checkpoint": {"interval": INTERVAL, "keep": 50}},
        "training": {"steps": STEPS, "device": "cpu", "progress": False, "eval_interval": 0,
                     "eval_batches": 1, "elastic": {"min_world": 2, "wait_s": 20}},
    }
    path = tmp_path / "elastic.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _records(run_dir: Path) -> list[dict]:
    try:
        return read_metrics(run_dir)
    except (OSError, ValueError):  # absent, or a line being written
        return []


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except OSError:
        return None


def _wait_for(predicate, timeout_s: float, job: ElasticJob, what: str) -> float:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return time.monotonic()
        if all(p.poll() is not None for k, p in enumerate(job.procs) if k not in job.lost):
            break
        time.sleep(0.05)
    job.close()
    raise AssertionError(f"{what} did not happen\n" + "\n".join(
        f"--- node {k}\n{job.output(k)[-4000:]}" for k in range(len(job.procs))))


@needs_netns
def test_a_lost_node_shrinks_the_job_and_training_goes_on(tmp_path: Path) -> None:
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    metrics = run_dir / "metrics.jsonl"
    argv = ["-m", "mcpar.cli", "train", str(config), "--run-dir", str(run_dir)]
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO / "src"))}
    with NetCluster(2, rate="1gbit", delay="0.5ms") as cluster:
        job = ElasticJob(cluster, 2, argv, env=env, cwd=str(REPO))
        try:
            _wait_for(lambda: len(_records(run_dir)) >= KILL_AFTER, 240, job,
                      f"step {KILL_AFTER} on 2 nodes")
            before = _inode(metrics)
            killed = job.kill_node(1)
            reached = max(r["step"] for r in _records(run_dir))

            def shrunk_step() -> bool:
                events = [e for e in recovery_events(run_dir) if e["event"] == "elastic"] \
                    if (run_dir / "recovery.jsonl").exists() else []
                if not events or _inode(metrics) == before:
                    return False  # not resumed yet (a resume rewrites metrics.jsonl)
                return any(r["step"] == events[-1]["step"] + 1 for r in _records(run_dir))

            first_step = _wait_for(shrunk_step, 120, job, "the first step on 1 node")
            codes = job.wait(300)
        finally:
            job.close()
    timeline = "".join(line for line in job.output(0, since=killed).splitlines(True)
                       if "mcpar:" in line or "failed" in line)
    assert codes[0] == 0, job.output(0)[-4000:]
    # The agents share their store (torch's default): growing back could not work, and the
    # job says so at its start.
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for the job to grow back" in job.output(0)
    shrink_s = first_step - killed
    elastic = [e for e in recovery_events(run_dir) if e["event"] == "elastic"]
    assert len(elastic) == 1, elastic
    record, resume_step = elastic[0], elastic[0]["step"]
    print(f"\nelastic: kill -> first step on 1 node {shrink_s:.1f} s; resumed from step "
          f"{resume_step}, killed after step {reached}\n{timeline}")
    assert shrink_s < 60
    assert record["direction"] == "shrink"
    assert (record["from"]["world_size"], record["from"]["data"],
            record["from"]["num_microbatches"]) == (4, 4, 1)
    assert (record["to"]["world_size"], record["to"]["data"],
            record["to"]["num_microbatches"]) == (2, 2, 2)
    assert record["from"]["global_batch_size"] == record["to"]["global_batch_size"] == 8
    # The newest checkpoint committed before the kill (one in flight then is not valid).
    assert resume_step % INTERVAL == 0 and 0 < resume_step <= reached
    # One record per step, 1..STEPS, the global batch (tokens) the same throughout.
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert len({r["tokens"] for r in records}) == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert (summary["final_step"], summary["resumed_from_step"]) == (STEPS, resume_step)
    saves = [e["step"] for e in recovery_events(run_dir) if e["event"] == "save"]
    assert saves == sorted(set(saves))  # each checkpoint saved once

    # The reference: the same checkpoint resumed on 2 ranks by mcpar's own launcher.
    ref = tmp_path / "ref"
    shutil.copytree(run_dir / "checkpoints" / f"step-{resume_step}",
                    ref / "checkpoints" / f"step-{resume_step}")
    assert launch_in_process("train", str(config), "--nproc", "2", "--resume", "--run-dir",
                             str(ref), "--stop-after", str(resume_step + 1)) == 0
    ref_first = next(r for r in read_metrics(ref) if r["step"] == resume_step + 1)
    got = next(r for r in records if r["step"] == resume_step + 1)
    diff = abs(got["loss"] - ref_first["loss"])
    print(f"elastic: first loss {got['loss']:.8f}, reference {ref_first['loss']:.8f}, "
          f"|diff| {diff:.2e}")
    assert diff <= 1e-6
    assert got["tokens"] == ref_first["tokens"]  # the same global batch


GROW_STEPS = 400


@needs_netns
def test_a_node_that_comes_back_grows_the_job_again(tmp_path: Path) -> None:
    """After the shrink, node 1's agent is started again: the agents re-rendezvous on 2 nodes,
    the surviving workers stop with a checkpoint of their step (SIGTERM), and the 4-rank world
    resumes it resharded onto data 4. Its first loss must equal a 4-rank resume of that
    checkpoint by mcpar's own launcher; every step is in the run directory once."""
    config, run_dir = write_config(tmp_path), tmp_path / "run"
    text = json.loads(config.read_text())
    text["training"]["steps"] = GROW_STEPS
    text["optimization"]["checkpoint"]["keep"] = GROW_STEPS  # the grow's is compared at the end
    config.write_text(json.dumps(text))
    argv = ["-m", "mcpar.cli", "train", str(config), "--run-dir", str(run_dir)]
    # The agents must not share their rendezvous store with the workers: rank 0's agent keeps
    # the store address of its first round and never writes it for a later one, so a node that
    # comes back waits for it forever (torch's dynamic rendezvous).
    env = {"PYTHONPATH": os.environ.get("PYTHONPATH", str(REPO / "src")),
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}

    def elastic() -> list[dict]:
        if not (run_dir / "recovery.jsonl").exists():
            return []
        return [e for e in recovery_events(run_dir) if e["event"] == "elastic"]

    with NetCluster(2, rate="1gbit", delay="0.5ms") as cluster:
        job = ElasticJob(cluster, 2, argv, env=env, cwd=str(REPO))
        try:
            _wait_for(lambda: len(_records(run_dir)) >= KILL_AFTER, 240, job,
                      f"step {KILL_AFTER} on 2 nodes")
            job.kill_node(1)
            _wait_for(lambda: len(elastic()) == 1 and any(
                r["step"] > elastic()[0]["step"] + 2 for r in _records(run_dir)), 120, job,
                "training on 1 node")
            back = job.restart_node(1)
            grown = _wait_for(lambda: len(elastic()) == 2, 120, job, "the grow")
            codes = job.wait(400)
        finally:
            job.close()
    timeline = "".join(line for line in job.output(0, since=back).splitlines(True)
                       if "mcpar:" in line or "failed" in line)
    assert codes == [0, 0], job.output(0)[-3000:] + job.output(1)[-3000:]
    assert "grow back" not in job.output(0)  # no warning: the agents' store is not shared
    shrink, grow = elastic()
    print(f"\nelastic: node back -> grow record {grown - back:.1f} s; shrunk at step "
          f"{shrink['step']}, grew at step {grow['step']}\n{timeline}")
    assert (shrink["direction"], grow["direction"]) == ("shrink", "grow")
    assert (grow["from"]["world_size"], grow["from"]["data"],
            grow["from"]["num_microbatches"]) == (2, 2, 2)
    assert (grow["to"]["world_size"], grow["to"]["data"],
            grow["to"]["num_microbatches"]) == (4, 4, 1)
    assert grow["from"]["global_batch_size"] == grow["to"]["global_batch_size"] == 8
    assert grow["step"] > shrink["step"]
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, GROW_STEPS + 1))
    assert len({r["tokens"] for r in records}) == 1
    saves = [e["step"] for e in recovery_events(run_dir) if e["event"] == "save"]
    assert grow["step"] in saves  # the checkpoint the survivors wrote as they were stopped

    ref = tmp_path / "ref"
    shutil.copytree(run_dir / "checkpoints" / f"step-{grow['step']}",
                    ref / "checkpoints" / f"step-{grow['step']}")
    assert launch_in_process("train", str(config), "--nproc", "4", "--resume", "--run-dir",
                             str(ref), "--stop-after", str(grow["step"] + 1)) == 0
    ref_first = next(r for r in read_metrics(ref) if r["step"] == grow["step"] + 1)
    got = next(r for r in records if r["step"] == grow["step"] + 1)
    print(f"elastic: first loss after the grow {got['loss']:.8f}, reference "
          f"{ref_first['loss']:.8f}, |diff| {abs(got['loss'] - ref_first['loss']):.2e}")
    assert abs(got["loss"] - ref_first["loss"]) <= 1e-6
