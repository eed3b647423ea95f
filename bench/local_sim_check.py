"""Local check of the cost model: predicted vs measured step times of real mcpar runs here.

What it does
    1. Measures this machine (``mcpar.sim.localprofile``: matmul and attention FLOP/s, streaming
       bandwidth, per-layer dispatch overhead, gloo all-reduce alpha/beta) unless ``--profile``
       names a saved one.
    2. Trains the same small GPT with ``mcpar train`` under several layouts (data, tensor,
       sequence, pipeline and interleaved mixes, 1-4 worker processes; with more workers than
       cores the workers share them, and the cost model is told so), ``--steps`` steps each.
    3. Measured step time: the median of ``step_time_s`` in metrics.jsonl after ``--warmup``
       steps. Predicted: ``mcpar.sim`` with the local profile, for the same config.
    Other jobs on the machine would share the cores with the runs and the micro-benchmark, so
    each measurement first waits (up to ``--idle-wait`` seconds) for the machine to be idle, and
    a run during which other processes used more than 5% of the cores (machine CPU time from
    /proc/stat minus this run's own) is repeated (``--retries``); the JSON records that share.

How to run
    python bench/local_sim_check.py [--steps 14] [--warmup 4] [--profile FILE] [--only NAME ...]

    Prints one JSON object on stdout (per layout: predicted, measured, ratio, the prediction's
    breakdown); progress goes to stderr. About 4 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TypeVar

from mcpar.config import load_config
from mcpar.sim import cpu_load
from mcpar.sim.costmodel import simulate
from mcpar.sim.fromconfig import CONFIG_KEYS, config_layout, config_model
from mcpar.sim.hardware import LocalProfile
from mcpar.sim.localprofile import local_cluster, measure
from mcpar.sim.profilestore import lookup_profile

T = TypeVar("T")
MAX_FOREIGN = 0.05  # share of the cores other processes may use during a timed run

MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "model.seq_len=128",
         "optimization.micro_batch_size=8", "optimization.global_batch_size=32",
         "training.eval_interval=0", "training.eval_batches=1", "training.progress=false"]

# name -> (worker processes, overrides)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "dp1": (1, []),
    "dp2": (2, []),
    "tp2": (2, ["parallelism.tensor=2"]),
    "tp2_sp": (2, ["parallelism.tensor=2", "parallelism.sequence_parallel=true"]),
    "pp2_1f1b": (2, ["parallelism.pipeline=2"]),
    "pp2_gpipe": (2, ["parallelism.pipeline=2", "parallelism.schedule=gpipe"]),
    "pp2_vp2": (2, ["parallelism.pipeline=2", "parallelism.virtual_stages=2",
                    "parallelism.schedule=interleaved_1f1b"]),
    "dp2_tp2": (4, ["parallelism.tensor=2"]),
    "dp2_pp2": (4, ["parallelism.pipeline=2"]),
    "tp2_pp2": (4, ["parallelism.tensor=2", "parallelism.pipeline=2"]),
    "pp4": (4, ["parallelism.pipeline=4"]),
}


def foreign_share(fn: Callable[[], T]) -> tuple[T, float]:
    """``mcpar.sim.cpu_load.foreign_share``, 0 where the machine's load is unknown (the benches
    run on Linux, where it is known)."""
    result, share = cpu_load.foreign_share(fn)
    return result, share or 0.0


def measured_step(overrides: list[str], nproc: int, steps: int, warmup: int) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", str(nproc),
               "--steps", str(steps), "--run-dir", str(run_dir)]
        for item in overrides:
            cmd += ["--set", item]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"mcpar train failed: {proc.stderr[-2000:]}")
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        times = [json.loads(line)["step_time_s"] for line in lines]
    return statistics.median(times[warmup:])


def _cpu_idle(seconds: float = 2.0) -> float:
    """Fraction of all cores idle over `seconds` (from /proc/stat; 1.0 where unavailable)."""
    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
        return fields[3] + fields[4], sum(fields)  # idle + iowait, total

    try:
        idle0, total0 = sample()
        time.sleep(seconds)
        idle1, total1 = sample()
    except (OSError, ValueError, IndexError):
        return 1.0
    return (idle1 - idle0) / max(1, total1 - total0)


def wait_for_idle(max_wait_s: float) -> float:
    """Wait (up to `max_wait_s`) until the machine is at least 90% idle, so that other jobs do
    not share the cores with the run being timed; returns the idle fraction last seen."""
    deadline = time.monotonic() + max_wait_s
    idle = _cpu_idle()
    while idle < 0.9 and time.monotonic() < deadline:
        time.sleep(5)
        idle = _cpu_idle()
    return idle


def measure_when_idle(retries: int, idle_wait: float) -> tuple[LocalProfile, float]:
    """This machine's local profile, measured once the machine is idle and again (up to
    ``retries`` times) when other processes shared the cores meanwhile; with their share."""
    for _ in range(1 + retries):
        wait_for_idle(idle_wait)
        print("measuring the local profile ...", file=sys.stderr, flush=True)
        profile, foreign = foreign_share(measure)
        if foreign <= MAX_FOREIGN:
            break
    return profile, foreign


def predicted(overrides: list[str], nproc: int, profile: LocalProfile) -> dict[str, object]:
    cfg = load_config(None, overrides)
    cluster = replace(local_cluster(profile), num_gpus=nproc)
    model = config_model(cfg)
    layout = config_layout(cfg, nproc)
    pred = simulate(model, layout, cluster, where="config", names=CONFIG_KEYS)
    return {"step_s": pred.step_s,
            "breakdown": {k: round(v, 5) for k, v in sorted(pred.breakdown.items())}}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--profile", type=Path, default=None, help="a saved local profile")
    parser.add_argument("--only", nargs="*", default=None, help="layouts to run")
    parser.add_argument("--idle-wait", type=float, default=300.0,
                        help="seconds to wait for an idle machine before each measurement")
    parser.add_argument("--retries", type=int, default=3,
                        help="runs repeated when other processes shared the cores")
    args = parser.parse_args()
    profile_foreign = None
    if args.profile:
        found = lookup_profile(args.profile)  # this machine's, as a run here would use it
        if found.profile is None:
            print(f"--profile: {found.why}; measure it again or leave --profile out",
                  file=sys.stderr)
            return 2
        profile = found.profile
    else:
        profile, profile_foreign = measure_when_idle(args.retries, args.idle_wait)
    rows = []
    for name, (nproc, extra) in LAYOUTS.items():
        if args.only and name not in args.only:
            continue
        overrides = MODEL + extra
        pred = predicted(overrides, nproc, profile)
        for attempt in range(1 + args.retries):
            idle = wait_for_idle(args.idle_wait)
            print(f"running {name} ({nproc} workers; machine {idle:.0%} idle before) ...",
                  file=sys.stderr, flush=True)
            meas, foreign = foreign_share(
                lambda o=overrides, n=nproc: measured_step(o, n, args.steps, args.warmup))
            if foreign <= MAX_FOREIGN:
                break
            print(f"  other processes used {foreign:.0%} of the cores meanwhile; "
                  f"{'again' if attempt < args.retries else 'keeping it'}",
                  file=sys.stderr, flush=True)
        rows.append({"layout": name, "workers": nproc, "predicted_step_s": round(pred["step_s"], 4),
                     "measured_step_s": round(meas, 4),
                     "ratio": round(pred["step_s"] / meas, 3),  # type: ignore[operator]
                     "foreign_cpu_share": round(foreign, 3),
                     "breakdown": pred["breakdown"]})
        print(f"  {name}: predicted {pred['step_s']:.3f} s, measured {meas:.3f} s",
              file=sys.stderr, flush=True)
    within = [r for r in rows if abs(r["ratio"] - 1) <= 0.25]  # type: ignore[operator]
    print(json.dumps({
        "model": MODEL, "profile": json.loads(profile.to_json()),
        "profile_foreign_cpu_share": profile_foreign, "layouts": rows,
        "within_25_percent": len(within), "of": len(rows),
        "median_abs_error": round(statistics.median(
            abs(r["ratio"] - 1) for r in rows), 3) if rows else None,  # type: ignore[operator]
    }, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
