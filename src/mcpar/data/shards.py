"""Prepared token shards on disk, and the seeded, streaming window order that training reads.

A prepared directory (written by ``mcpar prepare``) holds, for each shard ``shard-NNNNN``:
``.bin`` (token ids, little-endian ``uint16``/``uint32``), ``.idx`` (``uint64`` offsets of the
documents that start in the shard) and ``.json`` (its sizes and SHA-256 sums, written last: a
shard without it is incomplete); then ``tokenizer.json`` (a copy) and ``manifest.json`` (written
last of all), which lists every shard with its checksums and carries a checksum of its own.

Training cuts each shard into windows of ``seq_len + 1`` tokens at stride ``seq_len`` (windows
never cross shards; a shard's tail shorter than a window is unused). A source's windows in shard
order are split: the last ``val_fraction`` of them (at least one) is validation, the rest
training. Order: position ``p`` of the infinite sample order (step k holds ``[k*G, (k+1)*G)``)
goes to source ``s`` by a fixed low-discrepancy schedule of the weights (``BLEND_BLOCK`` slots);
the c-th draw of source s is window ``perm_{seed,s,e}(c mod n_s)`` with ``e = c // n_s`` its
epoch, where ``perm`` is a keyed Feistel permutation computed per index: no array of the
corpus's size ever exists, so memory stays flat as the corpus grows. Windows are read with
positioned reads (``os.pread``) rather than a memory map: the pages a map touches count as the
process's resident memory and random windows over a large corpus would add up to the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from mcpar.contained import contained_file
from mcpar.errors import UserError, problem

FORMAT = "mcpar-shards-v1"
MANIFEST = "manifest.json"
TOKENIZER_COPY = "tokenizer.json"
INDEX_DTYPE = np.dtype("<u8")
BLEND_BLOCK = 4096  # slots of the blend schedule; proportions are exact to 1/BLEND_BLOCK
_MAX_OPEN = 32  # open shard files kept per source; more would risk the descriptor limit


def _plain_name(name: str) -> bool:
    """A name that stays in its directory as written (no absolute path, no '..')."""
    return bool(name) and not os.path.isabs(name) and ".." not in Path(name).parts \
        and "\x00" not in name


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def atomic_write(dest: Path, data: bytes) -> None:
    """Write to a per-process temporary name, fsync, then rename: readers and a resumed
    ``mcpar prepare`` never see a half-written file under the final name."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, dest)
    except OSError as err:
        # A failed write (a full disk) names no file, and the temporary is gone: name ``dest``.
        if err.filename in (None, str(tmp)) and err.errno is not None:
            raise type(err)(err.errno, err.strerror, str(dest)) from err
        raise
    finally:
        tmp.unlink(missing_ok=True)


def write_shard(out: Path, name: str, tokens: np.ndarray, doc_starts: np.ndarray,
                unit_key: str) -> dict[str, Any]:
    """Write one shard's ``.bin`` and ``.idx``, then its ``.json`` record; return the record."""
    data = np.ascontiguousarray(tokens, dtype=tokens.dtype.newbyteorder("<")).tobytes()
    index = np.ascontiguousarray(doc_starts, dtype=INDEX_DTYPE).tobytes()
    atomic_write(out / f"{name}.bin", data)
    atomic_write(out / f"{name}.idx", index)
    record = {"name": name, "unit": unit_key, "tokens": int(len(tokens)),
              "documents": int(len(doc_starts)), "sha256": hashlib.sha256(data).hexdigest(),
              "index_sha256": hashlib.sha256(index).hexdigest()}
    atomic_write(out / f"{name}.json", _dumps(record))
    return record


RECORD_KEYS = frozenset({"name", "unit", "tokens", "documents", "sha256", "index_sha256"})


def complete_shard(out: Path, name: str, unit_key: str,
                   dtype: str | None = None) -> dict[str, Any] | None:
    """The record of shard ``name`` if it was finished for ``unit_key`` and its files still
    match their checksums (a truncated or edited shard is redone); else None.

    The record is a file an earlier output left, so nothing in it is taken on trust: it must
    hold exactly write_shard's keys, name this shard, and count what the files hold (tokens by
    the ``.bin`` size at ``dtype``, documents by the ``.idx`` offsets). The record returned is
    rebuilt from those facts, so a crafted name or count never reaches the new manifest."""
    try:
        record = json.loads((out / f"{name}.json").read_text())
        if not isinstance(record, dict) or set(record) != RECORD_KEYS:
            return None
        if record["name"] != name or record["unit"] != unit_key:
            return None
        tokens, documents = record["tokens"], record["documents"]
        if not (_count(tokens) and _count(documents)):
            return None
        sizes = [np.dtype(dtype).itemsize] if dtype is not None else [2, 4]
        if (out / f"{name}.bin").stat().st_size not in [tokens * size for size in sizes]:
            return None
        index = (out / f"{name}.idx").read_bytes()
        if _index_problem(index, record) is not None:
            return None
        if sha256_file(out / f"{name}.bin") != record["sha256"]:
            return None
        if hashlib.sha256(index).hexdigest() != record["index_sha256"]:
            return None
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"name": name, "unit": unit_key, "tokens": int(tokens), "documents": int(documents),
            "sha256": record["sha256"], "index_sha256": record["index_sha256"]}


def _dumps(obj: Any) -> bytes:
    # Sorted keys and fixed separators: the same content is always the same bytes.
    return (json.dumps(obj, sort_keys=True, indent=1) + "\n").encode()


def _checksum(body: dict[str, Any]) -> str:
    rest = {k: v for k, v in body.items() if k != "checksum"}
    return hashlib.sha256(json.dumps(rest, sort_keys=True).encode()).hexdigest()


def write_manifest(out: Path, body: dict[str, Any]) -> None:
    full = {**body, "format": FORMAT}
    atomic_write(out / MANIFEST, _dumps({**full, "checksum": _checksum(full)}))


def is_prepared_dir(source: str) -> bool:
    path = Path(os.path.expanduser(source))
    return path.is_dir() and (path / MANIFEST).exists()


def read_manifest(directory: Path, key: str) -> dict[str, Any]:
    """The verified manifest of ``directory``; a problem names ``key`` and the path."""
    where = directory / MANIFEST
    fix = "rerun mcpar prepare into this directory to rebuild it"
    try:
        if os.path.lexists(where):  # a link out, a FIFO or a device is refused unread
            contained_file(directory, MANIFEST, key, f"the directory '{directory}'", fix=fix)
        body = json.loads(where.read_text())
    except FileNotFoundError as exc:
        msg = f"'{directory}' has no {MANIFEST}; it is not a finished mcpar prepare output ({fix})"
        raise UserError(problem(key, msg)) from exc
    except (OSError, ValueError) as exc:
        raise UserError(problem(key, f"cannot read '{where}': {exc}; {fix}")) from exc
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise UserError(problem(key, f"'{where}' is not an {FORMAT} manifest; {fix}"))
    if body.get("checksum") != _checksum(body):
        raise UserError(problem(key, f"'{where}' fails its checksum (corrupt); {fix}"))
    bad = _manifest_problem(body)
    if bad is not None:
        raise UserError(problem(key, f"'{where}': {bad}; {fix}"))
    return body


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _manifest_problem(body: dict[str, Any]) -> str | None:
    """What of a manifest (its checksum good) training cannot read; None when all is well.
    Shard names are checked against the directory when the shards are opened."""
    if body.get("dtype") not in ("uint16", "uint32"):
        return f"key 'dtype' is {body.get('dtype')!r}, not 'uint16' or 'uint32'"
    if not _count(body.get("vocab_size")) or body["vocab_size"] < 1:
        return f"key 'vocab_size' is {body.get('vocab_size')!r}, not a positive whole number"
    if not isinstance(body.get("tokenizer_sha256"), str):
        return "key 'tokenizer_sha256' is not a string"
    shards = body.get("shards")
    if not isinstance(shards, list) or not shards:
        return "key 'shards' is not a list of shards"
    for i, shard in enumerate(shards):
        if not isinstance(shard, dict):
            return f"shards[{i}] is not an object"
        if not isinstance(shard.get("name"), str):
            return f"shards[{i}].name is {shard.get('name')!r}, not a file name"
        for count in ("tokens", "documents"):
            if not _count(shard.get(count)):
                return f"shards[{i}].{count} is {shard.get(count)!r}, not a whole number"
        for digest in ("sha256", "index_sha256"):
            if not isinstance(shard.get(digest), str):
                return f"shards[{i}].{digest} is not a string"
    return None


def _index_problem(index: bytes, shard: dict[str, Any]) -> str | None:
    """What is wrong with a shard's ``.idx`` bytes (document starts) for its manifest entry."""
    if len(index) % INDEX_DTYPE.itemsize:
        return f"{len(index)} bytes, not a whole number of {INDEX_DTYPE.itemsize}-byte offsets"
    starts = np.frombuffer(index, dtype=INDEX_DTYPE)
    if len(starts) != shard["documents"]:
        return f"{len(starts)} document starts, the manifest says {shard['documents']}"
    if len(starts) and (bool((np.diff(starts.astype(np.int64)) < 0).any())
                        or int(starts[-1]) >= max(shard["tokens"], 1)):
        return "document starts out of order or past the shard's tokens"
    return None


@dataclass
class PreparedSource:
    """One prepared directory, checked on open: manifest checksum, every index's checksum and
    every shard's size (a shard's full checksum is checked by ``mcpar prepare`` on a rerun)."""

    directory: Path
    key: str
    manifest: dict[str, Any] = field(init=False)
    shard_tokens: np.ndarray = field(init=False)
    _files: OrderedDict[int, Any] = field(init=False, default_factory=OrderedDict)

    def __post_init__(self) -> None:
        self.manifest = read_manifest(self.directory, self.key)
        self.dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        fix = "rerun mcpar prepare into this directory to redo it"
        counts = []
        self._bins: list[Path] = []
        for shard in self.manifest["shards"]:
            name = shard["name"]
            idx_path = self._shard_file(name, ".idx")
            bin_path = self._shard_file(name, ".bin")
            try:
                index = idx_path.read_bytes()
                size = bin_path.stat().st_size
            except OSError as exc:
                msg = f"cannot read shard '{name}' of '{self.directory}': {exc}; {fix}"
                raise UserError(problem(self.key, msg)) from exc
            if hashlib.sha256(index).hexdigest() != shard["index_sha256"]:
                msg = f"the index '{idx_path}' fails its checksum (corrupt); {fix}"
                raise UserError(problem(self.key, msg))
            bad = _index_problem(index, shard)
            if bad is not None:
                raise UserError(problem(self.key, f"the index '{idx_path}': {bad}; {fix}"))
            if size != shard["tokens"] * self.dtype.itemsize:
                msg = (f"'{bin_path}' is {size} bytes, the manifest says "
                       f"{shard['tokens'] * self.dtype.itemsize} (truncated?); {fix}")
                raise UserError(problem(self.key, msg))
            counts.append(shard["tokens"])
            self._bins.append(bin_path)
        self.shard_tokens = np.asarray(counts, dtype=np.int64)

    def _shard_file(self, name: str, suffix: str) -> Path:
        """A shard file the manifest names, kept inside the directory (contained.py); a
        missing one is left to the read that follows, which names it."""
        path = self.directory / f"{name}{suffix}"
        if os.path.lexists(path) or not _plain_name(name):
            path = contained_file(self.directory, f"{name}{suffix}", self.key,
                                  f"'{self.directory / MANIFEST}'",
                                  fix="rerun mcpar prepare into this directory to redo it")
        return path

    @property
    def vocab_size(self) -> int:
        return int(self.manifest["vocab_size"])

    @property
    def num_tokens(self) -> int:
        return int(self.shard_tokens.sum())

    def window_starts(self, seq_len: int) -> np.ndarray:
        """Cumulative window counts per shard (length shards + 1)."""
        per_shard = np.maximum(self.shard_tokens - 1, 0) // seq_len
        return np.concatenate([[0], np.cumsum(per_shard)])

    def _fd(self, shard: int) -> int:
        fd = self._files.get(shard)
        if fd is None:
            path = self._bins[shard]
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError as exc:
                raise UserError(problem(self.key, f"cannot read '{path}': {exc}")) from exc
            if len(self._files) >= _MAX_OPEN:
                os.close(self._files.popitem(last=False)[1])
            self._files[shard] = fd
        self._files.move_to_end(shard)
        return fd

    def read_windows(self, windows: np.ndarray, seq_len: int) -> np.ndarray:
        """Windows (indices over the whole source) as an ``[n, seq_len + 1]`` int64 array."""
        starts = self.window_starts(seq_len)
        shards = np.searchsorted(starts, windows, side="right") - 1
        out = np.empty((len(windows), seq_len + 1), dtype=np.int64)
        nbytes = (seq_len + 1) * self.dtype.itemsize
        for row, (w, j) in enumerate(zip(windows.tolist(), shards.tolist(), strict=True)):
            offset = (w - int(starts[j])) * seq_len * self.dtype.itemsize
            raw = os.pread(self._fd(j), nbytes, offset)
            if len(raw) != nbytes:
                msg = f"shard {j} of '{self.directory}' is shorter than its manifest says"
                raise UserError(problem(self.key, msg))
            out[row] = np.frombuffer(raw, dtype=self.dtype)
        return out

    def close(self) -> None:
        while self._files:
            os.close(self._files.popitem()[1])

    def __del__(self) -> None:
        self.close()


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A 64-bit integer hash (splitmix64's finalizer) of ``x`` under ``key``; wraps mod 2**64."""
    z = x ^ np.uint64(key)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def feistel_permute(x: np.ndarray, n: int, key: list[int]) -> np.ndarray:
    """Image of indices ``x`` (all < n) under a keyed bijection of ``[0, n)``.

    A 4-round balanced Feistel network permutes ``[0, 2**bits)``; values landing at or beyond
    ``n`` are sent through it again (cycle walking), which keeps it a bijection of ``[0, n)``.
    ``2**bits < 4n``, so a value needs about two passes on average.
    """
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = np.uint64(bits // 2)
    mask = np.uint64((1 << (bits // 2)) - 1)
    round_keys = np.random.default_rng(key).integers(0, 2**63, size=4).tolist()
    y = np.asarray(x, dtype=np.uint64).copy()
    todo = np.ones(len(y), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            v = y[todo]
            left, right = v >> half, v & mask
            for k in round_keys:
                left, right = right, left ^ (_mix(right, k) & mask)
            y[todo] = (left << half) | right
            todo = y >= np.uint64(n)
    return y.astype(np.int64)


def blend_schedule(weights: list[float]) -> np.ndarray:
    """Prefix counts ``[BLEND_BLOCK + 1, K]``: draws of each source in the first j slots.

    Slots get whole counts by largest remainder, then an order by smooth weighted round robin
    (each slot goes to the source furthest behind its share), so any run of N consecutive
    positions holds each source within a couple of draws of its share: a batch is a blend, not
    a run of one source.
    """
    w = np.asarray(weights, dtype=np.float64) / sum(weights)
    counts = np.floor(w * BLEND_BLOCK).astype(np.int64)
    order = np.argsort(-(w * BLEND_BLOCK - counts), kind="stable")
    counts[order[: BLEND_BLOCK - counts.sum()]] += 1
    credit = np.zeros(len(w), dtype=np.int64)
    prefix = np.zeros((BLEND_BLOCK + 1, len(w)), dtype=np.int64)
    for slot in range(BLEND_BLOCK):
        credit += counts
        pick = int(np.argmax(credit))
        credit[pick] -= BLEND_BLOCK
        prefix[slot + 1] = prefix[slot]
        prefix[slot + 1, pick] += 1
    return prefix


@dataclass
class PreparedSplit:
    """The training or validation part of one or more prepared sources, blended by weight.

    It stands in for the flat token array of ``BatchStream``, which calls ``num_sequences``
    and ``windows``; both are computed per call from the positions asked for.
    """

    sources: list[PreparedSource]
    weights: list[float]
    part: str  # "train" or "val"
    val_fraction: float
    _prefix: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self._prefix = blend_schedule(self.weights)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sources)

    def ranges(self, seq_len: int) -> list[tuple[int, int]]:
        """Per source, the ``[lo, hi)`` window range of this part."""
        out = []
        for src in self.sources:
            total = int(src.window_starts(seq_len)[-1])
            val = max(1, int(total * self.val_fraction))
            if total - val < 1:
                msg = (f"'{src.directory}' holds {src.num_tokens} tokens, too few for model."
                       f"seq_len={seq_len} windows in both a training and a validation part")
                raise UserError(problem(src.key, msg))
            out.append((0, total - val) if self.part == "train" else (total - val, total))
        return out

    def num_sequences(self, seq_len: int) -> int:
        return sum(hi - lo for lo, hi in self.ranges(seq_len))

    def locate(self, positions: np.ndarray, seq_len: int, seed: int) -> tuple[np.ndarray, ...]:
        """Source and window (within that source) of each position of the sample order."""
        positions = np.asarray(positions, dtype=np.int64)
        block, slot = np.divmod(positions, BLEND_BLOCK)
        prefix = self._prefix
        src = np.argmax(prefix[slot + 1] - prefix[slot], axis=1)
        draws = block * prefix[-1][src] + prefix[slot, src]  # earlier draws of the same source
        window = np.empty_like(positions)
        for s, (lo, hi) in enumerate(self.ranges(seq_len)):
            mine = src == s
            epoch, offset = np.divmod(draws[mine], hi - lo)
            got = np.empty(len(offset), dtype=np.int64)
            for e in np.unique(epoch).tolist():  # one epoch, or two across a boundary
                sel = epoch == e
                got[sel] = feistel_permute(offset[sel], hi - lo, [seed, s, e])
            window[mine] = lo + got
        return src, window

    def windows(self, positions: np.ndarray, seq_len: int, seed: int) -> np.ndarray:
        src, window = self.locate(positions, seq_len, seed)
        out = np.empty((len(positions), seq_len + 1), dtype=np.int64)
        for s, source in enumerate(self.sources):
            mine = src == s
            if mine.any():
                out[mine] = source.read_windows(window[mine], seq_len)
        return out
