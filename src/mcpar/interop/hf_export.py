"""``mcpar export RUN_DIR [--step N] --format hf OUT``: a checkpoint as a Hugging Face model.

Writes what ``transformers``' ``AutoModelForCausalLM.from_pretrained(OUT)`` reads: config.json,
the weights in safetensors (one ``model.safetensors``, or ``model-0000i-of-0000n.safetensors``
with ``model.safetensors.index.json`` above ``max_shard_bytes``) and, when the run trained on a
tokenizer file (or mcpar's BPE), ``tokenizer.json`` with a ``tokenizer_config.json``, so that
``AutoTokenizer`` reads it too. The checkpoint is read whole in this process (any layout: see
full_state.py); weights are written in fp32, as they are trained.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from mcpar.errors import UserError, problem
from mcpar.interop.full_state import load_full_state, run_tokenizer_path
from mcpar.interop.hf_names import export_problems, hf_config, to_hf

DEFAULT_MAX_SHARD_BYTES = 2 << 30  # 2 GiB per safetensors file
SAFE_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def write_safetensors(tensors: dict[str, torch.Tensor], out: Path, max_shard_bytes: int) -> int:
    """Write ``tensors`` as one file or as shards with an index; the number of files."""
    from safetensors.torch import save_file

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
        save_file(shards[0], str(out / SAFE_NAME), metadata=meta)
        return 1
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / file), metadata=meta)
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return len(shards)


def write_tokenizer(source: Path, out: Path) -> None:
    shutil.copyfile(source, out / "tokenizer.json")
    config = source.parent / "tokenizer_config.json"
    if config.is_file():  # a Hugging Face directory: its own settings win
        shutil.copyfile(config, out / "tokenizer_config.json")
        special = source.parent / "special_tokens_map.json"
        if special.is_file():
            shutil.copyfile(special, out / "special_tokens_map.json")
    else:
        (out / "tokenizer_config.json").write_text(json.dumps(
            {"tokenizer_class": "PreTrainedTokenizerFast"}, indent=2) + "\n")


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
    tensors = to_hf(state.model, state.params)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config(state.model), indent=2) + "\n")
    files = write_safetensors(tensors, out, max_shard_bytes)
    tokenizer = run_tokenizer_path(state.job, state.model.vocab_size)
    if tokenizer is not None:
        write_tokenizer(tokenizer, out)
    total = sum(t.numel() for t in tensors.values())
    return (f"mcpar export: step {state.step} of {run_dir} ({state.model.kind}) -> {out}: "
            f"{total:,} parameters in {files} safetensors file(s)"
            + (", tokenizer.json" if tokenizer is not None else ""))
