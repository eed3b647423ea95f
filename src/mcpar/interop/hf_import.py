"""Hugging Face models in: ``model.init_from: hf:DIR`` and ``mcpar import DIR``.

A fresh run with ``model.init_from: hf:DIR`` starts from the weights of a Hugging Face directory
(config.json and safetensors, one file or sharded with an index) instead of its seeded init, for
continued pre-training. The model section must describe the same model: ``mcpar import DIR``
prints the section to paste, and a run whose section differs is refused naming the key and the
value the directory has. Every rank reads the directory and keeps its own shard, through the
same index maps that resume uses to reshard (full_state.py), so any layout starts from the same
full model; a resumed run loads its checkpoint over it. The directory is checked before any
worker starts, as a checkpoint is (hf_checks.py): its files kept inside it, config.json and the
index well-formed, safetensors headers sound, every tensor of the shape and dtype the model
needs and finite; a damaged directory is one exit-2 line, not a worker fault.

Supported: ``LlamaForCausalLM``, ``MixtralForCausalLM`` and ``GPT2LMHeadModel`` (hf_names.py
says what each maps to); any other architecture is refused with exit 2.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import torch
import yaml

from mcpar.config import ModelConfig
from mcpar.errors import UserError, problem
from mcpar.interop.hf_checks import (
    config_problems,
    headers,
    iter_tensors,
    read_json_object,
    shape_problems,
)
from mcpar.interop.hf_names import architectures, from_hf, hf_notes, hf_problems, model_keys
from mcpar.models.spec import get_model_spec

PREFIX = "hf:"
KEY = "model.init_from"
# Training choices that do not change the imported function (or only from the first update).
_FREE_KEYS = ("capacity_factor", "router_bias_update_rate")


def hf_dir(init_from: str, key: str = KEY) -> Path:
    if not init_from.startswith(PREFIX):
        raise UserError(problem(key, f"{init_from!r}: give hf:DIR, a Hugging Face model "
                                "directory"))
    return Path(init_from[len(PREFIX):]).expanduser()


def read_config(path: Path, key: str = KEY) -> dict[str, Any]:
    """A supported config.json of ``path``; exit 2 naming the path (and the key) otherwise."""
    file = path / "config.json"
    if not os.path.lexists(file):
        raise UserError(problem(key, f"{path}: no config.json; give a directory written by "
                                "save_pretrained or mcpar export"))
    hf = read_json_object(path, "config.json", key)
    archs = hf.get("architectures")
    if not isinstance(archs, list) or not archs:
        raise UserError(problem(key, f"{file}: key 'architectures' is {archs!r}, not a list "
                                "naming the model's class (e.g. [\"LlamaForCausalLM\"])"))
    arch = archs[0]
    if not isinstance(arch, str) or arch not in architectures():
        raise UserError(problem(key, f"{file}: architectures {archs!r} has "
                                f"no mcpar model; supported: {sorted(architectures())}"))
    bad = config_problems(file, hf)
    if bad:
        raise UserError([problem(key, b) for b in bad])
    try:
        model_keys(hf)
    except KeyError as exc:
        raise UserError(problem(key, f"{file}: no key {exc}, which {arch} needs; re-save the "
                                "model (save_pretrained or mcpar export)")) from None
    bad = hf_problems(hf)
    if bad:
        raise UserError([problem(key, f"{file}: {b}: mcpar's model computes something else")
                         for b in bad])
    for note in hf_notes(hf):
        print(f"mcpar: note: {file}: {note}", file=sys.stderr)
    return hf


def read_tensors(path: Path, key: str = KEY) -> dict[str, torch.Tensor]:
    """Every tensor of the directory's safetensors (one file or an index's shards), fp32: each
    file kept inside the directory, each header checked, each value finite (hf_checks.py)."""
    return {name: value for name, _, value in iter_tensors(path, key)}


def import_section(path: Path, key: str = "DIR") -> dict[str, Any]:
    """The mcpar ``model`` section for a Hugging Face directory (``mcpar import``), its
    weights checked against the model that section builds as a run would check them."""
    from pydantic import ValidationError

    keys = model_keys(read_config(path, key))
    try:
        cfg = ModelConfig(**keys)
    except ValidationError as exc:
        err = exc.errors()[0]
        name = ".".join(str(p) for p in err["loc"])
        raise UserError(problem(key, f"{path / 'config.json'} gives model.{name} "
                                f"{err.get('input')!r}: {err['msg']}")) from None
    problems = shape_problems(cfg, path, key, headers(path, key))
    if problems:
        raise UserError(problems)
    for _ in iter_tensors(path, key):
        pass
    return {**keys, "init_from": f"{PREFIX}{path}"}


def section_problems(cfg: ModelConfig, hf: dict[str, Any]) -> list[str]:
    """Where the run's model section describes another model than the directory's."""
    out = []
    free = (*_FREE_KEYS, *architectures()[hf["architectures"][0]].free_keys)
    for name, theirs in model_keys(hf).items():
        ours = getattr(cfg, name)
        if name == "num_kv_heads":
            ours = cfg.kv_heads
        elif name == "ffn_hidden_size":
            ours = cfg.ffn_size
        elif name in free or (name == "tie_embeddings" and theirs):
            continue  # untying copies the embedding into the head
        if ours != theirs:
            out.append(problem(f"model.{name}", f"{ours!r}, but {KEY} has {theirs!r}; set "
                               f"it to {theirs!r} (`mcpar import DIR` prints the section)"))
    return out


def check_init_from(cfg: ModelConfig) -> None:
    """Refuse a bad ``model.init_from`` before any worker starts (exit 2 naming the key): the
    form, the directory's config.json and architecture, the run's model section against it,
    and its weights as the workers will read them: every file inside the directory, every
    safetensors header sound, every tensor of the shape and dtype the model needs, every value
    finite (hf_checks.py)."""
    if not cfg.init_from:
        return
    path = hf_dir(cfg.init_from)
    problems = section_problems(cfg, read_config(path))
    if problems:
        raise UserError(problems)
    _checked_headers(cfg, path)
    for _ in iter_tensors(path, KEY):  # the values: finite (one tensor held at a time)
        pass


def _checked_headers(cfg: ModelConfig, path: Path) -> None:
    problems = shape_problems(cfg, path, KEY, headers(path, KEY))
    if problems:
        raise UserError(problems)


def load_init(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The full parameters (``named_parameters`` names) ``model.init_from`` names."""
    path = hf_dir(cfg.init_from or "")
    hf = read_config(path)
    problems = section_problems(cfg, hf)
    if problems:
        raise UserError(problems)
    _checked_headers(cfg, path)
    tensors = read_tensors(path)
    names = get_model_spec(cfg.kind).hf
    if names is not None:  # the directory's names, as the family's map reads them
        tensors = names.tensor_names(tensors)
    if names is not None and not cfg.tie_embeddings and "lm_head.weight" not in tensors \
            and names.embedding in tensors:
        tensors["lm_head.weight"] = tensors[names.embedding]  # a head tied in the directory
    try:
        return from_hf(cfg, tensors)
    except KeyError as exc:
        raise UserError(problem(KEY, f"{path}: tensor {exc} is missing")) from None


def init_shards(cfg: Any, chunks: list[torch.nn.Module], dims: Any,
                placement: str = "round_robin") -> None:
    """Load ``model.init_from`` into this rank's chunks (its pipeline stages, tensor slices and
    experts; ``dims``: the run's ParallelDims), before anything else holds the parameters."""
    from mcpar.checkpoint.reshard import take
    from mcpar.checkpoint.saved_state import layout_maps
    model_cfg = cfg.model
    params = load_init(model_cfg)
    names = [n for n, _ in get_model_spec(model_cfg.kind).build(model_cfg, 0).named_parameters()]
    missing = [n for n in names if n not in params]
    if missing:
        raise UserError(problem(KEY, f"no tensor for mcpar's {missing[0]}"))
    full = [params[n].reshape(-1) for n in names]
    layout = {"pipeline": dims.pp, "tensor": dims.tp, "experts": dims.ep,
              "virtual_stages": len(chunks), "placement": placement}
    coord = (dims.axis_rank("pp"), dims.axis_rank("tp"), dims.axis_rank("ep"))
    maps = layout_maps(model_cfg, layout, coord)
    local = {f"{i}.{n}": p for i, chunk in enumerate(chunks)
             for n, p in chunk.named_parameters()}
    with torch.no_grad():
        for name, codes in maps.items():
            local[name].copy_(take(full, codes).to(local[name].dtype))


def section_yaml(path: Path) -> str:
    return yaml.safe_dump({"model": import_section(path)}, sort_keys=False)
