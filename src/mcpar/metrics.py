"""The run directory contract (DESIGN.md §4): config.yaml, metrics.jsonl, summary.json.

Only rank 0 writes. Each metrics line is flushed as soon as it is written, so a run that dies keeps
every step it finished. TensorBoard scalars are optional (``training.tensorboard``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mcpar.errors import UserError, problem

REQUIRED_FIELDS = (
    "step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "comm_bytes",
    "comm_time_s", "peak_mem_bytes",
)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


class RunLogger:
    """Writes metrics.jsonl (and TensorBoard scalars) for rank 0; a no-op on other ranks."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool):
        self.run_dir = run_dir
        self.enabled = enabled
        self._file = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise UserError(problem(
                    "training.tensorboard",
                    "the tensorboard package is not installed; pip install 'mcpar[tensorboard]' "
                    "or set training.tensorboard=false",
                )) from None
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tb.add_scalar(key, value, record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, in order."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
