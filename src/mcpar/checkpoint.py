"""Fault recovery: atomic, checksummed, sharded checkpoints and resuming from the newest valid one.

Layout of one checkpoint (``<run_dir>/checkpoints/step-N/``, or ``optimization.checkpoint.dir``):

* ``__<rank>_<i>.distcp`` + ``.metadata``: a ``torch.distributed.checkpoint`` (DCP) save in which
  every rank writes its own tensors. Keys are plain strings that name where a tensor lives in
  the layout, so no DTensor is needed and each rank's part is written by that rank:

  - ``model/pp<p>-tp<t>[-dp<d>]/<chunk>.<name>``: this rank's parameters and persistent buffers;
  - ``optim/pp<p>-tp<t>[-dp<d>]/<chunk>.<name>/<exp_avg|exp_avg_sq|step>``: AdamW state;
  - ``rng/rank<r>/<cpu|cuda>``: the torch generator states of every rank;
  - ``rank<r>/<name>``: state that differs between replicas, for every rank: compression
    error buffers of 1-bit Adam and PowerSGD (``comm/compression_state.py``).

  With ``strategy: full`` every rank writes its model and optimizer state (the ``-dp<d>`` suffix
  keeps data-parallel replicas apart). With ``strategy: selective`` only data-parallel rank 0 of
  each (pipeline, tensor) coordinate writes them, since the other replicas hold the same bits
  (the gradient all-reduce makes every replica step identically); on load every replica reads
  the one copy. RNG states are per rank in both strategies: they differ between ranks.
* ``meta.json`` (rank 0): format version, step, layout, strategy, data stream position, config
  hash and the resolved configuration. Everything that is not a tensor is JSON.
* ``manifest.json``: the sha256 and size of every other file, written last.

Commit protocol: every rank writes into ``step-N.tmp/``; rank 0 then writes ``meta.json``, the
manifest, fsyncs, and renames the folder to ``step-N/``. A checkpoint is valid only if its
manifest exists and every checksum matches, so a save killed half-way (no manifest, or still
``.tmp``) or a file corrupted later is never loaded. The LR schedule is a pure function of the
step and needs no state of its own.

Loading never runs code from the checkpoint: tensors are read by DCP with
``torch.load(weights_only=True)``, and DCP's pickled ``.metadata`` is read here with an unpickler
that only admits DCP's own metadata classes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from mcpar.config import JobConfig
from mcpar.errors import UserError, problem

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
META = "meta.json"
RECOVERY_LOG = "recovery.jsonl"
_STEP_DIR = re.compile(r"step-(\d+)")
# Config sections whose change makes saved state meaningless (shapes, data order, init).
_FROZEN_KEYS = ("model", "data", "training.seed")
# Keys that only change how a run is shown or checkpointed, not what it computes.
_COSMETIC_KEYS = ("optimization.checkpoint", "training.progress", "training.tensorboard",
                  "training.log_interval")


# --- configuration identity ----------------------------------------------------------------------

def _flatten(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, path + "."))
        else:
            out[path] = value
    return out


def _semantic_config(cfg_dump: dict[str, Any]) -> dict[str, Any]:
    flat = _flatten(cfg_dump)
    return {k: v for k, v in flat.items()
            if not any(k == c or k.startswith(c + ".") for c in _COSMETIC_KEYS)}


def config_hash(cfg: JobConfig) -> str:
    """sha256 of the settings that shape the computation (cosmetic keys left out)."""
    text = json.dumps(_semantic_config(cfg.model_dump(mode="json")), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def layout_of(dims: Any, cfg: JobConfig) -> dict[str, int]:
    return {"data": dims.dp, "tensor": dims.tp, "pipeline": dims.pp,
            "virtual_stages": cfg.parallelism.virtual_stages, "world_size": dims.world_size}


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


def checkpoint_dir(cfg: JobConfig, run_dir: Path) -> Path:
    return Path(cfg.optimization.checkpoint.dir or run_dir / "checkpoints")


def read_meta(path: Path) -> dict[str, Any]:
    return json.loads((path / META).read_text())


def resume_problems(meta: dict[str, Any], cfg: JobConfig, layout: dict[str, int]) -> list[str]:
    """Why the checkpoint described by ``meta`` cannot be resumed with this config and layout."""
    problems = []
    if meta.get("format_version") != FORMAT_VERSION:
        problems.append(problem("--resume", f"checkpoint format {meta.get('format_version')} is "
                                f"not the format {FORMAT_VERSION} this version reads"))
    if meta["layout"] != layout:
        problems.append(problem(
            "parallelism",
            f"the checkpoint was saved with layout {meta['layout']} but this run has {layout}; "
            "resuming on another layout (resharding) is not available in this version: resume "
            "with the saved degrees"))
    saved = _flatten(meta["config"])
    now = _flatten(cfg.model_dump(mode="json"))
    for key in sorted(saved):
        if any(key == f or key.startswith(f + ".") for f in _FROZEN_KEYS) and \
                saved[key] != now.get(key):
            problems.append(problem(key, f"the checkpoint was trained with {saved[key]!r}, this "
                                    f"run has {now.get(key)!r}; resume with the saved value"))
    return problems


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
        return metadata


def load_tensors(path: Path, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint whose key starts with ``prefix``, read in this process alone
    (for inspection and tests; training restores through ``FaultRecoveryManager``)."""
    reader = SafeFileSystemReader(path)
    state: dict[str, torch.Tensor] = {}
    for key, md in reader.read_metadata().state_dict_metadata.items():
        if key.startswith(prefix) and isinstance(md, TensorStorageMetadata):
            state[key] = torch.empty(md.size, dtype=md.properties.dtype)
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state


# --- the manager ---------------------------------------------------------------------------------

class FaultRecoveryManager:
    """Saves this rank's part of every checkpoint and restores the newest valid one.

    Every method is collective: all ranks call it at the same point of the loop.
    """

    def __init__(self, cfg: JobConfig, run_dir: Path, dims: Any, chunks: list[torch.nn.Module],
                 optimizer: torch.optim.Optimizer, stream: Any, rank: int,
                 barrier: Callable[[], None], agree: Callable[[int], int],
                 rank_state: Any = None):
        """``rank_state``: an object with ``tensors()`` (name -> live tensor) and
        ``load(tensors)`` for per-rank state such as compression errors; None for none."""
        self.cfg = cfg
        self.ckpt = cfg.optimization.checkpoint
        self.dir = checkpoint_dir(cfg, run_dir)
        self.dims = dims
        self.chunks = chunks
        self.optimizer = optimizer
        self.stream = stream
        self.rank = rank
        self.barrier = barrier
        self.agree = agree  # rank 0's integer, known to every rank
        self.rank_state = rank_state
        self.layout = layout_of(dims, cfg)
        self.log = RecoveryLog(run_dir, enabled=rank == 0)
        self.stop_requested = False
        self.distributed = dist.is_initialized()

    @property
    def enabled(self) -> bool:
        return self.ckpt.interval > 0

    def install_sigterm_handler(self) -> None:
        """SIGTERM asks for a checkpoint at the end of the current step, then a clean stop."""
        def handler(_signum: int, _frame: object) -> None:
            self.stop_requested = True
        signal.signal(signal.SIGTERM, handler)

    # --- state dict ------------------------------------------------------------------------------
    def _coord(self, strategy: str) -> str:
        coord = f"pp{self.dims.axis_rank('pp')}-tp{self.dims.axis_rank('tp')}"
        return coord if strategy == "selective" else f"{coord}-dp{self.dims.axis_rank('dp')}"

    def _named_tensors(self) -> dict[str, torch.Tensor]:
        """This rank's parameters and persistent buffers by local name; a tied tensor once."""
        out: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for index, chunk in enumerate(self.chunks):
            for name, tensor in chunk.state_dict(keep_vars=True).items():
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    out[f"{index}.{name}"] = tensor
        return out

    def _rng_states(self) -> dict[str, torch.Tensor]:
        states = {f"rng/rank{self.rank}/cpu": torch.get_rng_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            states[f"rng/rank{self.rank}/cuda"] = torch.cuda.get_rng_state()
        return states

    def _state_dict(self, strategy: str, saved_keys: set[str] | None) -> dict[str, torch.Tensor]:
        """The tensors this rank saves (or loads into). ``saved_keys``: the checkpoint's keys,
        when loading, so that optimizer state is only expected where it was saved."""
        state: dict[str, torch.Tensor] = {}
        writes_shards = (strategy == "full" or self.dims.axis_rank("dp") == 0
                         or saved_keys is not None)
        if writes_shards:
            coord = self._coord(strategy)
            named = self._named_tensors()
            for name, tensor in named.items():
                state[f"model/{coord}/{name}"] = tensor.detach()
            by_id = {id(t): n for n, t in named.items()}
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    prefix = f"optim/{coord}/{by_id[id(p)]}"
                    if saved_keys is None:
                        for key, value in self.optimizer.state.get(p, {}).items():
                            state[f"{prefix}/{key}"] = value
                    elif f"{prefix}/step" in saved_keys:
                        # Preallocate AdamW's state so DCP can load into it in place.
                        self.optimizer.state[p] = {
                            "step": torch.zeros((), dtype=torch.float32),
                            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                            "exp_avg_sq": torch.zeros_like(p,
                                                           memory_format=torch.preserve_format),
                        }
                        for key, value in self.optimizer.state[p].items():
                            state[f"{prefix}/{key}"] = value
        for key, value in self._rng_states().items():
            state[key] = value.clone() if saved_keys is not None else value
        if self.rank_state is not None and saved_keys is None:
            for name, value in self.rank_state.tensors().items():
                state[f"rank{self.rank}/{name}"] = value
        return state

    # --- save ------------------------------------------------------------------------------------
    def save(self, step: int) -> Path:
        """Write the checkpoint of ``step`` (optimizer steps done) and commit it atomically."""
        t0 = time.perf_counter()
        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            # A leftover of a save killed at this step: never valid, and in the way.
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        self.barrier()
        dcp.save(self._state_dict(self.ckpt.strategy, None),
                 storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        self.barrier()  # every rank's files are on disk before rank 0 checksums them
        if self.rank == 0:
            meta = {"format_version": FORMAT_VERSION, "step": step, "layout": self.layout,
                    "strategy": self.ckpt.strategy, "data_stream": self.stream.state_dict(),
                    "config_hash": config_hash(self.cfg), "torch": torch.__version__,
                    "config": self.cfg.model_dump(mode="json")}
            _write_synced(tmp / META, json.dumps(meta, indent=2))
            files = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
                     for p in sorted(tmp.iterdir()) if p.is_file()}
            _write_synced(tmp / MANIFEST, json.dumps({"format_version": FORMAT_VERSION,
                                                      "files": files}, indent=2))
            _fsync_dir(tmp)
            if final.exists():  # an older save of the same step (e.g. before a restart)
                shutil.rmtree(final)
            os.replace(tmp, final)
            _fsync_dir(self.dir)
            self.log.log("save", step=step, path=str(final), strategy=self.ckpt.strategy,
                         bytes=sum(f["bytes"] for f in files.values()),
                         seconds=round(time.perf_counter() - t0, 4))
            self._prune()
        self.barrier()
        return final

    def _prune(self) -> None:
        for _, path in list_checkpoints(self.dir)[self.ckpt.keep:]:
            shutil.rmtree(path, ignore_errors=True)
            self.log.log("delete", path=str(path))

    # --- load ------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Restore the newest valid checkpoint; return the step it holds (0 if none)."""
        found = find_latest_valid(self.dir, self.log) if self.rank == 0 else None
        # Rank 0 alone verifies checksums, then tells everyone which step it chose.
        step = self.agree(found[0] if found else -1)
        if step < 0:
            self.log.log("no_checkpoint", echo=True, dir=str(self.dir),
                         action="starting from step 0")
            return 0
        path = self.dir / f"step-{step}"
        meta = read_meta(path)
        problems = resume_problems(meta, self.cfg, self.layout)
        if problems:
            raise UserError(problems)
        reader = SafeFileSystemReader(path)
        saved_keys = set(reader.read_metadata().state_dict_metadata)
        state = self._state_dict(meta["strategy"], saved_keys)
        missing = sorted(k for k in state if k not in saved_keys)
        if missing:
            raise UserError(problem("--resume", f"checkpoint {path} lacks {missing[0]} (and "
                                    f"{len(missing) - 1} more keys); it was not written by "
                                    "this layout"))
        # Per-rank state is loaded into fresh tensors of the saved shapes, then handed over
        # (PowerSGD's matrices do not exist before its first compressed step).
        prefix = f"rank{self.rank}/"
        metadata = reader.read_metadata().state_dict_metadata
        rank_tensors = {key: torch.zeros(tuple(metadata[key].size),
                                         dtype=metadata[key].properties.dtype)
                        for key in saved_keys if key.startswith(prefix)}
        state.update(rank_tensors)
        dcp.load(state, storage_reader=reader)
        if self.rank_state is not None:
            self.rank_state.load({key[len(prefix):]: value
                                  for key, value in rank_tensors.items()})
        torch.set_rng_state(state[f"rng/rank{self.rank}/cpu"])
        cuda_key = f"rng/rank{self.rank}/cuda"
        if cuda_key in state:
            torch.cuda.set_rng_state(state[cuda_key])
        self.stream.load_state_dict(meta["data_stream"])
        self.log.log("load", echo=True, step=step, path=str(path))
        return step
