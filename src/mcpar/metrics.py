"""The run directory contract (DESIGN.md §4): config.yaml, metrics.jsonl, summary.json.

Only rank 0 writes. Each metrics line is flushed as soon as it is written, so a run that dies keeps
every step it finished. Two optional sinks receive every numeric field of each line, nested dicts
flattened with '/' (``comm_bytes_by_axis/dp``, ``moe/...``): TensorBoard scalars
(``training.tensorboard``) and Weights & Biases (``training.wandb``; offline mode writes
``<run_dir>/wandb`` and needs no network).

TensorBoard groups its scalars into sections by the part of the tag before the first '/', so
each metric gets a grouped tag there (``tensorboard_tag``, from the one table ``TB_TAGS``):
``train/`` the optimization (loss, lr, grad_norm, tokens, skipped), ``val/`` the validation
loss, ``perf/`` time and throughput (step_time_s, tokens_per_s, mfu, compile_s,
consistency_check_s), ``memory/`` the peak memory, ``comm/`` the collectives' bytes and time
(per mesh axis under ``comm/bytes_by_axis/``); a nested record keeps its own key as its
section (``moe/...``), and a key the table does not know goes under ``misc/``. metrics.jsonl
and W&B keep the records' own keys. At start the resolved configuration is written once as
text (tag ``config``, the YAML of config.yaml) and as the HParams plugin's hyperparameters.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mcpar.config import JobConfig, WandbConfig, to_yaml
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


# A top-level metrics key -> its TensorBoard tag; nested fields append their own path
# (``comm_bytes_by_axis`` -> ``comm/bytes_by_axis/dp``). A new metric gets its line here.
TB_TAGS: dict[str, str] = {
    "loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
    "tokens": "train/tokens", "skipped": "train/skipped",
    "val_loss": "val/loss",
    "step_time_s": "perf/step_time_s", "tokens_per_s": "perf/tokens_per_s", "mfu": "perf/mfu",
    "compile_s": "perf/compile_s", "consistency_check_s": "perf/consistency_check_s",
    "peak_mem_bytes": "memory/peak_mem_bytes",
    "comm_bytes": "comm/bytes", "comm_time_s": "comm/time_s",
    "exposed_comm_s": "comm/exposed_s", "comm_bytes_by_axis": "comm/bytes_by_axis",
    "grad_sync_spread_s": "perf/grad_sync_spread_s", "slowest_rank": "perf/slowest_rank",
}
# The run's headline figures, which the HParams plugin shows beside the hyperparameters.
_HPARAM_METRICS = ("train/loss", "val/loss", "perf/tokens_per_s", "perf/mfu")


def tensorboard_tag(name: str) -> str:
    """The grouped TensorBoard tag of a flattened metrics name (``flatten_scalars``' keys)."""
    top, sep, rest = name.partition("/")
    if top in TB_TAGS:
        return TB_TAGS[top] + sep + rest
    return name if sep else f"misc/{name}"


def config_hparams(cfg: JobConfig) -> dict[str, float | str]:
    """The configuration's leaves as hyperparameters (``model.hidden_size``: 256): numbers,
    booleans (as 0/1) and strings; unset values and lists are left out."""
    out: dict[str, float | str] = {}

    def walk(node: dict[str, Any], prefix: str) -> None:
        for key, value in node.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, (bool, int, float)):
                out[f"{prefix}{key}"] = float(value)
            elif isinstance(value, str):
                out[f"{prefix}{key}"] = value

    walk(cfg.model_dump(mode="json"), "")
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
                 wandb: WandbConfig | None = None, config: JobConfig | None = None):
        """``config``: the resolved configuration, which TensorBoard records once at start."""
        self.run_dir = run_dir
        self.enabled = enabled
        self._file = open(run_dir / "metrics.jsonl", "a") if enabled else None  # noqa: SIM115
        self._tb: Any = None
        self._hparams_end: Any = None  # the HParams session's end, written at close
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
            if config is not None:
                self._log_config(config)
        if enabled and wandb is not None and wandb.enabled:
            self._wandb = _open_wandb(run_dir, wandb)

    def _log_config(self, cfg: JobConfig) -> None:
        from torch.utils.tensorboard.summary import hparams

        # TensorBoard's text plugin renders Markdown: the YAML as a fenced code block.
        self._tb.add_text("config", f"```yaml\n{to_yaml(cfg)}```", 0)
        experiment, start, self._hparams_end = hparams(
            config_hparams(cfg), dict.fromkeys(_HPARAM_METRICS, 0.0))
        writer = self._tb._get_file_writer()
        writer.add_summary(experiment)
        writer.add_summary(start)

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
                self._tb.add_scalar(tensorboard_tag(key), value, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        if self._tb is not None:
            if self._hparams_end is not None:
                self._tb._get_file_writer().add_summary(self._hparams_end)
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """The records of a run's metrics.jsonl, in order."""
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def truncate_metrics(run_dir: Path, step: int) -> None:
    """Drop metrics of steps after ``step``: they are replayed after a restore, and the file
    must stay one record per step."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return
    keep = [line for line in path.read_text().splitlines()
            if line.strip() and json.loads(line)["step"] <= step]
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(line + "\n" for line in keep))
    os.replace(tmp, path)
