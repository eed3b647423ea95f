"""Entry point of a worker started by ``mcpar train --nproc N``:
``python -m mcpar.launch.worker RUN_DIR [--resume] [--stop-after N]``.

The parent process has already validated the job and written the resolved ``config.yaml`` into the
run directory; every worker trains from that file, so all ranks see exactly the same settings.
A restarted job (``MCPAR_RESTART_COUNT`` > 0, set by the launcher) always resumes from the newest
valid checkpoint.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mcpar.config import load_config
from mcpar.errors import UserError
from mcpar.launch.env import detect_env
from mcpar.launch.local import record_worker_errors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="mcpar.launch.worker")
    parser.add_argument("run_dir")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--stop-after", type=int, default=None)
    args = parser.parse_args(argv)
    run_dir = args.run_dir
    resume = args.resume or int(os.environ.get("MCPAR_RESTART_COUNT", "0") or 0) > 0
    try:
        with record_worker_errors():
            env = detect_env()
            if env is None:
                raise SystemExit("mcpar.launch.worker is started by `mcpar train`, not by hand")
            from mcpar.trainer import run_worker

            cfg = load_config(Path(run_dir) / "config.yaml")
            run_worker(cfg, Path(run_dir), env, resume=resume, stop_after=args.stop_after)
    except UserError as err:
        # A user error a worker found (recorded for the launcher above): exit 2, no traceback;
        # the launcher does not restart the job for it, and prints its lines once for the job
        # (every rank printing them too made one problem N+1 lines). Printed here only when
        # it could not be recorded (or no launcher reads the record).
        recorded = os.environ.get("MCPAR_ERROR_FILE")
        if not recorded or not os.path.exists(recorded):
            for line in err.problems:
                print(f"mcpar: error: {line}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
