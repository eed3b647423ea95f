"""A run's checkpoint, of any layout, as the full model's tensors in one process.

Export and ``mcpar generate`` both need the whole model from a checkpoint that tensor, pipeline
and expert parallelism cut into pieces. The pieces are put back through the index maps of
``checkpoint/reshard.py`` (the training's own sharding code run on a model of element codes), so
no second description of how each layer is split exists. Resharding for resume leaves experts
alone (MoE checkpoints resume on their own layout); here the index model also goes through
expert parallelism, which splits each expert's width over tp and the experts over ep, and the
experts are put back in expert order through each layer's ``expert_of_slot`` buffer (the load
balancer may have moved them between slots).
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcpar.checkpoint.files import find_latest_valid, list_checkpoints, verify_checkpoint
from mcpar.checkpoint.manager import checkpoint_dir, read_meta, saved_layout
from mcpar.checkpoint.reshard import (
    ELEMENT_BITS,
    _index_model,
    assemble,
    index_codes,
    placement_of,
    shard_maps,
)
from mcpar.config import JobConfig, ModelConfig, load_config
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.errors import UserError, problem
from mcpar.models.spec import get_model_spec
from mcpar.parallel.expert import apply_expert_parallel
from mcpar.parallel.pipeline import global_stage
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tensor import apply_tensor_parallel

_KEY = re.compile(r"model/pp(\d+)-tp(\d+)(?:-ep(\d+))?(?:-dp(\d+))?/(.+)")
Coord = tuple[int, int, int]  # (pipeline rank, tensor rank, expert rank)


@dataclass
class FullState:
    step: int
    path: Path
    job: JobConfig  # the run's configuration (config.yaml)
    model: ModelConfig  # as the checkpoint saved it
    params: dict[str, torch.Tensor]  # the built model's named_parameters names, full shapes
    buffers: dict[str, torch.Tensor]  # persistent buffers by the built model's names


def run_config(run_dir: Path) -> JobConfig:
    path = run_dir / "config.yaml"
    if not path.is_file():
        raise UserError(problem(str(run_dir), f"not an mcpar run directory (no {path.name}); "
                                "give the --run-dir of a `mcpar train`"))
    return load_config(path)


def find_checkpoint(run_dir: Path, step: int | None) -> tuple[JobConfig, int, Path]:
    """The run's config and the checkpoint to read: step ``step``, or the newest valid one."""
    job = run_config(run_dir)
    folder = checkpoint_dir(job, run_dir)
    if step is None:
        found = find_latest_valid(folder)
        if found is None:
            listed = len(list_checkpoints(folder))
            raise UserError(problem(str(folder), f"no valid checkpoint ({listed} found, none "
                                    "complete and intact); train with "
                                    "optimization.checkpoint.interval > 0"))
        return job, found[0], found[1]
    path = folder / f"step-{step}"
    reason = verify_checkpoint(path) if path.is_dir() else "it does not exist"
    if reason is not None:
        steps = [s for s, p in list_checkpoints(folder) if verify_checkpoint(p) is None]
        raise UserError(problem("--step", f"{path} is not a valid checkpoint: {reason}; valid "
                                f"steps: {steps or 'none'}"))
    return job, step, path


def layout_maps(cfg: ModelConfig, layout: dict[str, Any], coord: Coord
                ) -> dict[str, torch.Tensor]:
    """Local parameter name -> element codes, for one (pp, tp, ep) coordinate of ``layout``."""
    pp, tp, ep = layout["pipeline"], layout["tensor"], layout.get("experts", 1)
    virtual = layout["virtual_stages"]
    spec = get_model_spec(cfg.kind)
    placement = placement_of(layout)
    if spec.expert_parallel is None or (tp == 1 and ep == 1):
        return shard_maps(cfg, cfg.kind, pp, virtual, coord[0], tp, coord[1], placement)
    full, _ = _index_model(cfg, cfg.kind)
    ranges = partition_layers(cfg, pp * virtual)
    chunks = [cut_model(full, ranges, global_stage(c, coord[0], pp, placement), spec.pieces)
              for c in range(virtual)]
    for chunk in chunks:
        # Slicing only: no collective runs while sharding, so no communicator is needed.
        if tp > 1:
            apply_tensor_parallel(chunk, spec.tensor_parallel, None,  # type: ignore[arg-type]
                                  coord[1], tp, False)
        apply_expert_parallel(chunk, spec.expert_parallel, None,  # type: ignore[arg-type]
                              coord[2], ep, coord[1], tp)
    return index_codes(chunks)


def model_shards(saved: dict[str, torch.Tensor]) -> dict[Coord, dict[str, torch.Tensor]]:
    """Saved model tensors grouped by coordinate, one data replica (the lowest) of each."""
    chosen: dict[Coord, int] = {}
    out: dict[Coord, dict[str, torch.Tensor]] = {}
    for key, value in saved.items():
        m = _KEY.fullmatch(key)
        if m is None:
            continue
        coord = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        replica = int(m.group(4) or 0)
        if chosen.setdefault(coord, replica) == replica:
            out.setdefault(coord, {})[m.group(5)] = value
    return out


def load_full_state(run_dir: Path, step: int | None = None) -> FullState:
    """The full model of a run's checkpoint (``step``, or the newest valid one)."""
    from mcpar.checkpoint.files import load_tensors  # the packed reader, only when loading

    job, step, path = find_checkpoint(run_dir, step)
    meta = read_meta(path)
    cfg = ModelConfig.model_validate(meta["config"]["model"])
    layout = saved_layout(meta)
    with warnings.catch_warnings():  # DCP's note that it reads in one process: it is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        shards = model_shards(load_tensors(path, "model/"))
    maps = {c: layout_maps(cfg, layout, c) for c in shards}
    params = {c: {k: v for k, v in t.items() if k in maps[c]} for c, t in shards.items()}
    model = get_model_spec(cfg.kind).build(cfg, 0)
    named = list(model.named_parameters())
    flat = assemble(params, maps, [p.numel() for _, p in named])
    full = {name: t.view(p.shape) for (name, p), t in zip(named, flat, strict=True)}
    experts_in_order(cfg, full, named, shards, maps)
    wanted = dict(model.named_buffers())
    buffers = {}
    for coord, tensors in shards.items():
        for key, value in tensors.items():
            name = _global_name(key, maps[coord], named)
            if key not in maps[coord] and name in wanted:
                buffers[name] = value
    return FullState(step, path, job, cfg, full, buffers)


def _global_name(local: str, maps: dict[str, torch.Tensor], named: list[tuple[str, Any]]
                 ) -> str | None:
    """The built model's name of a local buffer, through a parameter of the same module (whose
    codes name its global parameter); None when its module holds no parameter."""
    module, _, leaf = local.rpartition(".")
    for name, codes in maps.items():
        if name.startswith(module + "."):
            rest = name[len(module):]
            full = named[int(codes.reshape(-1)[0]) >> ELEMENT_BITS][0]
            return full[: len(full) - len(rest)] + "." + leaf
    return None


@dataclass(frozen=True)
class RunTokenizer:
    path: Path  # its tokenizer.json
    # The token that ends every document of the run's data (what the model learned to emit at
    # the end of a text); None when the data has none (the bytes tokenizer has no such token).
    eos_token: str | None


def run_tokenizer(job: JobConfig, vocab_size: int) -> RunTokenizer | None:
    """The tokenizer a run used and its end-of-document token: a prepared source's own copy
    and the token its manifest names (``mcpar prepare --eos-token`` included), the configured
    file and the token its data was prepared with, or mcpar's cached BPE (read back through the
    corpus cache); None for the bytes tokenizer (and a ``.bin`` source without one)."""
    from mcpar.data.prepared_corpus import is_prepared_source, parse_blend, tokenizer_copy
    from mcpar.data.shards import read_manifest
    from mcpar.data.tokenizer_file import is_tokenizer_file, load_tokenizer_file

    data = job.data
    if not data.source.endswith(".bin") and is_prepared_source(data.source):
        # A blend's sources share one tokenizer (checked when it is read): the first one's.
        first = Path((parse_blend(data.source) or [(data.source, 1.0)])[0][0]).expanduser()
        manifest = read_manifest(first, "data.source")
        # The copy kept inside the directory (a link out is refused), as training reads it.
        return RunTokenizer(tokenizer_copy(first), manifest.get("eos_token"))
    if data.tokenizer == "bytes":
        return None
    if is_tokenizer_file(data.tokenizer):
        tok = load_tokenizer_file(data.tokenizer)  # the token its text was prepared with
        return RunTokenizer(tok.path, tok.eos_token)
    from mcpar.data.corpus import load_corpus

    corpus = load_corpus(data.source, data.tokenizer, vocab_size, data.val_fraction,
                         token_dtype=data.token_dtype, cache_dir=data.cache_dir)
    if corpus.tokenizer_path is None:
        return None
    from mcpar.data.bpe import END_OF_TEXT  # written after every file of the corpus

    return RunTokenizer(corpus.tokenizer_path, END_OF_TEXT)


def run_tokenizer_path(job: JobConfig, vocab_size: int) -> Path | None:
    """The tokenizer.json a run used (``run_tokenizer``); None for the bytes tokenizer."""
    found = run_tokenizer(job, vocab_size)
    return found.path if found is not None else None


def experts_in_order(cfg: ModelConfig, full: dict[str, torch.Tensor],
                      named: list[tuple[str, Any]], shards: dict[Coord, dict[str, torch.Tensor]],
                      maps: dict[Coord, dict[str, torch.Tensor]]) -> None:
    """Put every MoE layer's experts back in expert order (slot s holds expert_of_slot[s])."""
    plan = get_model_spec(cfg.kind).expert_parallel
    if plan is None:
        return
    done: set[str] = set()
    for coord, tensors in shards.items():
        for key, expert_of_slot in tensors.items():
            if not key.endswith(".expert_of_slot"):
                continue
            prefix = key[: -len("expert_of_slot")]
            codes = maps[coord][prefix + plan.weights[0].path]
            first = named[int(codes.reshape(-1)[0]) >> ELEMENT_BITS][0]
            layer = first[: -len(plan.weights[0].path)]
            if layer in done:
                continue
            done.add(layer)
            slot_of_expert = torch.argsort(expert_of_slot)
            for weight in plan.weights:
                full[layer + weight.path] = full[layer + weight.path][slot_of_expert]
