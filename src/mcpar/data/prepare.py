"""``mcpar prepare``: tokenize text files, globs or JSON-lines into token shards with an index.

Documents: a JSON-lines file (``.jsonl``/``.ndjson``) holds one per line, its ``text`` field; any
other file is one document. Each document is followed by the tokenizer's end-of-document id.

Work is cut into units before anything is tokenized, from the inputs' bytes alone: about
``shard_tokens`` tokens' worth of bytes each (the bytes per token measured once on the first
MB of input), cut just after a newline, so a large text file becomes several pieces of one
document. One unit makes one shard, so the output depends on the inputs, the tokenizer and
``shard_tokens`` only, never on ``workers`` or on what ran before: preparing twice gives the
same bytes. Units are tokenized by a pool of worker processes; each shard is written atomically
and marked done by its ``.json`` record, so a rerun skips shards whose record matches their unit
and whose checksums still hold, and redoes the rest (missing, interrupted or truncated ones).

A rerun writes a new manifest (the old one is removed first, so whatever shards it named do not
matter) and deletes ``shard-NNNNN`` files beyond the new plan; a file in ``--out`` named like a
shard but not of that form (``shard-abc.bin``) is refused, as is any file prepare did not write.
A JSON-lines text holding a lone surrogate (``"\\ud800"``) has it read as U+FFFD, as invalid
UTF-8 bytes of a text file are.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from mcpar.data.shards import (
    FORMAT,
    MANIFEST,
    TOKENIZER_COPY,
    atomic_write,
    complete_shard,
    shard_name,
    write_manifest,
    write_shard,
)
from mcpar.data.text_files import resolve_text_files
from mcpar.data.tokenizer_file import (
    BUILTIN_TOKENIZERS,
    TokenizerFile,
    load_tokenizer_file,
    token_dtype_for,
)
from mcpar.errors import UserError, problem
from mcpar.path_checks import storage_errors

DEFAULT_SHARD_TOKENS = 1 << 26  # 128 MB per uint16 shard: few files, yet many units to share
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_PIECE_CHARS = 1 << 20  # text is encoded in ~1 MB pieces: bounded Python-side objects
_SAMPLE_BYTES = 1 << 20
_PIECES_PER_BATCH = 4  # pieces encoded together: ~4 MB of text in flight
_SHARD_FILE = re.compile(r"shard-(\d{5})(\..+)?")  # shard_name(i) and its files
_SURROGATE = re.compile("[\ud800-\udfff]")
# A segment of a unit: (path, file size, mtime_ns, start, end, is_jsonl, ends_document).
Segment = tuple[str, int, int, int, int, bool, bool]


def _cut_after_newline(path: Path, offset: int, size: int) -> int:
    """The first position after a newline at or beyond ``offset`` (``size`` if none)."""
    with open(path, "rb") as f:
        f.seek(offset)
        pos = offset
        while block := f.read(1 << 16):
            nl = block.find(b"\n")
            if nl >= 0:
                return pos + nl + 1
            pos += len(block)
    return size


def unique_files(files: Iterable[Path]) -> tuple[list[Path], list[Path]]:
    """The files in order of first mention, each once (by resolved path), and the repeats."""
    seen: set[Path] = set()
    kept, repeated = [], []
    for f in files:
        real = f.resolve()
        if real in seen:
            repeated.append(f)
        else:
            seen.add(real)
            kept.append(f)
    return kept, repeated


def plan_units(files: list[Path], unit_bytes: int) -> list[list[Segment]]:
    """Group the files' bytes into units of about ``unit_bytes``, each cut after a newline."""
    units: list[list[Segment]] = []
    current: list[Segment] = []
    used = 0
    for path in files:
        try:
            st = path.stat()
            jsonl = path.suffix in _JSONL_SUFFIXES
            pos = 0
            while pos < st.st_size:
                room = unit_bytes - used
                end = st.st_size if st.st_size - pos <= room else \
                    _cut_after_newline(path, pos + room, st.st_size)
                current.append((str(path), st.st_size, st.st_mtime_ns, pos, end, jsonl,
                                end == st.st_size))
                used += end - pos
                pos = end
                if used >= unit_bytes:
                    units.append(current)
                    current, used = [], 0
        except OSError as exc:
            raise UserError(problem("SOURCES", f"cannot read '{path}': {exc.strerror}")) from exc
    if current:
        units.append(current)
    return units


def _unit_key(unit: list[Segment], tok: TokenizerFile, dtype: str) -> str:
    ident = [FORMAT, tok.sha256, tok.eos_id, dtype, unit]
    return hashlib.sha256(json.dumps(ident).encode()).hexdigest()


_TOKENIZERS: dict[str, Any] = {}  # per worker process: loaded once, reused for every unit


def _documents(seg: Segment) -> Iterator[tuple[list[str], bool]]:
    """The texts of one segment, in pieces: ``(pieces, ends_document)`` per document."""
    path, _, _, start, end, jsonl, ends_doc = seg
    try:
        with open(path, "rb") as f:
            f.seek(start)
            raw = f.read(end - start)
    except OSError as exc:
        raise UserError(problem("SOURCES", f"cannot read '{path}': {exc.strerror}")) from exc
    if len(raw) != end - start:
        raise UserError(problem("SOURCES", f"'{path}' changed while being prepared; rerun"))
    if not jsonl:
        text = raw.decode("utf-8", errors="replace")
        pieces, i = [], 0
        while i < len(text):  # cut after a newline so that pieces tokenize like the whole
            j = text.find("\n", i + _PIECE_CHARS)
            j = len(text) if j < 0 else j + 1
            pieces.append(text[i:j])
            i = j
        yield pieces, ends_doc
        return
    offset = start
    for line in raw.split(b"\n"):
        if line.strip():
            try:
                text = json.loads(line).get("text")
            except (ValueError, AttributeError):
                text = None
            if not isinstance(text, str):
                msg = f"'{path}': the JSON line at byte {offset} has no \"text\" string"
                raise UserError(problem("SOURCES", msg))
            try:
                text.encode("utf-8")
            except UnicodeEncodeError:  # a lone surrogate ("\\ud800"): no text, as bad bytes
                text = _SURROGATE.sub("\ufffd", text)
            yield [text], True
        offset += len(line) + 1


Job = tuple[str, int, list[Segment], str, TokenizerFile, str]  # out, index, unit, key, ...


def _build_shard(job: Job) -> tuple[int, dict[str, Any]]:
    """Tokenize one unit into one shard (runs in a worker process)."""
    out, i, unit, key, tok_file, dtype = job
    tok = _TOKENIZERS.get(tok_file.sha256)
    if tok is None:
        tok = _TOKENIZERS[tok_file.sha256] = tok_file.load()
    arrays: list[np.ndarray] = []
    starts: list[int] = []
    count = 0
    eos = np.asarray([tok_file.eos_id], dtype=dtype)
    for seg in unit:
        for pieces, ends_doc in _documents(seg):
            starts.append(count)
            # No special tokens: a post-processor's BOS/template would land inside documents.
            # A few pieces at a time, without offsets (the _fast form, the same ids): an
            # Encoding costs ~100 bytes a token, so a unit's worth at once would be GBs.
            for k in range(0, len(pieces), _PIECES_PER_BATCH):
                batch = pieces[k:k + _PIECES_PER_BATCH]
                for enc in tok.encode_batch_fast(batch, add_special_tokens=False):
                    arrays.append(np.asarray(enc.ids, dtype=dtype))
                    count += len(enc.ids)
            if ends_doc:
                arrays.append(eos)
                count += 1
    tokens = np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype)
    return i, write_shard(Path(out), shard_name(i), tokens, np.asarray(starts, np.uint64), key)


def _bytes_per_token(files: list[Path], tok_file: TokenizerFile) -> float:
    """Measured on the first MB of input (deterministic): sizes units to ~shard_tokens."""
    with open(files[0], "rb") as f:
        sample = f.read(_SAMPLE_BYTES).decode("utf-8", errors="replace")
    n = len(tok_file.load().encode(sample, add_special_tokens=False).ids)
    return max(1.0, len(sample.encode()) / max(1, n))


def _check_out_dir(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(problem("--out", f"'{out}' is a file; give a directory"))
    ours = (MANIFEST, TOKENIZER_COPY)
    for entry in out.iterdir() if out.is_dir() else []:
        name = entry.name
        if name.startswith("shard-") and not _SHARD_FILE.fullmatch(name):
            msg = (f"'{out}' holds '{name}', named like a shard but not one mcpar prepare "
                   "writes; remove it, or give an empty or new directory")
            raise UserError(problem("--out", msg))
        if not (name in ours or name.startswith(("shard-", ".shard-", ".manifest", ".tokenizer"))):
            msg = (f"'{out}' holds '{name}', which mcpar prepare did not write; give an empty "
                   "or new directory (or an earlier output of mcpar prepare to resume)")
            raise UserError(problem("--out", msg))


def prepare(sources: list[str], tokenizer: str, out: str | Path, workers: int = 1,
            shard_tokens: int = DEFAULT_SHARD_TOKENS, eos_token: str | None = None,
            progress: bool = True) -> dict[str, Any]:
    """Prepare ``sources`` into ``out``; returns the manifest plus ``built`` (shards redone)."""
    from tqdm import tqdm

    if workers < 1:
        raise UserError(problem("--workers", f"must be at least 1, got {workers}"))
    if shard_tokens < 1:
        raise UserError(problem("--shard-tokens", f"must be at least 1, got {shard_tokens}"))
    if tokenizer in BUILTIN_TOKENIZERS:
        raise UserError(problem(
            "--tokenizer", f"'{tokenizer}' is built into mcpar train, which tokenizes text "
            "sources itself (data.tokenizer); prepare writes the shards of a tokenizer file: "
            "give a Hugging Face tokenizer.json or a directory holding one"))
    tok_file = load_tokenizer_file(tokenizer, eos_token, key="--tokenizer")
    dtype = token_dtype_for(tok_file.vocab_size)
    files, repeated = unique_files(f for s in sources for f in resolve_text_files(s, key="SOURCES"))
    if repeated:
        # Overlapping globs or directories name a file more than once: it is read once.
        print(f"mcpar prepare: {len(repeated)} file(s) named by more than one SOURCE are read "
              f"once (e.g. {repeated[0]})", flush=True)
    files = [f for f in files if f.stat().st_size > 0]
    if not files:
        raise UserError(problem("SOURCES", f"{sources} hold no text (all files are empty)"))
    out = Path(out)
    _check_out_dir(out)
    out.mkdir(parents=True, exist_ok=True)
    # The manifest goes first: until a new one is written the directory reads as unfinished.
    (out / MANIFEST).unlink(missing_ok=True)
    unit_bytes = max(1 << 12, int(shard_tokens * _bytes_per_token(files, tok_file)))
    units = plan_units(files, unit_bytes)
    for stale in out.glob("shard-*"):  # left by an earlier plan with more shards
        match = _SHARD_FILE.fullmatch(stale.name)
        if match and int(match.group(1)) >= len(units):
            stale.unlink()
    records: list[dict[str, Any] | None] = []
    jobs: list[Job] = []
    for i, unit in enumerate(units):
        key = _unit_key(unit, tok_file, dtype)
        done = complete_shard(out, shard_name(i), key, dtype)
        records.append(done)
        if done is None:
            jobs.append((str(out), i, unit, key, tok_file, dtype))
    sizes = {job[1]: sum(seg[4] - seg[3] for seg in job[2]) for job in jobs}
    bar = tqdm(total=sum(sizes.values()), unit="B", unit_scale=True, disable=not progress,
               desc=f"mcpar prepare: {len(jobs)}/{len(units)} shards to build")
    with bar:
        if workers == 1 or len(jobs) <= 1:
            for i, rec in map(_build_shard, jobs):
                records[i] = rec
                bar.update(sizes[i])
        else:
            # fork: workers start in milliseconds; the parent has not run the tokenizer's
            # thread pool (only single encodes), which is what makes forking it unsafe.
            ctx = multiprocessing.get_context("fork")
            with ctx.Pool(min(workers, len(jobs)), initializer=_quiet_worker) as pool:
                for i, rec in pool.imap_unordered(_build_shard, jobs):
                    records[i] = rec
                    bar.update(sizes[i])
    atomic_write(out / TOKENIZER_COPY, tok_file.path.read_bytes())
    shards = [{k: v for k, v in r.items() if k != "unit"} for r in records if r is not None]
    body = {
        "sources": list(sources),
        "files": [{"path": str(f), "bytes": f.stat().st_size} for f in files],
        "tokenizer_sha256": tok_file.sha256, "vocab_size": tok_file.vocab_size,
        "eos_id": tok_file.eos_id, "eos_token": tok_file.eos_token, "dtype": dtype,
        "shard_tokens": shard_tokens, "shards": shards,
        "total_tokens": sum(s["tokens"] for s in shards),
        "total_documents": sum(s["documents"] for s in shards),
    }
    write_manifest(out, body)
    return {**body, "built": len(jobs)}


def _quiet_worker() -> None:
    # Each worker encodes on one thread: N workers x all cores would oversubscribe the CPUs.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``prepare``'s arguments (its one-line help is in ``mcpar.cli``'s command table)."""
    p.add_argument("sources", nargs="+", metavar="SOURCES",
                   help="text files, directories, globs or .jsonl files ('text' field)")
    p.add_argument("--tokenizer", required=True,
                   help="a Hugging Face tokenizer.json, or a directory holding one")
    p.add_argument("--out", required=True, help="output directory (rerun to resume)")
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 1)),
                   help="tokenizing processes (default: every core)")
    p.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS,
                   help=f"about how many tokens per shard (default {DEFAULT_SHARD_TOKENS})")
    p.add_argument("--eos-token", default=None,
                   help="end-of-document token (default: the tokenizer's own)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def run(args: argparse.Namespace) -> int:
    # A full disk (a quota, a read-only place) under --out: one line naming the file and --out.
    # A shard is complete only once its record is written (after its data), and the manifest
    # last: what was left is redone by the rerun that resumes, never read as done.
    with storage_errors(args.out, "--out"):
        result = prepare(args.sources, args.tokenizer, args.out, args.workers,
                         args.shard_tokens, args.eos_token, progress=not args.quiet)
    print(f"{args.out}: {len(result['shards'])} shards ({result['built']} built), "
          f"{result['total_tokens']} {result['dtype']} tokens, "
          f"{result['total_documents']} documents")
    return 0
