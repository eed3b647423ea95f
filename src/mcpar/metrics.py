"""The run directory contract (DESIGN.md §4): config.yaml, metrics.jsonl, summary.json.

Only rank 0 writes. Each metrics line is flushed as soon as it is written, so a run that dies keeps
every step it finished. Two optional sinks receive every numeric field of each line, nested dicts
flattened with '/' (``comm_bytes_by_axis/dp``, ``moe/...``): TensorBoard scalars
(``training.tensorboard``) and Weights & Biases (``training.wandb``; offline mode writes
``<run_dir>/wandb`` and needs no network).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mcpar.config import WandbConfig
from mcpar.errors import UserError, problem

REQUIRED_FIELDS = (
    "step", "loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "comm_bytes",
    "comm_time_s", "peak_mem_bytes",
)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def flatten_scalars(record: dict[str, Any] | list[Any] | tuple[Any, ...],
                    prefix: str = "") -> dict[str, float]:
    """Every numeric field of ``record`` (booleans as 0/1), nested dicts' keys joined with '/',
    lists' items by index; 'step' itself is the x axis, not a scalar."""
    out: dict[str, float] = {}
    items: Iterable[tuple[object, Any]] = (record.items() if isinstance(record, dict)
                                           else enumerate(record))
    for key, value in items:
        name = f"{prefix}{key}"
        if name == "step":
            continue
        if isinstance(value, (dict, list, tuple)):
            out.update(flatten_scalars(value, f"{name}/"))
        elif isinstance(value, (bool, int, float)) and math.isfinite(float(value)):
            out[name] = float(value)
    return out


def _open_wandb(run_dir: Path, cfg: WandbConfig) -> Any:
    try:
        import wandb
    except ImportError:
        raise UserError(problem(
            "training.wandb.enabled",
            "the wandb package is not installed; pip install 'mcpar[wandb]' or set "
            "training.wandb.enabled=false",
        )) from None
    (run_dir / "wandb").mkdir(exist_ok=True)
    return wandb.init(project=cfg.project, mode=cfg.mode, dir=str(run_dir),
                      name=run_dir.name)


class RunLogger:
    """Writes metrics.jsonl (and TensorBoard / W&B scalars) for rank 0; a no-op elsewhere."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool,
                 wandb: WandbConfig | None = None):
        self.run_dir = run_dir
        self.enabled = enabled
        self._file = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115
        self._tb = None
        self._wandb = None
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
        if enabled and wandb is not None and wandb.enabled:
            self._wandb = _open_wandb(run_dir, wandb)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        assert self._file is not None
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is None and self._wandb is None:
            return
        scalars = flatten_scalars(record)
        if self._tb is not None:
            for key, value in scalars.items():
                self._tb.add_scalar(key, value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, in order."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]
