"""Fault recovery: atomic, checksummed, sharded checkpoints and resuming from the newest valid one.

Layout of one checkpoint (``<run_dir>/checkpoints/step-N/``, or ``optimization.checkpoint.dir``):

* ``__<rank>_<i>.distcp`` + ``.metadata``: a ``torch.distributed.checkpoint`` (DCP) save in which
  every rank writes its own tensors. Keys are plain strings that name where a tensor lives in
  the layout, so no DTensor is needed and each rank's part is written by that rank:

  - ``model/pp<p>-tp<t>[-ep<e>][-dp<d>]/<chunk>.<name>``: this rank's parameters and
    persistent buffers (``-ep<e>`` with expert parallelism: expert ranks hold other experts);
  - ``optim/pp<p>-tp<t>[-ep<e>][-dp<d>]/<chunk>.<name>/<exp_avg|exp_avg_sq|step>``: AdamW state;
  - ``rng/rank<r>/<cpu|cuda>``: the torch generator states of every rank;
  - ``rank<r>/<name>``: state that differs between replicas, for every rank: compression
    error buffers of 1-bit Adam and PowerSGD (``comm/compression_state.py``).

  On disk these tensors are packed into one flat tensor per key group and dtype, with a JSON
  index, because DCP's per-tensor cost made saves CPU-bound (``checkpoint_packing.py``);
  ``load_tensors`` and resume read them back by these keys.

  With ``strategy: full`` every rank writes its model and optimizer state (the ``-dp<d>`` suffix
  keeps replicas apart: d is the rank's index on the MemoryController's shard axis, data x
  context under context parallelism). With ``strategy: selective`` only data-parallel rank 0 of
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

Asynchronous saves (``optimization.checkpoint.async_save``, the default): ``save`` stages this
rank's tensors into CPU buffers and captures the step, data position and RNG states, then
returns before the next optimizer step; a background thread writes the files and runs the same
commit, with its collectives on a gloo group of its own (``checkpoint_async.py`` says why). Rank
0 commits only after DCP has gathered every rank's write results, i.e. after every shard file is
written and fsynced, so a kill at any point of an asynchronous save leaves a ``.tmp`` folder
without a manifest, never a valid checkpoint. One save is in flight at a time: the next save,
``restore`` and ``wait`` (the end of training) wait for it and raise its error, if any.

Compression (``optimization.checkpoint.compression: zstd``): DCP's zstd stream extension
compresses every tensor as it is written; ``.metadata`` records it per item, so loading is
transparent. The manifest's checksums are of the compressed files, as written.

Loading never runs code from the checkpoint: tensors are read by DCP with
``torch.load(weights_only=True)``, and DCP's pickled ``.metadata`` is read with an unpickler
that admits only the exact globals of ``files.METADATA_GLOBALS``. Nor does it wander: every file
the manifest lists and every file the metadata makes DCP open must resolve inside the step's
own folder and be one of the manifest's checksummed files. Any damage to the manifest, the
metadata, ``meta.json`` or the packs' indexes makes the checkpoint invalid (``verify_checkpoint``
gives the reason), and resume falls back to the previous valid one, logged in recovery.jsonl.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from mcpar.checkpoint import packing
from mcpar.checkpoint.async_save import (
    BackgroundSave,
    CheckpointSaveError,
    Coordination,
    StagingBuffers,
    apply_test_delay,
)
from mcpar.checkpoint.files import (  # noqa: F401  (re-exported: the files' API)
    _ZSTD_DESCRIPTOR,
    _ZSTD_FIX,
    MANIFEST,
    META,
    RECOVERY_LOG,
    RecoveryLog,
    SafeFileSystemReader,
    ZStandard,
    _fsync_dir,
    _sha256,
    _write_synced,
    find_latest_valid,
    is_compressed,
    list_checkpoints,
    load_tensors,
    verify_checkpoint,
    zstd_available,
)
from mcpar.checkpoint.layout import MODEL_DEGREES, keyed_alike, layout_of, saved_layout
from mcpar.checkpoint.packing import PackedCheckpoint, dcp_in_one_process
from mcpar.checkpoint.reshard_restore import (
    reshard_problems,
    restarted_state,
    restore_resharded,
)
from mcpar.config import JobConfig
from mcpar.elastic import resize_record
from mcpar.errors import UserError, problem
from mcpar.plan import JobPlan

if TYPE_CHECKING:
    from mcpar.comm.compression_state import RankState
    from mcpar.data.stream import BatchStream
    from mcpar.topology import ParallelDims

FORMAT_VERSION = 2  # 2: tensors packed per group and dtype (checkpoint_packing.py)
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
    saved = _flatten(meta["config"])
    now = _flatten(cfg.model_dump(mode="json"))
    for key in sorted(saved):
        if any(key == f or key.startswith(f + ".") for f in _FROZEN_KEYS) and \
                saved[key] != now.get(key):
            problems.append(problem(key, f"the checkpoint was trained with {saved[key]!r}, this "
                                    f"run has {now.get(key)!r}; resume with the saved value"))
    return problems


def optim_prefix(p: torch.nn.Parameter, name_of: dict[int, str], coord: str,
                 replica_coord: str) -> str:
    """Where a parameter's optimizer state is saved. A ZeRO shard piece (``source``, ``start``,
    ``end``: see ``controllers/memory/zero.py``) is saved by its replica, whatever the strategy,
    under the coordinate with the data rank (each pack has one writer), as the elements
    [start, end) of its parameter's flattened state: the pieces of all replicas together make
    the whole, whatever the sharding."""
    source = getattr(p, "source", None)
    if source is None:
        return f"optim/{coord}/{name_of[id(p)]}"
    return f"optim/{replica_coord}/{name_of[id(source)]}@{p.start}:{p.end}"


# --- the manager ---------------------------------------------------------------------------------

class FaultRecoveryManager:
    """Saves this rank's part of every checkpoint and restores the newest valid one.

    Every method is collective: all ranks call it at the same point of the loop (the
    constructor too: it may create the process group of asynchronous saves).
    """

    def __init__(self, plan: JobPlan, run_dir: Path, dims: ParallelDims,
                 chunks: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 stream: BatchStream, rank: int,
                 barrier: Callable[[], None], agree: Callable[[int], int],
                 rank_state: RankState | None = None,
                 full_params: Callable[[bool], contextlib.AbstractContextManager[None]]
                 | None = None):
        """``rank_state``: an object with ``tensors()`` (name -> live tensor) and
        ``load(tensors)`` for per-rank state such as compression errors; None for none.
        ``full_params``: ZeRO-3's gather of every parameter for the time of a save (False) or a
        restore (True: the shards are then taken from what was loaded); the checkpoint's model
        keys are the unsharded parameters', whatever the stage."""
        cfg = self.cfg = plan.config
        # ZeRO: every replica owns a different shard of the optimizer state and saves it.
        self.sharded = plan.memory.data_sharded
        self.shard_axis = plan.memory.shard_axis
        self.ckpt = cfg.optimization.checkpoint
        self.dir = checkpoint_dir(cfg, run_dir)
        self.dims = dims
        self.chunks = chunks
        self.full_params = full_params or (lambda _write_back: contextlib.nullcontext())
        self.optimizer = optimizer
        self.stream = stream
        self.rank = rank
        self.barrier = barrier
        self.agree = agree  # rank 0's integer, known to every rank
        self.rank_state = rank_state
        self.layout = layout_of(plan)
        self.log = RecoveryLog(run_dir, enabled=rank == 0)
        self.stop_requested = False
        self.distributed = dist.is_initialized()
        if self.enabled and self.ckpt.compression == "zstd" and not zstd_available():
            raise UserError(problem("optimization.checkpoint.compression",
                                    f"zstd needs a zstd module, and none is installed: "
                                    f"{_ZSTD_FIX}; or set it to none"))
        # Synchronous saves coordinate on the training's own collectives, between steps.
        self._sync_coord = Coordination.default(agree)
        self.async_save = self.enabled and self.ckpt.async_save
        self._async_coord = self._sync_coord  # one process: nothing runs concurrently
        if self.async_save and self.distributed and dist.get_world_size() > 1:
            # Created by every rank, here, in the same order: new_group is collective.
            self._async_coord = Coordination.for_group(dist.new_group(
                backend="gloo", group_desc="mcpar_checkpoint"), rank)
        self._staging = StagingBuffers()
        self._pending: BackgroundSave | None = None
        # Set by restore: the state came from optimization.checkpoint.load_from (another run).
        self.loaded_from_other_run = False

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
        if self.dims.ep > 1:
            # Expert groups hold different experts: one shard per expert-axis rank.
            coord += f"-ep{self.dims.axis_rank('ep')}"
        # The replica's index among the dense parameters' replicas (ZeRO's shard axis: data x
        # context under context parallelism), so that every ZeRO shard has one writer.
        replica = self.dims.axis_rank(self.shard_axis)
        return coord if strategy == "selective" else f"{coord}-dp{replica}"

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
        # 'edp' rank 0: the first replica of each expert group (data rank 0 without experts);
        # context ranks hold replicas too, written by the first.
        writes_shards = (strategy == "full" or self.dims.axis_rank("edp") == 0
                         and self.dims.axis_rank("cp") == 0 or saved_keys is not None)
        sharded = self.sharded
        if writes_shards or sharded:
            coord = self._coord(strategy)
            named = self._named_tensors()
            if writes_shards:
                for name, tensor in named.items():
                    state[f"model/{coord}/{name}"] = tensor.detach()
            by_id = {id(t): n for n, t in named.items()}
            for group in self.optimizer.param_groups:
                for p in group["params"]:
                    prefix = optim_prefix(p, by_id, coord, self._coord("full"))
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
        """Checkpoint ``step`` (optimizer steps done); the path it is committed to.

        Synchronous: written and committed on return. Asynchronous: on return this rank's state
        is staged (copied), so the caller may step the optimizer at once; the files are written
        and committed in the background, and ``wait`` (or the next save) blocks until they are.
        """
        t0 = time.perf_counter()
        # One save in flight: its staging buffers are reused, and its error surfaces here.
        waited = self.wait()
        # What resume needs besides the tensors, captured now (as JSON text: nothing the
        # training thread mutates later can leak into it).
        meta = json.dumps(self._meta(step), indent=2) if self.rank == 0 else ""
        timing = {"t0": t0, "waited": waited}
        with self.full_params(False):
            state = self._state_dict(self.ckpt.strategy, None)
            if not self.async_save:
                self._write_and_commit(step, packing.pack(state), None, meta,
                                       self._sync_coord, timing)
                return self.dir / f"step-{step}"
            staged, ready = self._staging.stage(state)
            if ready is not None:
                ready.synchronize()  # the copies are done before ZeRO-3 frees the parameters
        timing["staged"] = time.perf_counter() - t0
        self._pending = BackgroundSave(step, lambda: self._write_and_commit(
            step, staged, ready, meta, self._async_coord, timing))
        return self.dir / f"step-{step}"

    @property
    def pending_step(self) -> int | None:
        """The step of the asynchronous save still in flight, if any."""
        return self._pending.step if self._pending is not None else None

    def wait(self) -> float:
        """Block until the save in flight (if any) is committed; the seconds waited. Raises
        ``CheckpointSaveError`` (on every rank) if that save failed."""
        pending, self._pending = self._pending, None
        return pending.wait() if pending is not None else 0.0

    def close(self) -> None:
        """The end of training: the last checkpoint is committed before the run ends."""
        self.wait()

    def _meta(self, step: int) -> dict[str, Any]:
        return {"format_version": FORMAT_VERSION, "step": step, "layout": self.layout,
                "strategy": self.ckpt.strategy, "compression": self.ckpt.compression,
                "data_stream": self.stream.state_dict(), "config_hash": config_hash(self.cfg),
                "torch": torch.__version__, "config": self.cfg.model_dump(mode="json")}

    def _writer(self, path: Path) -> dcp.FileSystemWriter:
        extensions = [ZStandard()] if self.ckpt.compression == "zstd" else None
        return dcp.FileSystemWriter(path, sync_files=True, _extensions=extensions)

    def _write_and_commit(self, step: int, state: dict[str, torch.Tensor], ready: Any,
                          meta: str, coord: Coordination, timing: dict[str, float]) -> None:
        """Write every rank's files into ``step-N.tmp`` and let rank 0 commit them.

        Runs on the training thread (synchronous) or the save's thread (asynchronous, with
        ``coord`` over the save's own group). A failure on rank 0 is told to every rank, so
        that all of them raise and none waits forever on a collective."""
        final = self.dir / f"step-{step}"
        tmp = self.dir / f"step-{step}.tmp"
        error: Exception | None = None
        if self.rank == 0:
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
                # A leftover of a save killed at this step: never valid, and in the way.
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            except OSError as exc:
                error = exc
        if coord.agree(int(error is not None)):
            raise error or CheckpointSaveError(f"rank 0 could not create {tmp}")
        if ready is not None:
            ready.synchronize()  # the staging copies from the GPU have landed
        t_write, cpu0 = time.perf_counter(), time.thread_time()
        # One process: no collectives at all (the default group may be busy on the training
        # thread, and there is nobody to coordinate with).
        alone = not self.distributed or dist.get_world_size() == 1
        with dcp_in_one_process() if alone else contextlib.nullcontext():
            dcp.save(state, storage_writer=self._writer(tmp), process_group=coord.group,
                     no_dist=alone)
        # Each rank checksums the shard files it wrote (DCP names them ``__<rank>_<i>``), which
        # spreads the hashing over the ranks. The gather is also what tells rank 0 that every
        # rank's files are written and fsynced: a rank joins it only after its own write.
        own = {p.name: {"sha256": _sha256(p), "bytes": p.stat().st_size}
               for p in tmp.glob(f"__{self._dcp_rank(coord)}_*") if p.is_file()}
        reports = coord.gather(own)
        write_s = time.perf_counter() - t_write
        apply_test_delay(step, self.rank)
        if self.rank == 0:
            try:
                assert reports is not None
                files = self._commit(tmp, final, meta,
                                     {k: v for report in reports for k, v in report.items()})
                self.log.log("save", step=step, path=str(final), strategy=self.ckpt.strategy,
                             compression=self.ckpt.compression, asynchronous=self.async_save,
                             bytes=sum(f["bytes"] for f in files.values()),
                             seconds=round(time.perf_counter() - timing["t0"], 4),
                             write_seconds=round(write_s, 4),
                             # CPU time of this thread: what an asynchronous save takes from
                             # training on a machine whose cores are all busy.
                             cpu_seconds=round(time.thread_time() - cpu0, 4),
                             blocked_seconds=round(timing.get("staged", 0.0), 4)
                             if self.async_save else None,
                             waited_seconds=round(timing["waited"], 4))
                self._prune()
            except Exception as exc:
                error = exc
                self.log.log("save_failed", echo=True, step=step, error=repr(exc))
        if coord.agree(int(error is not None)):
            raise error or CheckpointSaveError(f"rank 0 could not commit the checkpoint of "
                                               f"step {step} (its recovery.jsonl says why)")

    @staticmethod
    def _dcp_rank(coord: Coordination) -> int:
        """This process's rank in DCP's numbering (its rank in the save's group)."""
        return dist.get_rank(coord.group) if dist.is_initialized() else 0

    def _commit(self, tmp: Path, final: Path, meta: str,
                hashed: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        """Rank 0: ``meta.json``, then the manifest of checksums, fsync, rename. Until the
        rename the folder is ``.tmp`` and has no manifest: never taken for a checkpoint.
        ``hashed``: the ranks' checksums of their shards; every other file (DCP's
        ``.metadata``, ``meta.json``) is hashed here."""
        _write_synced(tmp / META, meta)
        files = {p.name: hashed.get(p.name) or {"sha256": _sha256(p), "bytes": p.stat().st_size}
                 for p in sorted(tmp.iterdir()) if p.is_file()}
        _write_synced(tmp / MANIFEST, json.dumps({"format_version": FORMAT_VERSION,
                                                  "files": files}, indent=2))
        _fsync_dir(tmp)
        if final.exists():  # an older save of the same step (e.g. before a restart)
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(self.dir)
        return files

    def _prune(self) -> None:
        """Delete all but the newest ``keep`` checkpoints, and the ``.tmp`` folders of saves
        that were killed (called after a commit, when no other save is in flight)."""
        for _, path in list_checkpoints(self.dir)[self.ckpt.keep:]:
            shutil.rmtree(path, ignore_errors=True)
            self.log.log("delete", path=str(path))
        for path in self.dir.glob("step-*.tmp"):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
                self.log.log("delete", path=str(path), reason="unfinished save")

    # --- load ------------------------------------------------------------------------------------
    def restore(self) -> int:
        """Restore the newest valid checkpoint; return the step it holds (0 if none)."""
        with self.full_params(True):
            return self._restore()

    def _carry_rank_state(self, path: Path, old: dict[str, int]) -> list[str]:
        """Per-rank state that follows the layout change (what follows which change is each
        part's call: 1-bit errors a change of the data degree alone, the balancer's state any
        change that keeps the expert degree), read back one old rank at a time; the names of
        what was carried."""
        carry = getattr(self.rank_state, "reshard", None)
        if carry is None:
            return []
        same_model = all(old.get(key) == self.layout.get(key) for key in MODEL_DEGREES)
        same_experts = old.get("experts", 1) == self.layout.get("experts", 1)

        def read_rank(rank: int) -> dict[str, torch.Tensor]:
            prefix = f"rank{rank}/"
            return {key[len(prefix):]: value
                    for key, value in load_tensors(path, prefix).items()}
        return carry(read_rank, int(old["world_size"]), same_model=same_model,
                     same_experts=same_experts)

    def _restore(self) -> int:
        self.wait()  # a save of this process still in flight is part of what may be restored
        found = find_latest_valid(self.dir, self.log) if self.rank == 0 else None
        # Rank 0 alone verifies checksums, then tells everyone which step it chose.
        step = self.agree(found[0] if found else -1)
        self.loaded_from_other_run = step < 0 and self.ckpt.load_from is not None
        if self.loaded_from_other_run:
            # Another run's checkpoint, resolved and verified by the launcher (load_from.py).
            path = Path(str(self.ckpt.load_from))
            step = int(read_meta(path)["step"])
            self.log.log("load_from", echo=True, step=step, path=str(path))
        elif step < 0:
            self.log.log("no_checkpoint", echo=True, dir=str(self.dir),
                         action="starting from step 0")
            return 0
        else:
            path = self.dir / f"step-{step}"
        meta = read_meta(path)
        problems = resume_problems(meta, self.cfg, self.layout)
        if problems:
            raise UserError(problems)
        old = saved_layout(meta)
        same = keyed_alike(old, self.layout)
        if same:
            saved = PackedCheckpoint(path, SafeFileSystemReader)
            saved_keys = saved.keys()
            state = self._state_dict(meta["strategy"], saved_keys)
            missing = sorted(k for k in state if k not in saved_keys)
            # ZeRO shards follow the gradient buckets: other bucket sizes cut other pieces.
            same = not (missing and (old["zero_stage"] or self.layout["zero_stage"]))
        if not same:
            # Saved under other degrees (or ZeRO sharding): rebuild this rank's shards.
            problems = reshard_problems(meta)
            if problems:
                raise UserError(problems)
            # training.elastic: the job goes on with fewer (or again more) workers.
            resized = resize_record(meta["config"], int(old["world_size"]), self.cfg,
                                    self.layout["world_size"])
            peak = restore_resharded(self, path, meta)
            carried = self._carry_rank_state(path, old)
            self.stream.load_state_dict(meta["data_stream"])
            self.log.log("load", echo=True, step=step, path=str(path),
                         resharded_from=meta["layout"], resharded_to=self.layout,
                         restarted=[s for s in restarted_state(meta) if s not in carried],
                         **({"carried": carried} if carried else {}),
                         # What the reading held above this rank's own state.
                         **({"host_peak_mb": round(peak / 2**20, 1)}
                            if peak is not None else {}))
            if resized is not None:
                self.log.log("elastic", echo=True, step=step, path=str(path), **resized)
            return step
        if missing:
            raise UserError(problem("--resume", f"checkpoint {path} lacks {missing[0]} (and "
                                    f"{len(missing) - 1} more keys); it was not written by "
                                    "this layout"))
        # Per-rank state comes back in tensors of the saved shapes and is handed over
        # (PowerSGD's matrices do not exist before its first compressed step).
        prefix = f"rank{self.rank}/"
        loaded = saved.read([*state, *(k for k in saved_keys if k.startswith(prefix))])
        with torch.no_grad():
            for key, live in state.items():
                live.copy_(loaded[key])
        rank_tensors = {k: v for k, v in loaded.items() if k.startswith(prefix)}
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
