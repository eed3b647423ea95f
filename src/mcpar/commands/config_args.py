"""The job's config as the command line gives it (file or built-in default, ``--set``,
``--steps``), in a module of its own so that ``mcpar check`` reads it without importing the
trainer's stack (torch)."""

from __future__ import annotations

import argparse

from mcpar.config import JobConfig, load_config


def load_args(args: argparse.Namespace) -> JobConfig:
    overrides = list(args.overrides)
    if getattr(args, "steps", None) is not None:
        overrides.append(f"training.steps={args.steps}")
    return load_config(args.config, overrides)
