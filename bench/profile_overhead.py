"""What profiling costs: tokens/s with the profiler's hooks off, absent, and profiling on.

Variants, each a single-process `mcpar train` of the same job in this process, run
round-robin ``--repeats`` times (the median run of each is reported):

- ``absent``: a build without the profiler hooks: the trainer's RunProfiler replaced by one
  whose hooks do nothing (no MFU either). The Communicator's and the ComputeController's
  tracing flags are still tested once per collective and per task (an attribute read);
- ``off``: the default (profiling off): MFU computed every step, nothing else;
- ``on``: ``training.profile`` over every step after the first, torch.profiler trace
  included, and the report written at the end (its time is outside the steps).

tokens/s is the mean over steps after ``--warmup`` of metrics.jsonl. On a shared machine
run-to-run noise exceeds 1%, so three finer measures follow:

- the hooks' own time, timed directly: the seconds inside ``before_step`` + ``after_step`` in
  the median step (``hook_s_per_step``; the window's start and end, once per run, show in
  ``hook_s_max``) against the step time (metrics' step_time_s excludes the hooks);
- one job of ``--paired-steps`` steps whose hooks run on every other step only, a paired
  comparison that cancels the machine's drifts: the two halves' step times (the hooks' effect
  on the step itself) and whole iterations, hooks included, each with a bootstrap 95% interval
  of the median pair ratio. Iterations include the logging and are the noisier;
- ``off_overhead_upper_bound``: the hooks' timed share of a step plus the upper end of the
  paired steps' interval: what profiling off can cost at most.

Profiling on also slows the steps themselves (torch.profiler records every operator): that is
in its tokens/s, not in the hooks.

    python bench/profile_overhead.py [--repeats 5] [--steps 30]
        [--out bench/data/profile_overhead.json]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench_workers import emit_result

import mcpar.trainer as trainer_module
from mcpar.cli import main as mcpar_main
from mcpar.metrics import read_metrics
from mcpar.profiler.session import RunProfiler

REPO = Path(__file__).resolve().parents[1]
JOB = ["training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
       "training.device=cpu"]


class AbsentProfiler:
    """A build without the hooks: the trainer's three calls do nothing."""

    def __init__(self, trainer: Any):
        pass

    def before_step(self, step: int) -> None: ...

    def after_step(self, step: int, record: dict) -> None: ...

    def finish(self, summary: dict) -> None: ...


class TimedProfiler(RunProfiler):
    """The real hooks, with the seconds spent inside them per step counted."""

    per_step: list[float] = []

    def before_step(self, step: int) -> None:
        t0 = time.perf_counter()
        super().before_step(step)
        self._hook_s = time.perf_counter() - t0

    def after_step(self, step: int, record: dict) -> None:
        t0 = time.perf_counter()
        super().after_step(step, record)
        if step > 0:  # the first measures the CPU's peak, once per run
            TimedProfiler.per_step.append(self._hook_s + time.perf_counter() - t0)


class AlternateProfiler(RunProfiler):
    """The real hooks on even steps, none on odd ones: a paired comparison in one run, which
    cancels the machine's slow drifts that separate runs suffer. ``stamps`` holds the time at
    which each step's iteration began: metrics' step_time_s excludes the hooks (they run before
    and after the timed step), an iteration (stamp to next stamp) includes them."""

    stamps: list[float] = []

    def before_step(self, step: int) -> None:
        AlternateProfiler.stamps.append(time.perf_counter())
        if step % 2 == 0 or self.peak is None:
            super().before_step(step)

    def after_step(self, step: int, record: dict) -> None:
        if step % 2 == 0:
            super().after_step(step, record)


def paired(args: argparse.Namespace, root: Path) -> dict[str, Any]:
    run_dir = root / "paired"
    trainer_module.RunProfiler = AlternateProfiler
    AlternateProfiler.stamps = []
    argv = ["train", "--run-dir", str(run_dir), "--nproc", "1"]
    for s in [*JOB, f"training.steps={args.paired_steps}", *args.overrides]:
        argv += ["--set", s]
    with contextlib.chdir(REPO), contextlib.redirect_stdout(io.StringIO()):
        assert mcpar_main(argv) == 0
    steps = [r for r in read_metrics(run_dir) if r["step"] > args.warmup]
    # metrics' step is 1-based: hooks ran on 0-based even steps, i.e. odd 1-based ones.
    on = [r["step_time_s"] for r in steps if r["step"] % 2 == 1]
    off = [r["step_time_s"] for r in steps if r["step"] % 2 == 0]
    pairs = [a / b for a, b in zip(on, off, strict=False)]
    # Whole iterations, hooks included: iteration k (0-based) runs from stamp k to stamp k+1;
    # even k ran the hooks. Pair each even iteration with the odd one after it.
    stamps = AlternateProfiler.stamps
    start = args.warmup + args.warmup % 2  # first even 0-based iteration after the warm-up
    iters = [b - a for a, b in zip(stamps, stamps[1:], strict=False)][start:]
    iter_pairs = [iters[i] / iters[i + 1] for i in range(0, len(iters) - 1, 2)]
    low, high = bootstrap_median_interval(iter_pairs)
    return {"steps": args.paired_steps, "mean_step_s_hooks": statistics.fmean(on),
            "mean_step_s_no_hooks": statistics.fmean(off),
            "median_pair_ratio_hooks_over_none": statistics.median(pairs),
            "median_pair_ratio_95ci": list(bootstrap_median_interval(pairs)),
            "mean_ratio": statistics.fmean(on) / statistics.fmean(off),
            "iteration_pairs": len(iter_pairs),
            "median_iteration_ratio_hooks_over_none": statistics.median(iter_pairs),
            "median_iteration_ratio_95ci": [low, high]}


def bootstrap_median_interval(values: list[float], resamples: int = 2000,
                              seed: int = 0) -> tuple[float, float]:
    """A 95% percentile-bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values)))
                     for _ in range(resamples))
    return medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]


def run(variant: str, args: argparse.Namespace, root: Path, repeat: int) -> dict[str, Any]:
    run_dir = root / f"{variant}-{repeat}"
    sets = [*JOB, f"training.steps={args.steps}", *args.overrides]
    if variant == "on":
        sets += ["training.profile.enabled=true", "training.profile.start_step=2",
                 f"training.profile.steps={args.steps - 1}"]
    trainer_module.RunProfiler = AbsentProfiler if variant == "absent" else TimedProfiler
    TimedProfiler.per_step = []
    argv = ["train", "--run-dir", str(run_dir), "--nproc", "1"]
    for s in sets:
        argv += ["--set", s]
    start = time.perf_counter()
    with contextlib.chdir(REPO), contextlib.redirect_stdout(io.StringIO()):
        assert mcpar_main(argv) == 0
    wall = time.perf_counter() - start
    steps = [r for r in read_metrics(run_dir) if r["step"] > args.warmup]
    step_s = statistics.fmean(r["step_time_s"] for r in steps)
    out = {"tokens_per_s": statistics.fmean(r["tokens_per_s"] for r in steps),
           "step_time_s": step_s, "wall_s": wall}
    if variant != "absent" and TimedProfiler.per_step:
        # The median step: starting and stopping the trace (once per window) and exporting it
        # are one-off costs, reported apart as the largest step's hook time.
        out["hook_s_per_step"] = statistics.median(TimedProfiler.per_step)
        out["hook_s_max"] = max(TimedProfiler.per_step)
        out["hook_fraction_of_step"] = out["hook_s_per_step"] / step_s
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--set", dest="overrides", action="append", default=[])
    p.add_argument("--paired-steps", type=int, default=400)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    runs: dict[str, list[dict[str, Any]]] = {"absent": [], "off": [], "on": []}
    with tempfile.TemporaryDirectory(prefix="profile-overhead-") as tmp:
        for repeat in range(args.repeats):
            for variant in runs:
                runs[variant].append(run(variant, args, Path(tmp), repeat))
                print(f"profile_overhead: {variant} #{repeat}: "
                      f"{runs[variant][-1]['tokens_per_s']:.0f} tokens/s", file=sys.stderr,
                      flush=True)
        pair = paired(args, Path(tmp))
    median = {v: statistics.median(r["tokens_per_s"] for r in rs) for v, rs in runs.items()}
    result = {
        "benchmark": "profile_overhead", "steps": args.steps, "warmup": args.warmup,
        "sets": [*JOB, *args.overrides], "repeats": args.repeats,
        "loadavg_1m": os.getloadavg()[0], "cores": os.cpu_count(),
        "median_tokens_per_s": median,
        "off_vs_absent": median["off"] / median["absent"],
        "on_vs_absent": median["on"] / median["absent"],
        "off_hook_fraction_of_step": statistics.median(
            r["hook_fraction_of_step"] for r in runs["off"]),
        "on_hook_fraction_of_step": statistics.median(
            r["hook_fraction_of_step"] for r in runs["on"]),
        "paired_hooks_vs_none_in_one_run": pair,
        # What profiling off can cost at most (95%): the hooks' own time, timed directly, plus
        # what they do to the timed step (the paired steps' interval's upper end). The rest of
        # an iteration (logging, metrics) is the same code with or without the hooks.
        "off_overhead_upper_bound": (pair["median_pair_ratio_95ci"][1] - 1
                                     + statistics.median(r["hook_fraction_of_step"]
                                                         for r in runs["off"])),
        "runs": runs,
    }
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
