"""The built-in ``bpe`` tokenizer: a byte-level BPE trained on the corpus's training part,
cached with the corpus's tokens so that only the main rank ever trains it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_NEWLINE = 10  # chunks end just after one
_CHUNK_BYTES = 1 << 20  # BPE work unit: bounded memory per chunk, many chunks for encode_batch
_CACHE_FORMAT = "mcpar-bpe-v1"  # bump when the cached layout or the training recipe changes


def _text_chunks(data: np.ndarray) -> Iterator[str]:
    """Cut bytes into ~1 MB pieces ending just after a newline, decoded as UTF-8.

    Cutting after a newline never splits a UTF-8 character, and the cut points depend only on
    the content, so tokenization is deterministic. Invalid UTF-8 becomes U+FFFD because the
    tokenizers library only accepts valid strings.
    """
    start, n = 0, len(data)
    while start < n:
        end = min(start + _CHUNK_BYTES, n)
        if end < n:
            newlines = np.flatnonzero(data[start:end] == _NEWLINE)
            if len(newlines):
                end = start + int(newlines[-1]) + 1
        yield data[start:end].tobytes().decode("utf-8", errors="replace")
        start = end


def _train_bpe(text: np.ndarray, vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE on ``text``; imported lazily so bytes runs never load tokenizers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # No prefix space: decoding must give back exactly the text that was encoded.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_text_chunks(text), trainer=trainer)
    return tok


def bpe_cache_key(
    files: list[Path], stats: list[os.stat_result], vocab_size: int, val_fraction: float
) -> str:
    """Hash everything the cached tokens depend on, so a changed corpus is never reused."""
    import tokenizers

    h = hashlib.sha256(
        f"{_CACHE_FORMAT}|{tokenizers.__version__}|{vocab_size}|{val_fraction!r}".encode()
    )
    for path, st in zip(files, stats, strict=True):
        h.update(f"|{path.resolve().as_posix()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:20]


def _atomic_write(dest: Path, write: Callable[[Path], None]) -> None:
    """Write via a per-process temporary name then rename, so readers never see a partial file."""
    tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def build_bpe_cache(text: np.ndarray, vocab_size: int, val_fraction: float, entry: Path) -> None:
    """Train on the training part of the text, tokenize all of it, and save both to ``entry``."""
    entry.mkdir(parents=True, exist_ok=True)  # first: an unwritable cache fails before training
    # The validation split is taken from the end of the token array, so training on the leading
    # (1 - val_fraction) of the bytes keeps the tokenizer from having seen the validation text
    # (up to the small difference between the byte and token split points).
    tok = _train_bpe(text[: len(text) - int(len(text) * val_fraction)], vocab_size)
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    pieces: list[np.ndarray] = []
    batch: list[str] = []
    for chunk in _text_chunks(text):
        batch.append(chunk)
        if len(batch) == 64:  # bounds the Python-side Encoding objects alive at once
            pieces.extend(np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch(batch))
            batch = []
    pieces.extend(np.asarray(e.ids, dtype=dtype) for e in tok.encode_batch(batch))
    tokens = np.concatenate(pieces)

    def save_tokens(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object stops np.save from appending ".npy"
            np.save(f, tokens)

    _atomic_write(entry / "tokens.npy", save_tokens)
    # tokenizer.json last: its presence marks a complete entry.
    _atomic_write(entry / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
