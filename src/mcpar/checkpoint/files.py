"""A checkpoint's files: checksums, validity, discovery, the recovery log, and reading DCP
checkpoints without running code from them. (The layout and commit protocol are described in
``manager.py``, which saves and restores through these.)"""

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
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from mcpar.checkpoint.packing import PackedCheckpoint
from mcpar.errors import UserError, problem

try:  # DCP's zstd stream transform (experimental API); it needs `zstandard` or `pyzstd`
    from torch.distributed.checkpoint._extension import ZStandard
except ImportError:  # pragma: no cover - a torch without it
    ZStandard = None  # type: ignore[assignment,misc]

MANIFEST = "manifest.json"
META = "meta.json"
RECOVERY_LOG = "recovery.jsonl"
DCP_METADATA = ".metadata"
_MANIFEST_FIELDS = {"format_version", "files"}
_ENTRY_FIELDS = {"sha256", "bytes"}
_SHA256 = re.compile(r"[0-9a-f]{64}")
_PACKED_FORMAT = 2  # manifests of this format_version on hold packed tensors (packing.py)
# What resume reads from meta.json (``FaultRecoveryManager.restore``, ``resume_problems``).
_META_FIELDS = {"format_version": int, "step": int, "layout": dict, "strategy": str,
                "data_stream": dict, "config": dict}
# The most a zstd stream can expand (an RLE block: 4 bytes for 128 KiB), with room to spare:
# a compressed item claiming more elements than this is refused before anything is allocated.
_MAX_ZSTD_RATIO = 1 << 17
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
    """None if ``path`` is a valid checkpoint, else why it is not. Never raises: whatever is
    wrong with the files (damage, or a crafted manifest or ``.metadata``) is a reason.

    Valid: ``manifest.json`` has exactly its fields, of their types; every file it lists is
    inside the folder (no absolute path, no ``..``, no symlink out) and matches its size and
    sha256; DCP's ``.metadata`` unpickles through the exact allowlist ``METADATA_GLOBALS`` and
    passes ``check_metadata``; the files the metadata makes DCP open are exactly the manifest's
    shard files, so nothing outside the checksummed folder is ever read."""
    if not (path / MANIFEST).is_file():
        return "no manifest.json (the save did not finish)"
    try:
        _verify(path)
    except (InvalidCheckpointError, pickle.UnpicklingError) as exc:
        return str(exc)
    except Exception as exc:  # a safety net: an invalid checkpoint, never a traceback
        return f"cannot be verified ({type(exc).__name__}: {exc})"
    return None


def _read_manifest(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """The manifest's format version and files (name -> {sha256, bytes}), each file checked to
    be inside ``path``."""
    try:
        manifest = json.loads((path / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidCheckpointError(f"manifest.json is unreadable ({exc})") from None
    if not isinstance(manifest, dict) or set(manifest) != _MANIFEST_FIELDS:
        raise InvalidCheckpointError("manifest.json does not have exactly the fields "
                                     f"{sorted(_MANIFEST_FIELDS)}")
    files = manifest["files"]
    if not _int(manifest["format_version"]) or not isinstance(files, dict):
        raise InvalidCheckpointError("manifest.json has a field of the wrong type")
    for name, entry in files.items():
        if (not isinstance(entry, dict) or set(entry) != _ENTRY_FIELDS
                or not isinstance(entry["sha256"], str) or not _SHA256.fullmatch(entry["sha256"])
                or not _int(entry["bytes"])):
            raise InvalidCheckpointError(f"manifest.json has a malformed entry for {name!r}")
        try:
            inside(path, name)
        except InvalidCheckpointError as exc:
            raise InvalidCheckpointError(f"manifest.json {exc}") from None
    return manifest["format_version"], files


def _verify(path: Path) -> None:
    version, files = _read_manifest(path)
    for required in (META, DCP_METADATA):
        if required not in files:
            raise InvalidCheckpointError(f"manifest.json does not list {required}")
    for name, entry in files.items():
        file = path / name
        if not file.is_file():
            raise InvalidCheckpointError(f"{name} is missing")
        if file.stat().st_size != entry["bytes"]:
            raise InvalidCheckpointError(f"{name} has {file.stat().st_size} bytes, the manifest "
                                         f"says {entry['bytes']}")
        if _sha256(file) != entry["sha256"]:
            raise InvalidCheckpointError(f"{name} fails its sha256 checksum")
    shards = {n: e["bytes"] for n, e in files.items() if n not in (META, DCP_METADATA)}
    _, used = read_metadata_file(path, shards)
    if set(shards) != used:
        raise InvalidCheckpointError(f"manifest.json lists {sorted(set(shards) - used)[0]}, "
                                     "which the checkpoint does not use")
    if version >= _PACKED_FORMAT:
        # The packs' JSON indexes (read through DCP, as resume will) must account for every
        # tensor, each slot inside a pack of its dtype: damage that renames a key or moves a
        # slot is caught here, not as a KeyError half-way through a resume.
        try:
            PackedCheckpoint(path, SafeFileSystemReader)  # DCP's one-process note: hidden there
        except (InvalidCheckpointError, pickle.UnpicklingError):
            raise
        except Exception as exc:
            raise InvalidCheckpointError(f"its tensor indexes cannot be read "
                                         f"({type(exc).__name__}: {exc})") from None
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except ValueError:
        meta = None
    if not isinstance(meta, dict):
        raise InvalidCheckpointError(f"{META} does not hold a JSON object")
    if version >= _PACKED_FORMAT:
        for field, kind in _META_FIELDS.items():
            if not isinstance(meta.get(field), kind):
                raise InvalidCheckpointError(f"{META} lacks its field {field} (a {kind.__name__})")


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

def _torch_dtypes() -> frozenset[tuple[str, str]]:
    """``("torch", "<name>")`` of every dtype this torch has, each an exact attribute name
    (a pickled dtype is ``getattr(torch, name)``; no other attribute of torch is admitted)."""
    return frozenset(("torch", name) for name in dir(torch)
                     if isinstance(getattr(torch, name, None), torch.dtype))


# The exact (module, name) of every global a DCP ``.metadata`` of an mcpar checkpoint pickles,
# recorded by unpickling real checkpoints (one and two ranks, plain and zstd-compressed) with an
# unpickler that logged ``find_class`` on torch 2.13, plus every torch dtype. Nothing is admitted
# by module prefix: a prefix let stdlib and DCP helper classes through whose construction opens
# sockets, closes file descriptors or allocates memory. A newer DCP that pickles another class
# makes its checkpoints invalid here (a clear reason, the previous checkpoint is used) until the
# class is reviewed and listed.
METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),  # an Enum
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),  # a tuple of ints
    ("torch.serialization", "_get_layout"),  # looks a name up in a table of torch layouts
    ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id: the folder the save was written to
}) | _torch_dtypes()
_ZSTD_TRANSFORM = re.compile(re.escape(_ZSTD_DESCRIPTOR) + r"/\d+")


class InvalidCheckpointError(ValueError):
    """A checkpoint's files are not what mcpar writes; ``str()`` says why."""


class MetadataRefusedError(pickle.UnpicklingError):
    """A ``.metadata`` names a global outside ``METADATA_GLOBALS``; it was not built."""


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only the globals of ``METADATA_GLOBALS``; anything else is refused unbuilt."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in METADATA_GLOBALS:
            return super().find_class(module, name)
        raise MetadataRefusedError(f"checkpoint metadata refers to {module}.{name}, which is "
                                   "not checkpoint metadata; refusing to load it")


def _unpickle_metadata(data: bytes) -> Metadata:
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except MetadataRefusedError:
        raise
    except Exception as exc:  # damaged bytes can make the unpickler raise anything
        raise pickle.UnpicklingError(f"checkpoint .metadata is not a readable pickle "
                                     f"({type(exc).__name__}: {exc})") from None
    if type(metadata) is not Metadata:
        raise pickle.UnpicklingError("checkpoint .metadata does not hold DCP metadata")
    return metadata


def inside(folder: Path, name: object) -> Path:
    """``folder/name`` if ``name`` is a relative path that stays inside ``folder`` once
    resolved (symlinks followed), else ``InvalidCheckpointError``."""
    if not isinstance(name, str) or not name or "\x00" in name or "\\" in name:
        raise InvalidCheckpointError(f"names a file {name!r}, which is not a file name")
    rel = Path(name)
    if rel.is_absolute() or ".." in rel.parts:
        raise InvalidCheckpointError(f"names the file {name!r}, outside its own folder")
    root = folder.resolve()
    target = (root / rel).resolve()
    if target == root or not target.is_relative_to(root):
        raise InvalidCheckpointError(f"names the file {name!r}, which resolves outside its own "
                                     f"folder ({target})")
    return target


def _int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _size(value: object) -> bool:
    return type(value) is torch.Size and all(_int(d) for d in value)


def check_metadata(folder: Path, metadata: Metadata, sizes: dict[str, int]) -> set[str]:
    """The files ``metadata`` makes DCP open; ``InvalidCheckpointError`` if it is not the
    metadata of a checkpoint mcpar wrote (``_check_metadata`` says what is checked)."""
    try:
        return _check_metadata(folder, metadata, sizes)
    except (AttributeError, TypeError, ValueError, OverflowError) as exc:
        if isinstance(exc, InvalidCheckpointError):
            raise
        # Fields of a wrong type or missing (each object's fields are the pickle's to set).
        raise InvalidCheckpointError(f".metadata is malformed ({type(exc).__name__}: "
                                     f"{exc})") from None


def _check_metadata(folder: Path, metadata: Metadata, sizes: dict[str, int]) -> set[str]:
    """The files ``metadata`` makes DCP open, after checking that it is the metadata of a
    checkpoint mcpar wrote: every item in a file of ``sizes`` (name -> bytes) inside ``folder``,
    the items of each file tiling it exactly (DCP's writer streams them back to back), every
    chunk of every tensor stored, and no tensor larger than its stored bytes allow.
    ``InvalidCheckpointError`` otherwise."""
    def bad(why: str) -> InvalidCheckpointError:
        return InvalidCheckpointError(f".metadata {why}")

    tensors = metadata.state_dict_metadata
    storage = metadata.storage_data
    if not isinstance(tensors, dict) or not isinstance(storage, dict):
        raise bad("lacks its tables of tensors and storage")
    if not (metadata.storage_meta is None or type(metadata.storage_meta) is StorageMeta):
        raise bad("has a storage_meta of another type")
    if not (metadata.planner_data is None or isinstance(metadata.planner_data, dict)):
        raise bad("has planner_data of another type")
    ranges: dict[str, list[tuple[int, int]]] = {}
    for index, info in storage.items():
        if type(index) is not MetadataIndex or type(info) is not _StorageInfo:
            raise bad("has a storage entry of another type")
        if not (isinstance(index.fqn, str) and _size(index.offset)):
            raise bad("has a malformed storage index")
        try:
            inside(folder, info.relative_path)
        except InvalidCheckpointError as exc:
            raise bad(str(exc)) from None
        if info.relative_path not in sizes:
            raise bad(f"names the file {info.relative_path!r}, which is not one of the "
                      "checkpoint's files")
        if not (_int(info.offset) and _int(info.length)):
            raise bad(f"has a malformed byte range in {info.relative_path}")
        descriptors = info.transform_descriptors
        if descriptors is not None and not (
                isinstance(descriptors, (list, tuple))
                and all(isinstance(d, str) and _ZSTD_TRANSFORM.fullmatch(d)
                        for d in descriptors)):
            raise bad(f"names an unknown transform {descriptors!r}")
        ranges.setdefault(info.relative_path, []).append((info.offset, info.length))
    for name, items in ranges.items():
        end = 0
        for offset, length in sorted(items):
            if offset != end:
                raise bad(f"has items of {name} that overlap or leave a gap at byte {end}")
            end = offset + length
        if end != sizes[name]:
            raise bad(f"has items of {name} that end at byte {end}, the file has {sizes[name]}")
    for fqn, md in tensors.items():
        if not isinstance(fqn, str) or type(md) is not TensorStorageMetadata:
            raise bad(f"has an entry {fqn!r} that is not a tensor")
        props = md.properties
        if type(props) is not TensorProperties or not isinstance(props.dtype, torch.dtype):
            raise bad(f"has malformed tensor properties for {fqn}")
        if not _size(md.size) or not isinstance(md.chunks, list):
            raise bad(f"has a malformed size for {fqn}")
        volume = 0
        for chunk in md.chunks:
            if (type(chunk) is not ChunkStorageMetadata or not _size(chunk.offsets)
                    or not _size(chunk.sizes) or len(chunk.offsets) != len(md.size)
                    or len(chunk.sizes) != len(md.size)
                    or any(o + n > d for o, n, d in zip(chunk.offsets, chunk.sizes, md.size,
                                                        strict=True))):
                raise bad(f"has a chunk of {fqn} outside its tensor")
            info = storage.get(MetadataIndex(fqn, chunk.offsets))
            if info is None:
                raise bad(f"does not say where a chunk of {fqn} is stored")
            numel = 1
            for n in chunk.sizes:
                numel *= n
            volume += numel
            limit = info.length * (_MAX_ZSTD_RATIO if info.transform_descriptors else 1)
            if numel * props.dtype.itemsize > limit:
                raise bad(f"claims more elements of {fqn} than its {info.length} bytes hold")
        numel = 1
        for n in md.size:
            numel *= n
        if volume != numel:
            raise bad(f"has chunks of {fqn} that do not cover it")
    return set(ranges)


def read_metadata_file(folder: Path, sizes: dict[str, int] | None = None,
                       name: str = DCP_METADATA) -> tuple[Metadata, set[str]]:
    """A checkpoint's DCP metadata read without running code from it, and the files it makes
    DCP open (checked by ``check_metadata``; ``sizes``: the files' sizes, by default what is
    on disk)."""
    metadata = _unpickle_metadata(inside(folder, name).read_bytes())
    if sizes is None:
        sizes = {}
        for info in metadata.storage_data.values() if isinstance(metadata.storage_data,
                                                                 dict) else ():
            rel = getattr(info, "relative_path", None)
            if isinstance(rel, str) and rel not in sizes:
                try:
                    file = inside(folder, rel)
                except InvalidCheckpointError as exc:
                    raise InvalidCheckpointError(f".metadata {exc}") from None
                if file.is_file():
                    sizes[rel] = file.stat().st_size
    return metadata, check_metadata(folder, metadata, sizes)


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file reader with the metadata read through ``_MetadataUnpickler`` and checked by
    ``check_metadata``: it opens no file outside the checkpoint's folder."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = DCP_METADATA if rank is None else f"__{int(rank)}{DCP_METADATA}"
        metadata, _ = read_metadata_file(Path(self.path), name=name)
        if metadata.storage_meta is None:
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
