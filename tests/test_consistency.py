"""Replica consistency checks (``controllers/memory/consistency.py``): one flipped bit in one
replica is found, named and recovered from; the check costs little at its default interval."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from conftest import TINY, read_metrics, recovery_events, run_mcpar, sets

from mcpar.config import JobConfig
from mcpar.controllers.memory.consistency import bit_sum

SETTINGS = [*TINY, "training.steps=8", "optimization.micro_batch_size=4",
            "optimization.global_batch_size=16", "parallelism.data=2",
            "controllers.memory.consistency_interval=2", "optimization.checkpoint.interval=2",
            "optimization.checkpoint.max_restarts=1", "training.log_interval=1"]


def test_one_flipped_bit_changes_the_bit_sum() -> None:
    t = torch.randn(1000)
    before = bit_sum(t)
    t.view(torch.int32)[123] ^= 1  # the lowest mantissa bit: a change of one ulp
    assert bit_sum(t) != before
    assert bit_sum(torch.zeros(4, dtype=torch.bfloat16)) == 0


def _run(run_dir: Path, env: dict[str, str] | None = None) -> list[tuple]:
    proc = run_mcpar("train", *sets(*SETTINGS), "--nproc", "2", "--run-dir", str(run_dir),
                     env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


def test_a_flipped_bit_is_reported_and_the_run_recovers(tmp_path: Path) -> None:
    """Rank 1's first parameter gets one exponent bit flipped before step 3: the check after
    step 4 names that tensor, the step and rank 1 in recovery.jsonl, the job restarts from the
    step-2 checkpoint (saved before the flip) and its losses are those of an unfaulted run, bit
    for bit. The unfaulted run's checks cost under 2% of its step time at the default interval
    (they run every 2 steps here)."""
    clean = _run(tmp_path / "clean")
    faulted = _run(tmp_path / "faulted", env={"MCPAR_FAULT_RANK": "1",
                                              "MCPAR_FAULT_BITFLIP_STEP": "3"})
    events = recovery_events(tmp_path / "faulted")
    (mismatch,) = [e for e in events if e["event"] == "replica_mismatch"]
    assert (mismatch["tensor"], mismatch["step"], mismatch["axis"], mismatch["ranks"]) == \
        ("0.embed.tok.weight", 4, "dp", [1])
    assert [e["step"] for e in events if e["event"] == "load"] == [2]
    assert faulted == clean and len(clean) == 8
    summary = json.loads((tmp_path / "clean" / "summary.json").read_text())
    per_check = summary["consistency"]["seconds"] / summary["consistency"]["checks"]
    step_s = sum(r["step_time_s"] for r in read_metrics(tmp_path / "clean")) / 8
    default = JobConfig().controllers.memory.consistency_interval
    assert summary["consistency"]["checks"] == 4
    assert per_check / (default * step_s) < 0.02, (per_check, step_s)
