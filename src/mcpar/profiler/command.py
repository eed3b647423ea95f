"""``mcpar profile CONFIG [--steps N] [--set ...]``: a short training run, profiled.

It is ``mcpar train`` with ``training.profile`` on: ``N`` steps (default 5), every one of them
profiled except the first, whose warm-up (allocations, kernel choice, first connections) is no
part of a steady step; ``--set training.profile.start_step=...`` overrides that.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from mcpar.errors import UserError, problem

DEFAULT_STEPS = 5


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``profile``'s arguments (its one-line help is in ``mcpar.cli``'s command table)."""
    p.add_argument("config", nargs="?", help="YAML config; omit for the built-in default")
    p.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps to run (default 5)")
    p.add_argument("--run-dir", default=None, help="run directory (default runs/<time>)")


def as_train_args(args: argparse.Namespace) -> argparse.Namespace:
    """The ``train`` arguments of a ``profile`` command line."""
    if args.steps < 1:
        raise UserError(problem("--steps", f"{args.steps} steps: give at least 1 (the first is "
                                "warm-up; 2 or more profile a steady step)"))
    report = Path(args.run_dir) / "profile" if args.run_dir else None
    if report is not None and report.exists() and not report.is_dir():
        raise UserError(problem("--run-dir", f"{report} is a file, where the profile report "
                                "goes; move it away or give another --run-dir"))
    steps = args.steps
    start = 2 if steps > 1 else 1
    overrides = ["training.profile.enabled=true", f"training.profile.start_step={start}",
                 f"training.profile.steps={steps - start + 1}", *args.overrides]
    return argparse.Namespace(**{**vars(args), "overrides": overrides, "steps": steps,
                                 "resume": False, "stop_after": None})
