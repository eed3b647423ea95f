"""Corpus loading: a ``data.source`` becomes training and validation tokens.

``load_corpus`` turns a ``data.source`` (``stdlib``, a text file, a directory, a glob, or a
pre-tokenized ``.bin``) into one flat token array split into training and validation parts; a
directory prepared by ``mcpar prepare`` (or a weighted blend of several, or text with a
``tokenizer.json``) becomes streaming splits over its shards instead
(``mcpar.data.prepared_corpus``). ``mcpar.data.stream.BatchStream`` reads either.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from mcpar.data.bpe import bpe_cache_key, build_bpe_cache
from mcpar.data.prepared_corpus import (
    is_prepared_source,
    load_prepared,
    prepare_text_cached,
    unfinished_shard_dir,
)
from mcpar.data.shards import PreparedSplit
from mcpar.data.text_files import resolve_text_files
from mcpar.errors import UserError, problem

_SEPARATOR = 10  # b"\n" between files, so the last line of one file never merges with the next
_BIN_DTYPES = ("uint16", "uint32")


@dataclass
class TokenCorpus:
    """A tokenized corpus: flat training and validation token arrays and a one-line summary."""

    # Flat token arrays, or (prepared shards) splits that BatchStream reads window by window.
    train: np.ndarray | PreparedSplit
    val: np.ndarray | PreparedSplit
    vocab_size: int
    description: str
    # Where the BPE tokenizer was saved (None for bytes and .bin); lets later code decode tokens.
    tokenizer_path: Path | None = None


def _read_concatenated(files: list[Path], sizes: list[int]) -> np.ndarray:
    """The files' raw bytes joined by single newlines, read straight into one uint8 array.

    Reading into a preallocated array avoids holding per-file ``bytes`` objects and a second
    joined copy, so peak memory is the corpus size rather than twice it.
    """
    total = sum(sizes) + len(files) - 1
    buf = np.empty(total, dtype=np.uint8)
    pos = 0
    for i, (path, size) in enumerate(zip(files, sizes, strict=True)):
        if i:
            buf[pos] = _SEPARATOR
            pos += 1
        try:
            with open(path, "rb") as f:
                got = f.readinto(memoryview(buf[pos : pos + size]))
                grew = f.read(1) != b""
        except OSError as exc:
            raise UserError(problem("data.source", f"cannot read '{path}': {exc}")) from exc
        if got != size or grew:
            raise UserError(problem("data.source", f"'{path}' changed while being read; retry"))
        pos += size
    return buf


def _load_bin(
    source: str, token_dtype: str | None, vocab_size: int, val_fraction: float
) -> TokenCorpus:
    """Memory-map a pre-tokenized ``.bin`` file and check its ids fit the model's vocabulary."""
    if token_dtype not in _BIN_DTYPES:
        msg = f"a .bin source needs token_dtype 'uint16' or 'uint32', got {token_dtype!r}"
        raise UserError(problem("data.token_dtype", msg))
    path = Path(os.path.expanduser(source))
    if not path.is_file():
        raise UserError(problem("data.source", f"no such file '{source}'"))
    itemsize = np.dtype(token_dtype).itemsize
    size = path.stat().st_size
    if size == 0 or size % itemsize:
        msg = f"'{source}' is {size} bytes, not a whole number of {token_dtype} tokens"
        raise UserError(problem("data.source", msg + "; check data.token_dtype"))
    tokens = np.memmap(path, dtype=token_dtype, mode="r")
    top = int(tokens.max())
    if top >= vocab_size:
        msg = f"the file holds token id {top}, so vocab_size must be at least {top + 1}"
        raise UserError(problem("model.vocab_size", msg))
    summary = f"{source}: {len(tokens)} {token_dtype} tokens, pre-tokenized"
    return _split(tokens, vocab_size, summary, val_fraction)


def load_corpus(
    source: str,
    tokenizer: str,
    vocab_size: int,
    val_fraction: float,
    token_dtype: str | None = None,
    cache_dir: str | Path | None = None,
    is_main: bool = True,
    barrier: Callable[[], None] = lambda: None,
) -> TokenCorpus:
    """Load ``source`` as tokens and split off the last ``val_fraction`` as validation.

    ``tokenizer`` is ``bytes`` (ids are raw bytes) or ``bpe`` (a byte-level BPE trained on the
    training part). For ``bpe`` only the main rank trains and tokenizes, into ``cache_dir``
    (default ``~/.cache/mcpar/data``, which must be shared by all ranks); every rank then calls
    ``barrier()`` and the others read the cache. A ``.bin`` source is read as ``token_dtype``
    ids and ``tokenizer`` is ignored; ``token_dtype`` is ignored for text sources.
    """
    if not 0 < val_fraction < 0.5:
        raise UserError(problem("data.val_fraction", f"must be in (0, 0.5), got {val_fraction}"))
    if token_dtype is not None and token_dtype not in _BIN_DTYPES:
        msg = f"must be 'uint16' or 'uint32', got {token_dtype!r}"
        raise UserError(problem("data.token_dtype", msg))
    if source.endswith(".bin"):
        return _load_bin(source, token_dtype, vocab_size, val_fraction)
    if is_prepared_source(source):
        return TokenCorpus(*load_prepared(source, tokenizer, vocab_size, val_fraction))
    if unfinished_shard_dir(source):
        msg = (f"'{source}' holds token shards but no manifest.json: an unfinished or damaged "
               "mcpar prepare output; rerun mcpar prepare into it to finish it")
        raise UserError(problem("data.source", msg))
    default_root = Path.home() / ".cache" / "mcpar" / "data"
    root = Path(os.path.expanduser(cache_dir)) if cache_dir is not None else default_root
    if tokenizer not in ("bytes", "bpe"):  # a tokenizer.json: prepare once, then read shards
        entry = prepare_text_cached(source, tokenizer, root, is_main, barrier)
        return TokenCorpus(*load_prepared(str(entry), tokenizer, vocab_size, val_fraction))
    minimum = 256 if tokenizer == "bytes" else 257
    if vocab_size < minimum:
        msg = f"the {tokenizer} tokenizer needs at least {minimum} ids, got {vocab_size}"
        raise UserError(problem("model.vocab_size", msg))

    files = resolve_text_files(source)
    try:
        stats = [p.stat() for p in files]
    except OSError as exc:
        raise UserError(problem("data.source", f"cannot read a file of '{source}': {exc}")) from exc
    sizes = [st.st_size for st in stats]
    summary = f"{source}: {len(files)} files, {sum(sizes) / 1e6:.1f} MB, {tokenizer} tokenizer"
    if tokenizer == "bytes":
        text = _read_concatenated(files, sizes)
        return _split(text, vocab_size, summary, val_fraction)

    entry = root / f"bpe-{bpe_cache_key(files, stats, vocab_size, val_fraction)}"
    complete = (entry / "tokenizer.json").is_file() and _cached_tokens(entry) is not None
    cached = "cached"
    if is_main and not complete:  # missing, or damaged (e.g. tokens.npy cut short): rebuilt
        text = _read_concatenated(files, sizes)
        try:
            build_bpe_cache(text, sizes, vocab_size, val_fraction, entry)
        except OSError as exc:
            msg = (f"cannot write the tokenizer cache {entry}: {exc.strerror}; point "
                   "data.cache_dir at a writable directory with free space")
            raise UserError(problem("data.cache_dir", msg)) from exc
        cached = "trained"
    barrier()  # every rank, cache hit or not, so collective calls stay matched
    if not ((entry / "tokenizer.json").is_file() and (entry / "tokens.npy").is_file()):
        msg = (
            f"'{entry}' was not written by the main rank; put data.cache_dir on a filesystem "
            "every rank shares and keep the corpus files identical (size, mtime) on every node"
        )
        raise UserError(problem("data.cache_dir", msg))
    tokens = _cached_tokens(entry)
    if tokens is None:
        msg = (f"'{entry / 'tokens.npy'}' is damaged (cut short?); delete '{entry}' and rerun "
               "to rebuild it")
        raise UserError(problem("data.cache_dir", msg))
    summary += f" (vocab {vocab_size}, {len(tokens)} tokens, {cached})"
    return _split(tokens, vocab_size, summary, val_fraction, entry / "tokenizer.json")


def _cached_tokens(entry: Path) -> np.ndarray | None:
    """The BPE cache's tokens, or None when missing or not a whole .npy (a copy cut short)."""
    try:
        tokens = np.load(entry / "tokens.npy", mmap_mode="r")
    except (OSError, ValueError, EOFError):
        return None
    return tokens if tokens.ndim == 1 and tokens.dtype.kind == "u" else None


def _split(
    tokens: np.ndarray,
    vocab_size: int,
    description: str,
    val_fraction: float,
    tokenizer_path: Path | None = None,
) -> TokenCorpus:
    """Make the last ``floor(len * val_fraction)`` tokens validation, the rest training."""
    cut = len(tokens) - int(len(tokens) * val_fraction)
    return TokenCorpus(tokens[:cut], tokens[cut:], vocab_size, description, tokenizer_path)
