"""Ownership and safety of a run directory (DESIGN.md §4 "Run directory").

* ``RunDirLock``: one job at a time per directory. An exclusive ``flock`` on ``<run_dir>/.lock``,
  taken before anything else is written there and held for the job's whole life by the process
  that launched it (the ``mcpar train`` process that starts the workers, the single process of a
  world of 1, or rank 0 under torchrun/SLURM). The kernel drops the lock when its owner dies, so a
  crash never leaves a stale lock; the file's content only names the owner for the error message.
* ``config_differences``: what a ``--resume`` would change of the run in the directory, on the keys
  that decide the model and the data order (``IDENTITY_KEYS``).
* ``repair_jsonl``: a process killed while writing a line of metrics.jsonl or recovery.jsonl leaves
  a torn last line; a resume drops it (and says so) instead of failing on it.
"""

from __future__ import annotations

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
from pathlib import Path
from typing import IO, Any

import yaml

from mcpar.checkpoint.files import RECOVERY_LOG, RecoveryLog
from mcpar.config import JobConfig
from mcpar.errors import UserError, problem

LOCK_FILE = ".lock"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"

# Keys of the resolved config that a resume must not change, with or without a checkpoint:
# - model.*: another architecture (or width, vocabulary, MoE routing...) is another model; its
#   metrics appended to, or written over, this run's would describe nothing.
# - data.source, data.tokenizer, data.token_dtype, data.val_fraction: the tokens and the train/
#   validation split; changing them changes which sequences make up step k. (data.cache_dir is
#   left out on purpose: it says where a BPE tokenizer is cached, not what it is.)
# - training.seed: the model init and the data order.
# - optimization.global_batch_size (resolved: micro-batch x accumulation x data): the sequences of
#   step k depend on the seed and the global batch only, so the layout may change on resume but
#   the global batch may not.
# training.steps is deliberately absent: raising it is how a finished run is continued. Layout,
# controllers, optimizer settings and logging may change as well; the checkpoint's own checks
# (checkpoint.manager.resume_problems) refuse what cannot be restored.
IDENTITY_KEYS = (
    "model",
    "data.source", "data.tokenizer", "data.token_dtype", "data.val_fraction",
    "training.seed",
    "optimization.global_batch_size",
)


# --- ownership --------------------------------------------------------------------------------

def _owner_record() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
    }


def _describe_owner(text: str) -> str:
    try:
        owner = json.loads(text)
        return f"host {owner['host']}, pid {owner['pid']}, started {owner['started']}"
    except (ValueError, KeyError, TypeError):
        return "owner not yet recorded (it is starting)"


class RunDirLock:
    """The exclusive lock of one run directory, held by this process until ``release`` (or exit).

    Creates the directory if needed: the lock file is the first thing written into it.
    """

    def __init__(self, run_dir: Path):
        self.run_dir = run_dir
        self.path = run_dir / LOCK_FILE
        self._file: IO[str] | None = None

    def acquire(self) -> RunDirLock:
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            # O_CREAT without O_TRUNC: a held lock's owner record must survive our opening it.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as err:
            raise UserError(problem(
                "--run-dir", f"cannot create {self.run_dir}: {err.strerror}; give a writable "
                "directory")) from None
        f = os.fdopen(fd, "r+", encoding="utf-8")  # not inherited by the workers (PEP 446)
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            owner = _describe_owner(f.read())
            f.close()
            raise UserError(problem(
                "--run-dir", f"{self.run_dir} is in use by another mcpar train ({owner}); wait "
                "for it to finish or stop it, or give another --run-dir")) from None
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps(_owner_record()) + "\n")
            f.flush()
        except OSError as err:  # e.g. a full disk: name the file (a write error carries none)
            with contextlib.suppress(OSError):  # closing flushes again; the fd closes anyway
                f.close()
            raise OSError(err.errno, err.strerror, str(self.path)) from None
        self._file = f
        return self

    def release(self) -> None:
        """Unlock (closing the file does it). The lock file stays: removing it could let a
        process that opened it just before lock a file no one else sees."""
        if self._file is not None:
            self._file.close()
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None


# --- resume safety ----------------------------------------------------------------------------

def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _is_identity_key(key: str) -> bool:
    return any(key == k or key.startswith(k + ".") for k in IDENTITY_KEYS)


def config_differences(saved_yaml: str, cfg: JobConfig) -> list[tuple[str, Any, Any]]:
    """``(key, saved, now)`` for each identity key on which the resolved ``cfg`` differs from the
    run directory's saved config.yaml. A key the saved file does not have (written by a version
    that did not know it) is not compared."""
    saved_tree = yaml.safe_load(saved_yaml) or {}
    if not isinstance(saved_tree, dict):
        raise ValueError("not a mapping")
    saved = _flatten(saved_tree)
    now = _flatten(cfg.model_dump(mode="json"))
    return [(key, saved[key], now.get(key)) for key in sorted(saved)
            if _is_identity_key(key) and saved[key] != now.get(key)]


def check_resume_config(run_dir: Path, cfg: JobConfig) -> None:
    """Refuse (UserError) a resume whose resolved config changes the model or the data order of
    the run saved in ``run_dir``; nothing to compare when the directory has no config.yaml."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return
    try:
        diffs = config_differences(path.read_text(encoding="utf-8"), cfg)
    except (OSError, ValueError, yaml.YAMLError) as err:
        raise UserError(problem(
            "--resume", f"cannot read {path} ({err}); restore it, or start a new --run-dir "
            "without --resume")) from None
    if diffs:
        raise UserError([problem(
            key, f"--resume would change the run in {run_dir}: it was trained with {old!r}, "
            f"this run has {new!r}; resume with the saved value (see {path}), or give another "
            "--run-dir") for key, old, new in diffs])


def check_not_a_run(run_dir: Path) -> None:
    """Refuse (UserError) a plain run into a directory that already holds one: its metrics or its
    summary would be overwritten."""
    for name in (METRICS_FILE, SUMMARY_FILE):
        if (run_dir / name).exists():
            raise UserError(problem(
                "--run-dir", f"{run_dir} already holds a run ({name}); give a new directory, "
                "or pass --resume to continue it from its newest valid checkpoint"))


# --- torn lines -------------------------------------------------------------------------------

def repair_jsonl(path: Path) -> tuple[int, str] | None:
    """Make ``path`` (one JSON object per line) safe to read and to append to.

    A last line that is not a JSON object is what a process killed mid-write leaves: it is
    dropped, and its line number and text are returned (None when nothing was dropped). A valid
    last line without its newline gets one, so the next record does not glue onto it. A bad line
    anywhere else is real corruption: UserError naming the file and the line, nothing changed.
    """
    if not path.exists():
        return None
    data = path.read_bytes()
    lines = data.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the file ends with a newline
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    dropped: bytes | None = None
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            ok = isinstance(json.loads(line), dict)
        except ValueError:  # JSONDecodeError and UnicodeDecodeError
            ok = False
        if ok:
            continue
        if i != last:
            raise UserError(problem(
                str(path), f"line {i + 1} is not a JSON object (the file is corrupted, not just "
                "cut short); fix or delete that line, or start a new --run-dir"))
        dropped = line
    if (dropped is None and data.endswith(b"\n")) or not data:
        return None
    keep = lines[:last] if dropped is not None else lines
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(b"".join(line + b"\n" for line in keep))
    os.replace(tmp, path)
    return None if dropped is None else (last + 1, dropped.decode("utf-8", errors="replace"))


def repair_logs(run_dir: Path) -> None:
    """Before a resume: drop a torn last line of recovery.jsonl and metrics.jsonl (in that order,
    so that the repair of metrics.jsonl is logged in a sound recovery.jsonl), and log each drop."""
    log = RecoveryLog(run_dir)
    for name in (RECOVERY_LOG, METRICS_FILE):
        dropped = repair_jsonl(run_dir / name)
        if dropped is not None:
            line, text = dropped
            log.log("repair", echo=True, file=name, line=line,
                    action=f"dropped its torn last line ({len(text)} characters: {text[:60]!r}), "
                    "left by a process that died while writing it")
