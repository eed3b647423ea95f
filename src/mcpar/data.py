"""Deterministic, resumable, sharded token streams.

``load_corpus`` turns a ``data.source`` (``stdlib``, a text file, a directory, a glob, or a
pre-tokenized ``.bin``) into one flat token array split into training and validation parts; a
directory prepared by ``mcpar prepare`` (or a weighted blend of several, or text with a
``tokenizer.json``) becomes streaming splits over its shards instead (``mcpar.prepared_corpus``).
``BatchStream`` cuts a token array into fixed-length windows and serves them in a seeded order
that depends only on ``(seed, global_batch, tokens, seq_len)``: the sequences of step k are the
same whatever the data-parallel degree or micro-batch size, which is what lets parity tests
compare layouts and lets a run resume on a different layout.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from mcpar.errors import UserError, problem
from mcpar.prepared_corpus import (
    is_prepared_source,
    load_prepared,
    prepare_text_cached,
    unfinished_shard_dir,
)
from mcpar.shards import PreparedSplit
from mcpar.text_files import resolve_text_files, stdlib_files  # noqa: F401  (public API)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

_SEPARATOR = 10  # b"\n" between files, so the last line of one file never merges with the next
_BIN_DTYPES = ("uint16", "uint32")
_CHUNK_BYTES = 1 << 20  # BPE work unit: bounded memory per chunk, many chunks for encode_batch
_CACHE_FORMAT = "mcpar-bpe-v1"  # bump when the cached layout or the training recipe changes


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
            newlines = np.flatnonzero(data[start:end] == _SEPARATOR)
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


def _cache_key(
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


def _build_bpe_cache(text: np.ndarray, vocab_size: int, val_fraction: float, entry: Path) -> None:
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

    entry = root / f"bpe-{_cache_key(files, stats, vocab_size, val_fraction)}"
    complete = (entry / "tokenizer.json").is_file() and (entry / "tokens.npy").is_file()
    cached = "cached"
    if is_main and not complete:
        text = _read_concatenated(files, sizes)
        try:
            _build_bpe_cache(text, vocab_size, val_fraction, entry)
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
    tokens = np.load(entry / "tokens.npy", mmap_mode="r")
    summary += f" (vocab {vocab_size}, {len(tokens)} tokens, {cached})"
    return _split(tokens, vocab_size, summary, val_fraction, entry / "tokenizer.json")


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


class BatchStream:
    """Seeded, layout-independent batches of ``seq_len`` windows over a flat token array.

    Window i is ``tokens[i*L : i*L+L]`` (inputs) and ``tokens[i*L+1 : i*L+L+1]`` (targets). Epoch
    e visits all windows in the order ``np.random.default_rng([seed, e]).permutation(n)``;
    epochs are concatenated into one infinite order, and step k takes positions
    ``[k*G, (k+1)*G)`` of it. ``next_step`` is the resumable position the trainer advances.

    ``tokens`` may instead be a ``PreparedSplit`` (prepared shards, possibly blended): then the
    split maps each position of the same infinite order to a window itself (see
    ``mcpar.shards``), in constant memory, and the rank/micro-batch slicing is unchanged.
    """

    def __init__(
        self, tokens: np.ndarray | PreparedSplit, seq_len: int, global_batch: int, seed: int
    ):
        prepared = isinstance(tokens, PreparedSplit)
        if not prepared and tokens.ndim != 1:
            raise ValueError(f"tokens must be 1-D, got shape {tokens.shape}")
        if seq_len < 1 or global_batch < 1 or seed < 0:
            raise ValueError(
                f"need seq_len >= 1, global_batch >= 1, seed >= 0; got {seq_len}, "
                f"{global_batch}, {seed}"
            )
        if prepared:
            tokens.num_sequences(seq_len)  # refuses a source too small for seq_len (exit 2)
        elif len(tokens) < seq_len + 1:
            msg = (
                f"the corpus split has {len(tokens)} tokens, too small for model.seq_len="
                f"{seq_len} (needs {seq_len + 1}); use a larger source or a smaller seq_len"
            )
            raise UserError(problem("data.source", msg))
        self.tokens = tokens
        self.seq_len = seq_len
        self.global_batch = global_batch
        self.seed = seed
        self.next_step = 0
        # Recent epoch permutations: a step that crosses an epoch boundary needs two at once.
        self._perms: dict[int, np.ndarray] = {}

    @property
    def num_sequences(self) -> int:
        if isinstance(self.tokens, PreparedSplit):
            return self.tokens.num_sequences(self.seq_len)
        return (len(self.tokens) - 1) // self.seq_len

    def _epoch_perm(self, epoch: int) -> np.ndarray:
        perm = self._perms.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_sequences)
            if len(self._perms) >= 2:
                del self._perms[min(self._perms)]
            self._perms[epoch] = perm
        return perm

    def global_indices(self, step: int) -> np.ndarray:
        """The ``global_batch`` window indices of step ``step``, in order (flat arrays only)."""
        if isinstance(self.tokens, PreparedSplit):
            raise TypeError("a prepared split has no flat window indices; use tokens.locate")
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        n, g = self.num_sequences, self.global_batch
        out = np.empty(g, dtype=np.int64)
        filled = 0
        while filled < g:  # more than once only when the step crosses an epoch boundary
            epoch, offset = divmod(step * g + filled, n)
            take = min(g - filled, n - offset)
            out[filled : filled + take] = self._epoch_perm(epoch)[offset : offset + take]
            filled += take
        return out

    def micro_batch(
        self, step: int, dp_rank: int, dp_degree: int, micro_index: int, micro_batch_size: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and targets (int64, ``[mbs, seq_len]``) of one rank's micro-batch.

        Rank r owns the contiguous slice ``[r*G/dp, (r+1)*G/dp)`` of the step's indices and
        micro-batch j is its j-th block of ``micro_batch_size``, so concatenating every rank's
        micro-batches in order reproduces the single-process batch exactly.
        """
        g = self.global_batch
        if dp_degree < 1 or micro_batch_size < 1 or g % (dp_degree * micro_batch_size):
            raise ValueError(
                f"global_batch {g} is not divisible by data-parallel degree "
                f"{dp_degree} x micro_batch_size {micro_batch_size}"
            )
        per_rank = g // dp_degree
        if not 0 <= dp_rank < dp_degree:
            raise ValueError(f"dp_rank {dp_rank} out of range for dp_degree {dp_degree}")
        if not 0 <= micro_index < per_rank // micro_batch_size:
            raise ValueError(
                f"micro_index {micro_index} out of range [0, {per_rank // micro_batch_size})"
            )
        start = dp_rank * per_rank + micro_index * micro_batch_size
        if isinstance(self.tokens, PreparedSplit):
            positions = step * g + start + np.arange(micro_batch_size, dtype=np.int64)
            windows = self.tokens.windows(positions, self.seq_len, self.seed)
        else:
            idx = self.global_indices(step)[start : start + micro_batch_size]
            # One gather of L+1 tokens per window; fancy indexing also works on memmaps.
            offsets = idx[:, None] * self.seq_len + np.arange(self.seq_len + 1)
            windows = np.asarray(self.tokens[offsets], dtype=np.int64)
        inputs = torch.from_numpy(np.ascontiguousarray(windows[:, :-1]))
        targets = torch.from_numpy(np.ascontiguousarray(windows[:, 1:]))
        return inputs, targets

    def advance(self) -> None:
        """Mark the current step as consumed."""
        self.next_step += 1

    def state_dict(self) -> dict:
        """The stream position: the next step plus what defines the sample order."""
        return {
            "step": self.next_step,
            "seed": self.seed,
            "global_batch": self.global_batch,
            "seq_len": self.seq_len,
        }

    def load_state_dict(self, state: dict) -> None:
        # The sample order is defined by these three; resuming with others would silently
        # replay or skip data, so refuse instead.
        for key in ("seed", "global_batch", "seq_len"):
            if state.get(key) != getattr(self, key):
                raise ValueError(
                    f"data stream state has {key}={state.get(key)!r}, but this "
                    f"stream has {getattr(self, key)!r}"
                )
        self.next_step = int(state["step"])
