"""Entry point of a worker started by ``mcpar train --nproc N``: ``python -m mcpar.worker RUN_DIR``.

The parent process has already validated the job and written the resolved ``config.yaml`` into the
run directory; every worker trains from that file, so all ranks see exactly the same settings.
"""

from __future__ import annotations

import sys
from pathlib import Path

from mcpar.config import load_config
from mcpar.launch import detect_env, record_worker_errors


def main(run_dir: str) -> None:
    with record_worker_errors():
        env = detect_env()
        if env is None:
            raise SystemExit("mcpar.worker is started by `mcpar train`, not by hand")
        from mcpar.trainer import run_worker

        cfg = load_config(Path(run_dir) / "config.yaml")
        run_worker(cfg, Path(run_dir), env)


if __name__ == "__main__":
    main(sys.argv[1])
