"""``mcpar export RUN_DIR [--step N] --format hf OUT``: a checkpoint as a Hugging Face model.

Writes what ``transformers``' ``AutoModelForCausalLM.from_pretrained(OUT)`` reads: config.json,
the weights in safetensors (one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` above ``max_shard_bytes``), generation_config.json and,
when the run trained on a tokenizer file (or mcpar's BPE), ``tokenizer.json`` with a
``tokenizer_config.json``, so that ``AutoTokenizer`` reads it too. The run's end-of-document
token (full_state.run_tokenizer) is written as the tokenizer's eos token and as
``eos_token_id`` in config.json and generation_config.json, so that ``generate`` stops where the
model learned a text ends. The checkpoint is read whole in this process (any layout: see
full_state.py); weights are written in fp32, as they are trained. Every file is written under a
temporary name and renamed, with the mode the umask gives (0644 under umask 022). The folder
too: the export is written into a hidden sibling (``.OUT.partial-PID``) renamed to OUT once
complete, so OUT never holds a half-written model; a write the filesystem refuses (a full
disk, a quota) removes the sibling and is one line naming OUT.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch

from mcpar.data.shards import atomic_write
from mcpar.errors import UserError, problem
from mcpar.interop.full_state import RunTokenizer, load_full_state, run_tokenizer
from mcpar.interop.hf_names import export_problems, hf_config, to_hf
from mcpar.path_checks import STORAGE_ERRNOS

DEFAULT_MAX_SHARD_BYTES = 2 << 30  # 2 GiB per safetensors file
SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
# A tokenizer's own begin-of-text and padding tokens, when it has one (a special token).
BOS_CANDIDATES = ("<|begin_of_text|>", "<|startoftext|>", "<s>", "<bos>")
PAD_CANDIDATES = ("<pad>", "<|pad|>", "<|padding|>", "[PAD]")


def _json(obj: Any) -> bytes:
    return (json.dumps(obj, indent=2) + "\n").encode()


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> int:
    """Write ``tensors`` as one file or as shards with an index; the number of files."""
    # Serialized in memory (one shard at a time) and written by atomic_write: safetensors'
    # save_file creates its own temporary file, private (0600) whatever the umask.
    from safetensors.torch import save

    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        atomic_write(out / SAFE_NAME, save(shards[0], metadata=meta))
        return 1
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        atomic_write(out / file, save(shard, metadata=meta))
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write(out / INDEX_NAME, _json(index))
    return len(shards)


def special_tokens(tokenizer: RunTokenizer) -> dict[str, tuple[str, int]]:
    """``{"bos"|"eos"|"pad": (token, id)}`` of the run's tokenizer; empty when its data has no
    end-of-document token (mcpar's BPE)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer.path))
    vocab = tok.get_vocab(with_added_tokens=True)
    eos = tokenizer.eos_token
    if eos is None or eos not in vocab:
        return {}
    special = {t.content for t in tok.get_added_tokens_decoder().values() if t.special}
    # mcpar puts no begin token before a document: what precedes one in training is the
    # previous document's end-of-text, so without a begin token of its own that token is the
    # bos too (as GPT-2's <|endoftext|> is).
    bos = next((c for c in BOS_CANDIDATES if c in special), eos)
    # Training never pads; generate pads finished sequences of a batch. Without a pad token of
    # its own, the pad token is the end-of-text token (padding after it is never read).
    pad = next((c for c in PAD_CANDIDATES if c in special), eos)
    return {"bos": (bos, vocab[bos]), "eos": (eos, vocab[eos]), "pad": (pad, vocab[pad])}


def write_tokenizer(source: Path, out: Path, special: dict[str, tuple[str, int]]) -> None:
    atomic_write(out / "tokenizer.json", source.read_bytes())
    config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast"}
    own = source.parent / "tokenizer_config.json"
    if own.is_file():  # a Hugging Face directory: its own settings win, ours fill what it lacks
        config = json.loads(own.read_text())
        tokens_map = source.parent / "special_tokens_map.json"
        if tokens_map.is_file():
            atomic_write(out / "special_tokens_map.json", tokens_map.read_bytes())
    for role, (token, _) in special.items():
        if not config.get(f"{role}_token"):
            config[f"{role}_token"] = token
    atomic_write(out / "tokenizer_config.json", _json(config))


def export_hf(run_dir: Path, out: Path, step: int | None = None,
              max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> str:
    """Export; a one-line summary of what was written."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(problem(str(out), "exists and is not an empty directory; give a new "
                                "output path"))
    state = load_full_state(run_dir, step)
    bias = {k: v for k, v in state.buffers.items() if k.endswith(".expert_bias")}
    problems = export_problems(state.model, bias)
    if problems:
        raise UserError(problems)
    tokenizer = run_tokenizer(state.job, state.model.vocab_size)
    special = special_tokens(tokenizer) if tokenizer is not None else {}
    # None spelled out where the run has no such token: an absent id reads as the
    # architecture's default (Llama's eos 2, GPT-2's 50256), a token of another vocabulary.
    ids: dict[str, int | None] = {"bos_token_id": None, "eos_token_id": None}
    ids.update({f"{role}_token_id": i for role, (_, i) in special.items()})
    tensors = to_hf(state.model, state.params)
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_name(f".{out.name}.partial-{os.getpid()}")
    try:
        partial.mkdir()
        atomic_write(partial / "config.json", _json({**hf_config(state.model), **ids}))
        files = write_safetensors(tensors, partial, max_shard_bytes)
        atomic_write(partial / "generation_config.json",
                     _json({**ids, "max_length": state.model.seq_len}))
        if tokenizer is not None:
            write_tokenizer(tokenizer.path, partial, special)
        os.replace(partial, out)  # onto an empty OUT too: rename(2) replaces an empty folder
    except OSError as err:
        if err.errno not in STORAGE_ERRNOS:
            raise
        fix = ("free space there or give another output path"
               if err.errno in (errno.ENOSPC, errno.EDQUOT)
               else "fix its permissions or give another output path")
        raise UserError(problem(str(out), f"{err.strerror} while writing the export (nothing "
                                f"was written there); {fix}")) from err
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    total = sum(t.numel() for t in tensors.values())
    eos = f", end-of-text {special['eos'][0]!r} (id {special['eos'][1]})" if special else ""
    return (f"mcpar export: step {state.step} of {run_dir} ({state.model.kind}) -> {out}: "
            f"{total:,} parameters in {files} safetensors file(s)"
            + (", tokenizer.json" if tokenizer is not None else "") + eos)
