"""A checkpoint's files: checksums, validity, discovery, the recovery log, and reading DCP
checkpoints without running code from them. (The layout and commit protocol are described in
``checkpoint.py``, which saves and restores through these.)"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata

from mcpar.checkpoint.packing import PackedCheckpoint
from mcpar.errors import UserError, problem

try:  # DCP's zstd stream transform (experimental API); it needs `zstandard` or `pyzstd`
    from torch.distributed.checkpoint._extension import ZStandard
except ImportError:  # pragma: no cover - a torch without it
    ZStandard = None  # type: ignore[assignment,misc]

MANIFEST = "manifest.json"
META = "meta.json"
RECOVERY_LOG = "recovery.jsonl"
_ZSTD_DESCRIPTOR = "stream.zstd"
_ZSTD_FIX = ("install the zstandard package (pip install zstandard, or mcpar's 'zstd' extra: "
             "pip install 'mcpar[zstd]') in the environment of every worker")
_STEP_DIR = re.compile(r"step-(\d+)")


# --- files: checksums, validity, discovery -------------------------------------------------------

def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def verify_checkpoint(path: Path) -> str | None:
    """None if ``path`` is a valid checkpoint, else why it is not."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError):
        return "manifest.json is unreadable"
    if META not in files:
        return f"manifest.json does not list {META}"
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"]:
            return f"{name} has {file.stat().st_size} bytes, the manifest says {entry['bytes']}"
        if _sha256(file) != entry["sha256"]:
            return f"{name} fails its sha256 checksum"
    return None


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Committed-looking ``step-N`` folders, newest first (``.tmp`` folders are never listed)."""
    if not ckpt_dir.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_dir.iterdir()
             if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]
    return sorted(found, reverse=True)


class RecoveryLog:
    """``<run_dir>/recovery.jsonl``: one JSON object per save, load, failure, fallback or restart.

    Events are also echoed to stderr when they concern a failure, so the user sees them live.
    """

    def __init__(self, run_dir: Path, enabled: bool = True):
        self.path = run_dir / RECOVERY_LOG
        self.enabled = enabled

    def log(self, event: str, echo: bool = False, **fields: Any) -> None:
        if not self.enabled:
            return
        record = {"time": time.time(), "event": event, **fields}
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        if echo:
            details = ", ".join(f"{k} {v}" for k, v in fields.items())
            print(f"mcpar: recovery: {event}: {details}", file=sys.stderr, flush=True)


def find_latest_valid(ckpt_dir: Path, log: RecoveryLog | None = None) -> tuple[int, Path] | None:
    """The newest valid checkpoint; every newer invalid one is logged as skipped."""
    skipped = 0
    for step, path in list_checkpoints(ckpt_dir):
        reason = verify_checkpoint(path)
        if reason is None:
            if skipped and log is not None:
                log.log("fallback", echo=True, step=step, path=str(path), skipped=skipped)
            return step, path
        skipped += 1
        if log is not None:
            log.log("invalid_checkpoint", echo=True, step=step, path=str(path), reason=reason)
    return None


# --- compression ---------------------------------------------------------------------------------

def zstd_available() -> bool:
    """Whether DCP can write and read zstd-compressed checkpoints in this environment."""
    return ZStandard is not None and ZStandard.is_available()


def is_compressed(metadata: Metadata) -> bool:
    """Whether any item of a DCP checkpoint was written through the zstd transform."""
    return any(desc.partition("/")[0] == _ZSTD_DESCRIPTOR
               for info in (metadata.storage_data or {}).values()
               for desc in (getattr(info, "transform_descriptors", None) or ()))


# --- safe reading of DCP metadata ----------------------------------------------------------------

class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the classes DCP's metadata is made of; anything else is refused."""

    # Plain callables DCP's metadata needs besides its own classes: harmless constructors.
    _EXTRA = {("torch", "Size"), ("torch.serialization", "_get_layout"),
              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
              ("collections", "OrderedDict")}

    def find_class(self, module: str, name: str) -> Any:
        # A dotted name would let a pickle reach any attribute of an allowed module.
        if "." not in name:
            if (module, name) in self._EXTRA:
                return super().find_class(module, name)
            if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
                return super().find_class(module, name)
            if module.startswith("torch.distributed.checkpoint."):
                found = super().find_class(module, name)
                if isinstance(found, type):  # DCP's dataclasses and enums, never a function
                    return found
        raise pickle.UnpicklingError(f"checkpoint metadata refers to {module}.{name}, which is "
                                     "not checkpoint metadata; refusing to load it")


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read through ``_MetadataUnpickler``."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = ".metadata" if rank is None else f"__{rank}.metadata"
        data = (Path(self.path) / name).read_bytes()
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError("checkpoint .metadata does not hold DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        if is_compressed(metadata) and not zstd_available():
            # DCP would fail deep inside the read with a bare ValueError; say what to do.
            raise UserError(problem(str(self.path), f"this checkpoint is zstd-compressed "
                                    f"(optimization.checkpoint.compression: zstd) and no zstd "
                                    f"module is installed: {_ZSTD_FIX}"))
        return metadata


def load_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose key starts with ``prefix``, read in this process alone
    (for resharding, inspection and tests; training restores through
    ``FaultRecoveryManager``)."""
    saved = PackedCheckpoint(path, SafeFileSystemReader)
    return saved.read(k for k in saved.keys() if k.startswith(prefix))
