"""Replica consistency checks (``controllers/memory/consistency.py``): one flipped bit on one
rank is found and blamed on that rank (by its own checksum), or on no rank when that cannot be
known, never on the wrong one; the job recovers to an unfaulted run's losses; the checks cost
little at their default interval.

Every faulted run flips one exponent bit before step 3 (``MCPAR_FAULT_BITFLIP_*``, read by
``faults.py``; the unattributable one just before step 4): the check after step 2 passes (the
step-2 checkpoint is saved after it), the check after step 4 finds the flip, the job restarts
from step 2 and runs steps 3 and 4 again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, read_metrics, recovery_events, run_mcpar, sets

from mcpar.config import JobConfig
from mcpar.controllers.memory.consistency import attribute, bit_sum

STEPS = 4
SETTINGS = [*TINY, f"training.steps={STEPS}", "optimization.micro_batch_size=4",
            "optimization.global_batch_size=16", "parallelism.data=2",
            "controllers.memory.consistency_interval=2", "optimization.checkpoint.interval=2",
            "optimization.checkpoint.max_restarts=1", "training.log_interval=1"]


def test_one_flipped_bit_changes_the_bit_sum() -> None:
    t = torch.randn(1000)
    before = bit_sum(t)
    t.view(torch.int32)[123] ^= 1  # the lowest mantissa bit: a change of one ulp
    assert bit_sum(t) != before
    assert bit_sum(torch.zeros(4, dtype=torch.bfloat16)) == 0


def test_attribution_never_guesses() -> None:
    """An own checksum that moved names its rank, even when the replicas agree (a ZeRO-1/2
    owner's shard spread by the all-gather); without one, only a strict majority names ranks:
    two replicas, or a tie, name none."""
    assert attribute([5, 5], [False, False]) is None
    assert attribute([5, 5], [False, True]) == ([1], "checksum")
    assert attribute([5, 6], [True, False]) == ([0], "checksum")
    assert attribute([5, 6], [False, False]) == (None, "unknown")
    assert attribute([5, 6, 5], [False, False, False]) == ([1], "majority")
    assert attribute([5, 6, 5, 6], [False] * 4) == (None, "unknown")
    assert attribute([5, 6, 7], [False] * 3) == (None, "unknown")


def _run(run_dir: Path, stage: int = 0, **fault: str) -> list[tuple]:
    env = {f"MCPAR_FAULT_{k.upper()}": v for k, v in fault.items()}
    if fault:
        env.setdefault("MCPAR_FAULT_BITFLIP_STEP", "3")
    proc = run_mcpar("train", *sets(*SETTINGS, f"controllers.memory.zero_stage={stage}"),
                     "--nproc", "2", "--run-dir", str(run_dir), env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(run_dir)]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("consistency")


class CleanRuns:
    """The unfaulted runs, one per ZeRO stage, each run once for the module."""

    def __init__(self, root: Path):
        self.root, self.runs = root, {}

    def __call__(self, stage: int) -> list[tuple]:
        if stage not in self.runs:
            self.runs[stage] = _run(self.root / f"clean{stage}", stage=stage)
        return self.runs[stage]


@pytest.fixture(scope="module")
def clean(root: Path) -> CleanRuns:
    return CleanRuns(root)


def _mismatches(run_dir: Path) -> list[dict]:
    events = recovery_events(run_dir)
    # The restart resumed from the checkpoint saved before the flip.
    assert [e["step"] for e in events if e["event"] == "load"] == [2]
    return [e for e in events if e["event"] == "replica_mismatch"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_flip_in_a_replica_is_blamed_on_its_rank(root: Path, clean: CleanRuns,
                                                   rank: int) -> None:
    """The first parameter's first element flips on ``rank``: that rank's own checksum moved
    before step 3's update, so the check after step 4 names it (rank 0 as well as rank 1,
    where a vote of two replicas could only guess)."""
    run_dir = root / f"replica{rank}"
    faulted = _run(run_dir, rank=str(rank), bitflip_target="param")
    (found,) = _mismatches(run_dir)
    assert (found["tensor"], found["step"], found["axis"], found["ranks"],
            found["attribution"], found["changed_at"], found["shard"]) == \
        ("0.embed.tok.weight", 4, "dp", [rank], "checksum", 3, False)
    assert faulted == clean(0) and len(faulted) == STEPS


def test_a_flip_in_a_zero1_owners_shard_is_blamed_on_the_owner(root: Path,
                                                               clean: CleanRuns) -> None:
    """Rank 1's own ZeRO-1 shard flips: its update and all-gather give every replica the
    corrupt value (the replicas agree), and rank 1's checksums of the shard and of the
    parameter it falls in name it."""
    run_dir = root / "zero1"
    faulted = _run(run_dir, stage=1, rank="1", bitflip_target="shard")
    found = _mismatches(run_dir)
    assert {(f["shard"], f["replicas_agree"]) for f in found} == {(True, False), (False, True)}
    assert all((f["ranks"], f["attribution"], f["step"], f["changed_at"])
               == ([1], "checksum", 4, 3) for f in found), found
    assert faulted == clean(1)


def test_a_flip_in_a_zero3_shard_is_blamed_on_its_rank(root: Path,
                                                       clean: CleanRuns) -> None:
    """Rank 0's ZeRO-3 parameter shard flips (no other rank holds those elements)."""
    run_dir = root / "zero3"
    faulted = _run(run_dir, stage=3, rank="0", bitflip_target="shard")
    (found,) = _mismatches(run_dir)
    assert found["tensor"].endswith(".shard") and found["shard"]
    assert (found["ranks"], found["attribution"], found["step"], found["changed_at"]) == \
        ([0], "checksum", 4, 3)
    assert faulted == clean(3)


def test_a_flip_no_window_covers_is_reported_without_a_rank(root: Path,
                                                            clean: CleanRuns) -> None:
    """Rank 1's parameter flips right after step 3's update, before its checksum is recorded:
    no own checksum moved, two replicas have no majority, so no rank is named (rather than
    rank 0 by a tie); the job still restarts and recovers."""
    run_dir = root / "unknown"
    faulted = _run(run_dir, rank="1", bitflip_target="update", bitflip_step="4")
    (found,) = _mismatches(run_dir)
    assert (found["tensor"], found["step"], found["ranks"], found["attribution"]) == \
        ("0.embed.tok.weight", 4, None, "unknown")
    assert faulted == clean(0)


def test_the_checks_cost_little(root: Path, clean: CleanRuns) -> None:
    """The checks (every ``consistency_interval`` steps, 2 here) cost under 2% of the step
    time at the default interval. The own checksums run every step: two sums per tensor, a
    fixed cost of kernel launches on a model this small (~25 tensors of a few kB: about 1 ms
    of a 30 ms step on shared CPUs), bandwidth-bound and far smaller relative to the step on a
    real model; bounded here at 10%."""
    clean(0)
    summary = json.loads((root / "clean0" / "summary.json").read_text())["consistency"]
    assert summary["checks"] == STEPS // 2
    step_s = sum(r["step_time_s"] for r in read_metrics(root / "clean0")) / STEPS
    per_step = summary["checksum_seconds"] / (STEPS + 1)  # and one record at the start
    per_check = (summary["seconds"] - summary["checksum_seconds"]) / summary["checks"]
    default = JobConfig().controllers.memory.consistency_interval
    assert per_check / (default * step_s) < 0.02, (per_check, step_s)
    assert per_step / step_s < 0.10, (per_step, step_s)
