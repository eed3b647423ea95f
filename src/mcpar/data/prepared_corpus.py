"""Training corpora made of prepared shard directories: one, a weighted blend, or text that a
``tokenizer.json`` tokenizes (prepared once into the data cache, then read like the others).

Blend syntax, in ``data.source``: weights and directories in turn, ``"0.7 DIR1 0.3 DIR2"`` (as
Megatron-LM's ``--data-path``). Keeping a blend inside the one ``data.source`` string lets every
reader of that key (path checks, the trainer, the resolved ``config.yaml``) stay unchanged; a
directory path with spaces cannot be part of a blend (a single directory may have them).
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

from mcpar.contained import contained_file
from mcpar.data.prepare import prepare
from mcpar.data.shards import (
    TOKENIZER_COPY,
    PreparedSource,
    PreparedSplit,
    is_prepared_dir,
)
from mcpar.data.text_files import resolve_text_files
from mcpar.data.tokenizer_file import load_tokenizer_file
from mcpar.errors import UserError, problem

KEY = "data.source"
_CACHE_FORMAT = "mcpar-hf-v1"


def parse_blend(source: str) -> list[tuple[str, float]] | None:
    """``[(directory, weight), ...]`` for a blend string, None for anything else."""
    parts = source.split()
    try:
        float(parts[0])
    except (ValueError, IndexError):
        return None
    if len(parts) % 2:
        msg = (f"'{source}' reads as a blend but is not weight/directory pairs; write "
               "e.g. '0.7 DIR1 0.3 DIR2'")
        raise UserError(problem(KEY, msg))
    out = []
    for weight, path in zip(parts[::2], parts[1::2], strict=True):
        try:
            w = float(weight)
        except ValueError:
            w = -1.0
        if not 0 < w < float("inf"):
            msg = f"blend weight {weight!r} (for '{path}') must be a positive number"
            raise UserError(problem(KEY, msg))
        out.append((path, w))
    return out


def is_prepared_source(source: str) -> bool:
    return parse_blend(source) is not None or is_prepared_dir(source)


def unfinished_shard_dir(source: str) -> bool:
    """A directory of shard files without a manifest: an interrupted or damaged prepare."""
    path = Path(os.path.expanduser(source))
    return path.is_dir() and any(path.glob("shard-*.bin"))


def load_prepared(
    source: str, tokenizer: str, vocab_size: int, val_fraction: float
) -> tuple[PreparedSplit, PreparedSplit, int, str, Path]:
    """Open a prepared directory or blend: train and val splits, vocabulary, summary, the
    tokenizer copy. A ``tokenizer.json`` in ``tokenizer`` must be the one the shards used."""
    entries = parse_blend(source) or [(source, 1.0)]
    sources = []
    for path, _ in entries:
        directory = Path(os.path.expanduser(path))
        if not directory.is_dir():
            raise UserError(problem(KEY, f"no prepared directory '{path}'"))
        sources.append(PreparedSource(directory, KEY))
    first = sources[0].manifest
    for src in sources[1:]:
        if src.manifest["tokenizer_sha256"] != first["tokenizer_sha256"]:
            msg = (f"'{src.directory}' and '{sources[0].directory}' were prepared with "
                   "different tokenizers; a blend needs one tokenizer")
            raise UserError(problem(KEY, msg))
    if tokenizer not in ("bytes", "bpe"):
        given = load_tokenizer_file(tokenizer, key="data.tokenizer")
        if given.sha256 != first["tokenizer_sha256"]:
            msg = (f"'{tokenizer}' is not the tokenizer '{sources[0].directory}' was prepared "
                   "with; name that one, or leave data.tokenizer at its default")
            raise UserError(problem("data.tokenizer", msg))
    need = int(first["vocab_size"])
    if vocab_size < need:
        msg = f"the prepared data's tokenizer has {need} ids, so vocab_size must be at least {need}"
        raise UserError(problem("model.vocab_size", msg))
    weights = [w for _, w in entries]
    train = PreparedSplit(sources, weights, "train", val_fraction)
    val = PreparedSplit(sources, weights, "val", val_fraction)
    tokens = sum(s.num_tokens for s in sources)
    summary = (f"{source}: {len(sources)} prepared source(s), {tokens} {first['dtype']} tokens, "
               f"vocab {need}, blend weights {weights}")
    return train, val, need, summary, tokenizer_copy(sources[0].directory)


def tokenizer_copy(directory: Path) -> Path:
    """The ``tokenizer.json`` copy of a prepared directory, kept inside it (contained.py): a
    link out of the directory, a FIFO or a device there is refused before anything reads it."""
    path = directory / TOKENIZER_COPY
    if not os.path.lexists(path):
        return path  # readers of the copy name a missing one themselves
    return contained_file(directory, TOKENIZER_COPY, KEY, f"'{directory}'",
                          fix="rerun mcpar prepare into this directory to redo it")


def prepare_text_cached(
    source: str, tokenizer: str, cache_root: Path, is_main: bool, barrier: Callable[[], None]
) -> Path:
    """Prepare a text source with a tokenizer file into the data cache (the main rank only,
    then every rank meets at ``barrier``); the entry's name hashes what its tokens depend on."""
    tok = load_tokenizer_file(
        tokenizer, key="data.tokenizer",
        eos_hint="or prepare the text with `mcpar prepare --eos-token TOKEN` and train on that")
    files = resolve_text_files(source)
    h = hashlib.sha256(f"{_CACHE_FORMAT}|{tok.sha256}|{tok.eos_id}".encode())
    try:
        for f in files:
            st = f.stat()
            h.update(f"|{f.resolve().as_posix()}|{st.st_size}|{st.st_mtime_ns}".encode())
    except OSError as exc:
        raise UserError(problem(KEY, f"cannot read a file of '{source}': {exc}")) from exc
    entry = cache_root / f"hf-{h.hexdigest()[:20]}"
    if is_main and not is_prepared_dir(str(entry)):
        try:
            prepare([source], str(tok.path), entry, workers=1, progress=False,
                    shard_tokens=1 << 24)
        except OSError as exc:
            msg = (f"cannot write the prepared-text cache {entry}: {exc.strerror}; point "
                   "data.cache_dir at a writable directory with free space")
            raise UserError(problem("data.cache_dir", msg)) from exc
    barrier()
    if not is_prepared_dir(str(entry)):
        msg = (f"'{entry}' was not written by the main rank; put data.cache_dir on a filesystem "
               "every rank shares")
        raise UserError(problem("data.cache_dir", msg))
    return entry

