"""Packing a rank's checkpoint tensors into a few flat tensors, and reading them back by name.

Why not hand DCP the tensors one by one: DCP's file writer serializes every tensor with its own
``torch.save`` call, which costs about 0.7 ms of CPU per tensor whatever its size. A rank of the
built-in model holds ~210 tensors (parameters, two AdamW moments and a ``step`` scalar each), so
a save spent ~0.15 s of CPU in per-tensor overhead for 11 MB of data; packed into a handful of
flat tensors the same bytes cost ~0.02 s (two gloo ranks, ``torch.distributed.checkpoint.save``
timed with ``time.thread_time``). An asynchronous save runs on a core that training also uses,
so that CPU time is taken straight from training.

The format: the logical keys (``model/<coord>/<name>``, ``optim/...``, ``rng/rank<r>/cpu``,
``rank<r>/...``, see ``manager.py``) are grouped by their first two components, and within a
group by dtype. Each group/dtype becomes one 1-D tensor ``<group>/__packed__/<dtype>`` holding
the tensors' elements back to back, and each group gets an index ``<group>/__packed__/index``:
a uint8 tensor holding JSON (key, dtype, shape, offset of every tensor). The index is a tensor,
not a pickled object, so reading a checkpoint still runs no code from it, and it sits in the
rank's own shard file, under the manifest's checksums. Each group is written by exactly one
rank, as the logical keys were.
"""

from __future__ import annotations

import contextlib
import json
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

MARK = "__packed__"
INDEX = "index"
_ITEM_FIELDS = {"key", "pack", "dtype", "shape", "offset"}
# DCP's UserWarning at each save or load without a process group (torch 2.x's words, the save's
# and both loads'). mcpar means exactly that there: one worker saving, or a rank reading its
# checkpoint files alone, so it would only repeat at every checkpoint.
_DCP_ONE_PROCESS = (r"torch\.distributed is (disabled, )?unavailable or uninitialized, "
                    r"assuming the intent is to (save|load) in a single process")


@contextlib.contextmanager
def dcp_in_one_process() -> Iterator[None]:
    """Around a DCP save or load that mcpar makes in one process: hides DCP's note that it
    assumes one process, and no other warning.

    On the main thread the filter lasts for the call only (``warnings.catch_warnings``). That
    swaps the process-wide filter list, so on another thread (an asynchronous save, while the
    training thread runs) it could drop a filter the training thread adds meanwhile; there the
    same narrow filter is installed once for the process instead."""
    if threading.current_thread() is not threading.main_thread():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS, category=UserWarning)
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_DCP_ONE_PROCESS, category=UserWarning)
        yield


def group_of(key: str) -> str:
    """The pack a logical key goes into: its first two path components."""
    parts = key.split("/")
    return "/".join(parts[:2]) if len(parts) > 2 else parts[0]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype(name: str) -> torch.dtype:
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype):  # the index is data: never look up anything else
        raise ValueError(f"checkpoint index names an unknown dtype {name!r}")
    return found


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


@dataclass(frozen=True)
class Entry:
    """Where one logical tensor lives inside its pack."""

    pack: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


def plan(state: dict[str, torch.Tensor]) -> tuple[dict[str, Entry], dict[str, int]]:
    """The entry of every key of ``state``, and the element count of every pack."""
    entries: dict[str, Entry] = {}
    sizes: dict[str, int] = {}
    for key, tensor in state.items():
        pack = f"{group_of(key)}/{MARK}/{_dtype_name(tensor.dtype)}"
        offset = sizes.get(pack, 0)
        entries[key] = Entry(pack, tensor.dtype, tuple(tensor.shape), offset)
        sizes[pack] = offset + tensor.numel()
    return entries, sizes


def index_tensors(entries: dict[str, Entry]) -> dict[str, torch.Tensor]:
    """One JSON index per group, as uint8 tensors."""
    groups: dict[str, list[dict]] = {}
    for key, e in entries.items():
        groups.setdefault(group_of(key), []).append(
            {"key": key, "pack": e.pack, "dtype": _dtype_name(e.dtype), "shape": list(e.shape),
             "offset": e.offset})
    return {f"{group}/{MARK}/{INDEX}": torch.frombuffer(bytearray(json.dumps(items).encode()),
                                                         dtype=torch.uint8)
            for group, items in groups.items()}


def fill(state: dict[str, torch.Tensor], entries: dict[str, Entry],
         packs: dict[str, torch.Tensor], non_blocking: bool = False) -> None:
    """Copy every tensor of ``state`` into its slot of ``packs`` (flat buffers of
    ``plan``'s sizes)."""
    for key, tensor in state.items():
        e = entries[key]
        packs[e.pack].narrow(0, e.offset, e.numel).view(e.shape).copy_(
            tensor.detach(), non_blocking=non_blocking)


def pack(state: dict[str, torch.Tensor],
         allocate: Callable[[str, torch.dtype, int], torch.Tensor] | None = None,
         non_blocking: bool = False) -> dict[str, torch.Tensor]:
    """``state`` packed into flat CPU tensors, indexes included (what DCP is given).

    ``allocate(pack_name, dtype, numel)`` supplies each flat buffer (default: a fresh one), so
    that asynchronous saves can reuse theirs from one save to the next."""
    entries, sizes = plan(state)
    dtypes = {e.pack: e.dtype for e in entries.values()}
    packs = {name: (allocate(name, dtypes[name], n) if allocate is not None
                    else torch.empty(n, dtype=dtypes[name]))
             for name, n in sizes.items()}
    fill(state, entries, packs, non_blocking)
    return {**packs, **index_tensors(entries)}


class PackedCheckpoint:
    """A packed checkpoint on disk: its logical keys, and their tensors read on demand.

    Reads are local (``no_dist``): every rank opens the shard files it needs itself, so reading
    needs no collective and works in any process (resume, resharding, tests, inspection).
    """

    def __init__(self, path: Path, reader_factory) -> None:
        self.path = path
        self._reader_factory = reader_factory  # a fresh storage reader per DCP load
        metadata = reader_factory(path).read_metadata().state_dict_metadata
        self._sizes = {k: tuple(md.size) for k, md in metadata.items()
                       if isinstance(md, TensorStorageMetadata)}
        dtypes = {k: md.properties.dtype for k, md in metadata.items()
                  if isinstance(md, TensorStorageMetadata)}
        index_keys = [k for k in self._sizes if k.endswith(f"/{MARK}/{INDEX}")]
        for key in index_keys:
            if len(self._sizes[key]) != 1 or dtypes[key] != torch.uint8:
                raise ValueError(f"checkpoint index {key} is not a byte string")
        raw = self._load({k: torch.empty(self._sizes[k], dtype=torch.uint8) for k in index_keys})
        self.entries: dict[str, Entry] = {}
        for index_key, tensor in raw.items():
            try:
                items = json.loads(bytes(tensor.numpy()).decode())
                if not isinstance(items, list):
                    raise TypeError("not a list")
                for item in items:
                    key, entry = self._entry(item, dtypes)
                    if key in self.entries:
                        raise ValueError(f"{key} is listed twice")
                    self.entries[key] = entry
            except (KeyError, TypeError, ValueError) as exc:
                raise ValueError(f"checkpoint index {index_key} is malformed ({exc})") from None
        # Every tensor of the checkpoint is an index or a pack that an index names: a key
        # renamed in the metadata is damage, not a tensor to ignore.
        named = set(index_keys) | {e.pack for e in self.entries.values()}
        if set(metadata) != named:
            raise ValueError(f"checkpoint holds {sorted(set(metadata) ^ named)[0]}, which its "
                             "indexes do not account for")

    def _entry(self, item: object, dtypes: dict[str, torch.dtype]) -> tuple[str, Entry]:
        """One index item checked against the checkpoint's packs: its slot lies inside a pack
        of its own group and dtype."""
        if not isinstance(item, dict) or set(item) != _ITEM_FIELDS:
            raise ValueError(f"an item is not an object of the fields {sorted(_ITEM_FIELDS)}")
        key, pack, shape, offset = item["key"], item["pack"], item["shape"], item["offset"]
        dtype = _dtype(item["dtype"]) if isinstance(item["dtype"], str) else None
        if not isinstance(key, str) or pack != f"{group_of(key)}/{MARK}/{item['dtype']}":
            raise ValueError(f"the item of {key!r} names the pack {pack!r}")
        if pack not in self._sizes or dtypes[pack] != dtype or len(self._sizes[pack]) != 1:
            raise ValueError(f"the pack {pack} of {key} is not in the checkpoint")
        if not isinstance(shape, list) or not all(_count(d) for d in [*shape, offset]):
            raise ValueError(f"the item of {key} has a malformed shape or offset")
        entry = Entry(pack, dtype, tuple(shape), offset)
        if offset + entry.numel > self._sizes[pack][0]:
            raise ValueError(f"the item of {key} lies outside its pack")
        return key, entry

    def keys(self) -> set[str]:
        return set(self.entries)

    def _load(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if state:
            with dcp_in_one_process():  # each rank reads the files it needs by itself
                dcp.load(state, storage_reader=self._reader_factory(self.path), no_dist=True)
        return state

    def read(self, keys: Iterable[str]) -> dict[str, torch.Tensor]:
        """The tensors of ``keys`` (views into the packs read for them)."""
        wanted = {k: self.entries[k] for k in keys}
        packs = self._load({e.pack: torch.empty(self._sizes[e.pack], dtype=e.dtype)
                            for e in wanted.values()})
        return {k: packs[e.pack].narrow(0, e.offset, e.numel).view(e.shape)
                for k, e in wanted.items()}
