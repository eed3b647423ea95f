"""What every multi-process benchmark here does around its workers.

A benchmark script starts its own worker processes (``mcpar.launch.local.launch_local``) by running
itself again with ``--worker``; these helpers are the parts every such script shares, with
how every bench hands over its result (JSON on stdout, and in a file when asked).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

from mcpar.errors import UserError
from mcpar.launch.env import DistEnv, detect_env
from mcpar.launch.local import record_worker_errors


def run_worker(args: argparse.Namespace,
               worker: Callable[[argparse.Namespace, DistEnv], None]) -> int:
    """The ``--worker`` side: this process's rank from the launcher's environment, then
    ``worker``; an error is recorded for the launcher to report, as mcpar's workers do."""
    with record_worker_errors():
        env = detect_env()
        if env is None:
            raise SystemExit("--worker is for processes this benchmark starts itself")
        worker(args, env)
    return 0


def settings_problem(build: Callable[[], object]) -> int | None:
    """Exit code 2 with the problems printed if ``build`` (the benchmark's config from its
    ``--set`` options) refuses them; None if they are fine. Run before any worker starts, so
    that a bad key is reported once, not by every rank."""
    try:
        build()
    except UserError as err:
        print("\n".join(err.problems), file=sys.stderr)
        return 2
    return None


def emit_result(result: dict, out: str | Path | None) -> None:
    """Print the bench's result as JSON on stdout (progress goes to stderr) and, when ``out``
    is given, write the same text there."""
    text = json.dumps(result, indent=1)
    print(text, flush=True)
    if out:
        Path(out).write_text(text + "\n")
