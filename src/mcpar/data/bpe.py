"""The built-in ``bpe`` tokenizer: a byte-level BPE trained on the corpus's training part,
cached with the corpus's tokens so that only the main rank ever trains it.

Its vocabulary holds one special token, ``END_OF_TEXT``, written after every file of the corpus:
the model learns where a text ends, and an exported model's ``generate`` stops there (the
export names it as the tokenizer's eos token and ``eos_token_id``).
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
_CACHE_FORMAT = "mcpar-bpe-v2"  # bump when the cached layout or the training recipe changes
END_OF_TEXT = "<|endoftext|>"  # the special token after every file (id 0: trained first)


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
        special_tokens=[END_OF_TEXT],
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


def _file_spans(sizes: list[int], separator_bytes: int) -> Iterator[tuple[int, int]]:
    """(start, end) of each file in the corpus's joined bytes (files joined by a separator)."""
    start = 0
    for size in sizes:
        yield start, start + size
        start += size + separator_bytes


def build_bpe_cache(text: np.ndarray, sizes: list[int], vocab_size: int, val_fraction: float,
                    entry: Path, separator_bytes: int = 1) -> None:
    """Train on the training part of the text, tokenize all of it, and save both to ``entry``.

    ``text`` is the corpus's files joined by ``separator_bytes`` bytes, of ``sizes`` each: every
    file is tokenized on its own and followed by ``END_OF_TEXT`` (in place of the separator)."""
    entry.mkdir(parents=True, exist_ok=True)  # first: an unwritable cache fails before training
    # The validation split is taken from the end of the token array, so training on the leading
    # (1 - val_fraction) of the bytes keeps the tokenizer from having seen the validation text
    # (up to the small difference between the byte and token split points).
    tok = _train_bpe(text[: len(text) - int(len(text) * val_fraction)], vocab_size)
    dtype = np.uint16 if vocab_size <= 65535 else np.uint32
    eos = np.asarray([tok.token_to_id(END_OF_TEXT)], dtype=dtype)
    pieces: list[np.ndarray] = []
    batch: list[str | None] = []  # None: the end of a file

    def encode(batch: list[str | None]) -> None:
        texts = [c for c in batch if c is not None]
        ids = iter(tok.encode_batch(texts))
        pieces.extend(eos if c is None else np.asarray(next(ids).ids, dtype=dtype) for c in batch)

    for start, end in _file_spans(sizes, separator_bytes):
        batch.extend(_text_chunks(text[start:end]))
        batch.append(None)
        if len(batch) >= 64:  # bounds the Python-side Encoding objects alive at once
            encode(batch)
            batch = []
    encode(batch)
    tokens = np.concatenate(pieces)

    def save_tokens(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object stops np.save from appending ".npy"
            np.save(f, tokens)

    _atomic_write(entry / "tokens.npy", save_tokens)
    # tokenizer.json last: its presence marks a complete entry.
    _atomic_write(entry / "tokenizer.json", lambda tmp: tok.save(str(tmp)))
