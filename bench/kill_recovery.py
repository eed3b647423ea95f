"""Kill recovery: SIGKILL a random rank at a random step, the job restarts itself and matches.

What it measures
    The fault-tolerance issue's "Kill" check. One uninterrupted reference job (``mcpar train``
    with ``--nproc`` workers on the CPU, a tiny GPT, ``training.steps=--steps``, a checkpoint
    every ``--interval`` steps, a fixed ``training.seed``) is run first. Then each of ``--trials``
    trials starts the same job in a new run directory, picks a random rank in ``[0, nproc)`` and
    a random kill step in ``(interval, steps - 1]``, watches ``metrics.jsonl`` until the last
    logged step is ``>= kill step`` *and* the first checkpoint is committed (a ``step-N`` folder
    holding its manifest: saves are asynchronous by default and can commit a few steps after
    their step), and SIGKILLs that rank's worker process (found through ``/proc`` by its
    command line ``-m mcpar.launch.worker <run dir>`` and its rank,
    ``mcpar.launch.local.local_worker_pids``; only a first-start worker,
    ``MCPAR_RESTART_COUNT=0``, is ever killed). Nothing else is done to the job: the mcpar
    launcher must notice the death, tear the job down and restart it by itself from the newest
    valid checkpoint (``optimization.checkpoint.max_restarts``, 3 by default with checkpoints
    on), and the job must finish with exit code 0.

    Per trial it reports the rank and kill step drawn, the last step logged when the signal was
    sent (``killed_at_logged_step``; the watcher polls every few milliseconds, so it may be a
    step or so past ``kill_step``, more when the first checkpoint committed late), the newest
    committed checkpoint just before the signal, whether the worker was found (the search is
    retried for a few seconds) and killed, the job's exit code, the ``restart`` events and the
    step of the ``load`` that followed the first restart in ``<run>/recovery.jsonl``, whether
    the losses equal the reference's, and the wall time of the whole job (start, kill,
    restart, finish). ``loaded_step`` may exceed ``newest_checkpoint_at_kill`` when a save in
    flight committed in the moment between the listing and the signal, or while the job was
    being torn down; it is never lower unless recovery skipped a valid checkpoint.

What "equal" means
    ``metrics.jsonl`` is rewritten on resume (the records after the restored step are dropped),
    so a finished run has one record per step. The trial's ``{step: loss}`` map must equal the
    reference's exactly: the same steps ``1..steps`` and the same float32 losses compared with
    ``==`` (bitwise; CPU training in fp32 is deterministic, and a resume restores parameters,
    optimizer state, RNG states and the data position). No tolerance is applied.

How to run
    python bench/kill_recovery.py [--trials 10] [--seed 0] [--steps 30] [--interval 5]
                                  [--layout data2|tensor2|pipeline2|data2_tensor2]
                                  [--set KEY=VALUE ...] [--keep-runs DIR]

    ``--set`` items come after the layout's, so they override it (e.g. ``--set
    parallelism.data=1 --set parallelism.tensor=2``); the number of workers is the product of
    the data, tensor and pipeline degrees (``--nproc`` overrides it). Prints one JSON object on
    stdout (``reference``, ``trials``, ``summary``); progress goes to stderr. Exits 0 only if
    every trial's job was killed, restarted by itself, finished with code 0 and matched the
    reference.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from mcpar.launch.local import local_worker_pids

REPO = Path(__file__).resolve().parents[1]

# A model small enough that a 30-step, 2-process run takes seconds on 2 cores.
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5",
]
LAYOUTS: dict[str, list[str]] = {
    "data2": ["parallelism.data=2"],
    "tensor2": ["parallelism.tensor=2"],
    "pipeline2": ["parallelism.pipeline=2", "optimization.gradient_accumulation=2",
                  "optimization.micro_batch_size=8"],
    "data2_tensor2": ["parallelism.data=2", "parallelism.tensor=2",
                      "optimization.micro_batch_size=8"],
}
DEGREES = ("parallelism.data", "parallelism.tensor", "parallelism.pipeline")
MANIFEST = "manifest.json"
POLL_S = 0.003
FIND_RETRY_S = 5.0


def log(message: str) -> None:
    print(f"[kill_recovery] {message}", file=sys.stderr, flush=True)


def settings_for(args: argparse.Namespace) -> list[str]:
    return [*TINY, f"training.steps={args.steps}", f"training.seed={args.train_seed}",
            f"optimization.checkpoint.interval={args.interval}", *LAYOUTS[args.layout],
            *args.set]


def world_size(settings: list[str]) -> int:
    """The product of the data, tensor and pipeline degrees (the last setting of each wins)."""
    degrees = {key: 1 for key in DEGREES}
    for item in settings:
        key, _, value = item.partition("=")
        if key in degrees:
            degrees[key] = int(value)
    product = 1
    for degree in degrees.values():
        product *= degree
    return product


def command(run_dir: Path, nproc: int, settings: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", str(nproc),
           "--run-dir", str(run_dir)]
    for item in settings:
        cmd += ["--set", item]
    return cmd


def losses(run_dir: Path) -> dict[int, float]:
    """step -> loss from a finished run's metrics.jsonl (one record per step)."""
    out: dict[int, float] = {}
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return out
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            if record["step"] in out:
                raise ValueError(f"{path}: step {record['step']} logged twice")
            out[record["step"]] = record["loss"]
    return out


def last_logged_step(run_dir: Path) -> int:
    """The step of the last complete line of metrics.jsonl (0 when none yet)."""
    try:
        text = (run_dir / "metrics.jsonl").read_text()
    except OSError:
        return 0
    for line in reversed(text.split("\n")[:-1]):  # the part after the last newline may be torn
        if line.strip():
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
    return 0


def committed_steps(run_dir: Path) -> list[int]:
    """Steps of the committed checkpoints: ``step-N`` folders holding their manifest (a save
    in progress is a ``step-N.tmp`` folder, renamed only after its manifest is written)."""
    try:
        entries = list((run_dir / "checkpoints").iterdir())
    except OSError:
        return []
    steps = []
    for entry in entries:
        name = entry.name
        if name.startswith("step-") and name[5:].isdigit() and (entry / MANIFEST).exists():
            steps.append(int(name[5:]))
    return sorted(steps)


def events(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "recovery.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def worker_pids(run_dir: Path) -> dict[int, int]:
    """RANK -> pid of the job's live workers of its first start (``mcpar.launch.local``'s
    ``local_worker_pids``)."""
    return local_worker_pids(run_dir, first_start_only=True)


def run_reference(run_dir: Path, nproc: int, settings: list[str]) -> dict[str, Any]:
    t0 = time.perf_counter()
    proc = subprocess.run(command(run_dir, nproc, settings), cwd=REPO, capture_output=True,
                          text=True, timeout=1800)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"reference run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return {"run_dir": str(run_dir), "wall_s": round(wall, 2), "losses": losses(run_dir)}


def run_trial(index: int, run_dir: Path, nproc: int, settings: list[str], rank: int,
              kill_step: int, reference: dict[int, float], timeout_s: float) -> dict[str, Any]:
    result: dict[str, Any] = {"trial": index, "rank": rank, "kill_step": kill_step}
    t0 = time.perf_counter()
    stderr_path = run_dir.with_name(run_dir.name + ".stderr")
    killed_at: int | None = None
    found = killed = False
    newest_at_kill: int | None = None
    note: str | None = None
    with open(stderr_path, "w") as stderr_file:
        proc = subprocess.Popen(command(run_dir, nproc, settings), cwd=REPO,
                                stdout=subprocess.DEVNULL, stderr=stderr_file,
                                start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            pid: int | None = None
            # Find the worker while the job starts, then wait for the kill step and for the
            # first checkpoint's commit (asynchronous saves can commit several steps late).
            while proc.poll() is None and time.monotonic() < deadline:
                if pid is None:
                    pid = worker_pids(run_dir).get(rank)
                if last_logged_step(run_dir) >= kill_step and committed_steps(run_dir):
                    break
                time.sleep(POLL_S)
            if proc.poll() is None and time.monotonic() < deadline:
                logged = last_logged_step(run_dir)
                # Check the pid again (it must still be this run's first-start worker of that
                # rank) and retry the search for a few seconds if it was not found yet.
                find_deadline = time.monotonic() + FIND_RETRY_S
                while True:
                    current = worker_pids(run_dir).get(rank)
                    if current is not None:
                        if pid is not None and pid != current:
                            note = f"worker pid changed from {pid} to {current} before the kill"
                        pid = current
                        break
                    if proc.poll() is not None or time.monotonic() > find_deadline:
                        break
                    time.sleep(0.01)
                if current is not None:
                    found = True
                    try:
                        committed = committed_steps(run_dir)
                        os.kill(current, signal.SIGKILL)
                        killed = True
                        killed_at = logged
                        newest_at_kill = max(committed, default=None)
                    except ProcessLookupError:
                        note = f"rank {rank}'s worker {current} exited before the signal"
                else:
                    note = (f"rank {rank}'s worker not found within {FIND_RETRY_S:.0f} s of "
                            f"step {logged}")
            elif proc.poll() is not None:
                note = (f"the job exited (code {proc.returncode}) before step {kill_step} "
                        "and a committed checkpoint were seen")
            else:
                note = "timed out before the kill step"
            remaining = max(1.0, deadline - time.monotonic())
            try:
                proc.wait(timeout=remaining)
            except subprocess.TimeoutExpired:
                note = (note + "; " if note else "") + f"job did not exit within {timeout_s} s"
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    wall = time.perf_counter() - t0
    recovery = events(run_dir)
    restarts = [e for e in recovery if e["event"] == "restart"]
    loaded_step: int | None = None
    if restarts:
        first = recovery.index(restarts[0])
        loaded_step = next((e["step"] for e in recovery[first:] if e["event"] == "load"), None)
    try:
        got = losses(run_dir)
    except ValueError as exc:
        got = {}
        note = (note + "; " if note else "") + str(exc)
    equal = got == reference
    mismatch = None
    if not equal:
        steps = sorted(set(got) | set(reference))
        bad = [s for s in steps if got.get(s) != reference.get(s)]
        mismatch = {"first_step": bad[0], "count": len(bad),
                    "got": got.get(bad[0]), "reference": reference.get(bad[0])} if bad else None
    result.update({
        "killed_at_logged_step": killed_at, "newest_checkpoint_at_kill": newest_at_kill,
        "worker_found": found, "killed": killed,
        "exit_code": proc.returncode, "restarts": len(restarts), "loaded_step": loaded_step,
        "restart_causes": [e.get("cause") for e in restarts],
        "losses_equal": equal, "wall_s": round(wall, 2),
    })
    if mismatch is not None:
        result["mismatch"] = mismatch
    if note is not None:
        result["note"] = note
    if proc.returncode != 0 or not equal:
        result["stderr_tail"] = stderr_path.read_text()[-2000:]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=10)
    parser.add_argument("--seed", type=int, default=0, help="seed of the rank/step draws")
    parser.add_argument("--train-seed", type=int, default=1234, help="training.seed of every job")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--interval", type=int, default=5, help="checkpoint interval (steps)")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="data2")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra settings, after the layout's (may repeat)")
    parser.add_argument("--nproc", type=int, default=None,
                        help="workers (default: product of the parallelism degrees)")
    parser.add_argument("--timeout", type=float, default=600.0, help="per-trial limit (s)")
    parser.add_argument("--keep-runs", type=Path, default=None,
                        help="keep the run directories here (default: a temporary folder)")
    args = parser.parse_args()
    if args.steps - 1 <= args.interval:
        parser.error("need steps - 1 > interval: the kill step is drawn in (interval, steps-1]")
    settings = settings_for(args)
    nproc = args.nproc or world_size(settings)
    if nproc < 2:
        parser.error("the layout needs at least 2 workers (a single process is not launched "
                     "by the restarting launcher)")
    rng = random.Random(args.seed)

    if args.keep_runs is not None:
        args.keep_runs.mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix="kill_recovery_", dir=args.keep_runs)).resolve()
    else:
        root = Path(tempfile.mkdtemp(prefix="kill_recovery_")).resolve()
    try:
        log(f"reference run: {args.layout} {args.set or ''} nproc {nproc}, {args.steps} steps, "
            f"checkpoint every {args.interval}")
        ref = run_reference(root / "reference", nproc, settings)
        reference = ref.pop("losses")
        if sorted(reference) != list(range(1, args.steps + 1)):
            raise SystemExit(f"reference run logged steps {sorted(reference)}")
        log(f"reference done in {ref['wall_s']} s")
        trials = []
        for i in range(args.trials):
            rank = rng.randrange(nproc)
            kill_step = rng.randint(args.interval + 1, args.steps - 1)
            log(f"trial {i + 1}/{args.trials}: kill rank {rank} at step {kill_step}")
            trial = run_trial(i + 1, root / f"trial-{i + 1}", nproc, settings, rank, kill_step,
                              reference, args.timeout)
            log(f"  -> logged step {trial['killed_at_logged_step']}, exit {trial['exit_code']}, "
                f"restarts {trial['restarts']}, newest ckpt at kill "
                f"{trial['newest_checkpoint_at_kill']}, loaded step {trial['loaded_step']}, "
                f"equal {trial['losses_equal']}, {trial['wall_s']} s"
                + (f" ({trial['note']})" if "note" in trial else ""))
            trials.append(trial)
    finally:
        if args.keep_runs is None:
            shutil.rmtree(root, ignore_errors=True)
        else:
            log(f"runs kept in {root}")

    all_finished = all(t["exit_code"] == 0 and t["killed"] and t["restarts"] >= 1
                       and t["loaded_step"] is not None for t in trials)
    all_equal = all(t["losses_equal"] for t in trials)
    loaded_newest = all(t["loaded_step"] is not None and t["newest_checkpoint_at_kill"] is not None
                        and t["loaded_step"] >= t["newest_checkpoint_at_kill"] for t in trials)
    out = {
        "config": {"layout": args.layout, "set": args.set, "nproc": nproc, "steps": args.steps,
                   "interval": args.interval, "seed": args.seed, "train_seed": args.train_seed,
                   "settings": settings},
        "reference": ref,
        "trials": trials,
        "summary": {"trials": len(trials), "all_finished": all_finished,
                    "all_equal": all_equal, "loaded_newest_checkpoint": loaded_newest,
                    "mean_wall_s": round(sum(t["wall_s"] for t in trials) / max(1, len(trials)),
                                         2)},
    }
    if args.keep_runs is None:
        out["reference"].pop("run_dir")
    print(json.dumps(out, indent=2))
    return 0 if trials and all_finished and all_equal else 1


if __name__ == "__main__":
    sys.exit(main())
