"""Resharding: resume a checkpoint saved under another layout (data, tensor, pipeline degrees).

Every shard of every layout is a set of elements of the full model's parameters. To learn which,
the code that shards the model for training (the pipeline cut, then the tensor-parallel split,
as ``parallelize`` applies them) is run on an *index model*: the full model in float64 whose
every element holds its own code, ``parameter number * 2**32 + element number``. The index
model's shards are then exact maps from local elements to global ones, for any layout, and no
second description of how each layer is split exists to drift from the real one (the QKV
projection keeps whole heads of q, k and v, the embedding is split over the vocabulary, ...).

Loading scatters the saved shards of the old layout into full tensors through the old layout's
maps, then gathers this rank's shards through the new layout's maps. Parameters and AdamW's
parameter-shaped moments go the same way. Data-parallel replicas hold the same values, so the
replica 0 copy is read. Reading every shard on every rank costs host memory of the whole model;
it is what makes any-to-any resharding possible without DTensor metadata in the checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mcpar.checkpoint.files import load_tensors
from mcpar.config import ModelConfig
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.models.spec import get_model_spec
from mcpar.parallel.pipeline import global_stage
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tensor import apply_tensor_parallel

ELEMENT_BITS = 32


def _index_model(model_cfg: ModelConfig, kind: str) -> tuple[nn.Module, list[str]]:
    """The full model in float64 with element codes as values, and the global parameter names
    in code order."""
    model = get_model_spec(kind).build(model_cfg, 0).double()
    names = []
    with torch.no_grad():
        for index, (name, p) in enumerate(model.named_parameters()):
            p.copy_(torch.arange(p.numel(), dtype=torch.float64).view_as(p)
                    + float(index << ELEMENT_BITS))
            names.append(name)
    return model, names


def shard_maps(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int, tp: int,
               tp_rank: int, placement: str = "round_robin") -> dict[str, torch.Tensor]:
    """For one (pipeline rank, tensor rank) coordinate of a layout: local parameter name
    (``<chunk>.<name>``, as checkpoints store them) -> int64 codes of its elements.
    ``placement``: where the layout's schedule put the chunks' stages (a layout's
    ``placement`` key; absent: round robin)."""
    key = (model_cfg.model_dump_json(), kind, pp, virtual, pp_rank, tp, tp_rank, placement)
    if key not in _MAPS_CACHE:
        _MAPS_CACHE[key] = _shard_maps(model_cfg, kind, pp, virtual, pp_rank, tp, tp_rank,
                                       placement)
    return _MAPS_CACHE[key]


def placement_of(layout: dict[str, Any]) -> str:
    """A recorded layout's stage placement (checkpoints before it existed: round robin)."""
    return str(layout.get("placement", "round_robin"))


_MAPS_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def _shard_maps(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int, tp: int,
                tp_rank: int, placement: str) -> dict[str, torch.Tensor]:
    full, _ = _index_model(model_cfg, kind)
    spec = get_model_spec(kind)
    layer_ranges = partition_layers(model_cfg, pp * virtual)
    chunks = [cut_model(full, layer_ranges, global_stage(c, pp_rank, pp, placement),
                        spec.pieces) for c in range(virtual)]
    if tp > 1:
        for chunk in chunks:
            # Sharding only slices tensors; no collective runs, so no controller is needed.
            apply_tensor_parallel(chunk, spec.tensor_parallel, None,  # type: ignore[arg-type]
                                  tp_rank, tp, False)
    return index_codes(chunks)


def index_codes(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Each chunk's parameters (shared ones once) as their index codes, keyed like a rank's
    saved model tensors: ``"<chunk>.<parameter name>"``."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out[f"{index}.{name}"] = p.detach().to(torch.int64)
    return out


def full_sizes(model_cfg: ModelConfig, kind: str) -> list[int]:
    model = get_model_spec(kind).build(model_cfg, 0)
    return [p.numel() for p in model.parameters()]


def assemble(shards: dict[tuple[int, int], dict[str, torch.Tensor]],
             maps: dict[tuple[int, int], dict[str, torch.Tensor]],
             sizes: list[int]) -> list[torch.Tensor]:
    """Full flat tensors (one per global parameter) from every coordinate's shards, each
    ``{local name: tensor}``, through that coordinate's maps."""
    full = [torch.full((n,), float("nan"), dtype=torch.float32) for n in sizes]
    for coord, tensors in shards.items():
        for name, value in tensors.items():
            codes = maps[coord][name].reshape(-1)
            params, elements = codes >> ELEMENT_BITS, codes & ((1 << ELEMENT_BITS) - 1)
            flat = value.reshape(-1).to(torch.float32)
            for p in params.unique().tolist():
                mask = params == p
                full[p][elements[mask]] = flat[mask]
    missing = [i for i, t in enumerate(full) if torch.isnan(t).any()]
    if missing:
        raise ValueError(f"the checkpoint's shards do not cover parameter {missing[0]} "
                         f"({len(missing)} parameters incomplete)")
    return full


def take(full: list[torch.Tensor], codes: torch.Tensor) -> torch.Tensor:
    """This rank's shard (shape of ``codes``) from the full flat tensors."""
    flat_codes = codes.reshape(-1)
    params, elements = flat_codes >> ELEMENT_BITS, flat_codes & ((1 << ELEMENT_BITS) - 1)
    out = torch.empty(flat_codes.numel(), dtype=torch.float32)
    for p in params.unique().tolist():
        mask = params == p
        out[mask] = full[p][elements[mask]]
    return out.view(codes.shape)


def reshard(model_cfg: ModelConfig, kind: str, old: dict[str, int],
            read_shard: Callable[[int, int], dict[str, torch.Tensor]],
            new_maps: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This rank's tensors under the new layout (``new_maps``, from ``shard_maps``), from a
    checkpoint saved under layout ``old`` (``{"pipeline", "tensor", "virtual_stages"}``);
    ``read_shard(pp_rank, tp_rank)`` returns that old coordinate's tensors by local name."""
    pp, tp, virtual = old["pipeline"], old["tensor"], old["virtual_stages"]
    coords = [(p, t) for p in range(pp) for t in range(tp)]
    maps = {(p, t): shard_maps(model_cfg, kind, pp, virtual, p, tp, t, placement_of(old))
            for p, t in coords}
    full = assemble({c: read_shard(*c) for c in coords}, maps, full_sizes(model_cfg, kind))
    return {name: take(full, codes) for name, codes in new_maps.items()}


def restore_resharded(manager: Any, path: Path, meta: dict[str, Any]) -> None:
    """Load the checkpoint at ``path`` (saved under ``meta['layout']``) into this rank's
    parameters and AdamW state under the manager's (different) layout.

    Per-rank state (compression error buffers) cannot follow a layout change and starts from
    zero; RNG states stay as the config's seed set them. The data stream position is
    layout-independent and is restored by the caller.
    """

    cfg, dims = manager.cfg, manager.dims
    old = meta["layout"]
    suffix = "-dp0" if meta["strategy"] == "full" else ""
    model_saved = load_tensors(path, "model/")
    optim_saved = load_tensors(path, "optim/")

    def reader(prefix: dict[str, torch.Tensor], head: str, tail: str
               ) -> Callable[[int, int], dict[str, torch.Tensor]]:
        def read(pp_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
            start = f"{head}/pp{pp_rank}-tp{tp_rank}{suffix}/"
            found = {key[len(start):len(key) - len(tail)]: value
                     for key, value in prefix.items()
                     if key.startswith(start) and key.endswith(tail)}
            if head == "optim" and old.get("zero_stage", 0):
                # ZeRO pieces, saved by every replica without the data rank: reassemble.
                shapes = {k: v.shape for k, v in model_read(pp_rank, tp_rank).items()}
                found = _assemble_pieces(prefix, f"{head}/pp{pp_rank}-tp{tp_rank}-dp", tail,
                                         shapes)
            return found
        return read

    def model_read(pp_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
        start = f"model/pp{pp_rank}-tp{tp_rank}{suffix}/"
        return {key[len(start):]: value for key, value in model_saved.items()
                if key.startswith(start)}

    new_maps = shard_maps(cfg.model, cfg.model.kind, dims.pp, manager.layout["virtual_stages"],
                          dims.axis_rank("pp"), dims.tp, dims.axis_rank("tp"),
                          placement_of(manager.layout))
    named = manager._named_tensors()
    kind = cfg.model.kind
    params = reshard(cfg.model, kind, old, _only_params(reader(model_saved, "model", ""),
                                                        old, cfg), new_maps)
    with torch.no_grad():
        for name, value in params.items():
            named[name].copy_(value.to(named[name].dtype))
    steps = [v for k, v in optim_saved.items() if k.endswith("/step")]
    if not steps:
        return  # saved before the first optimizer step: nothing more to restore
    moments = {key: reshard(cfg.model, kind, old,
                            _only_params(reader(optim_saved, "optim", f"/{key}"), old, cfg),
                            new_maps)
               for key in ("exp_avg", "exp_avg_sq")}
    optimizer = manager.optimizer
    name_of = {id(t): n for n, t in named.items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            # A ZeRO shard piece takes its elements of its parameter's state.
            source = getattr(param, "source", None)
            name = name_of[id(param if source is None else source)]
            if name not in new_maps:
                continue

            def part(value: torch.Tensor, piece: Any = param if source is not None else None
                     ) -> torch.Tensor:
                return value if piece is None else value.reshape(-1)[piece.start:piece.end]

            state = optimizer.state.get(param)
            if state is None or "exp_avg" not in state:
                optimizer.state[param] = state = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            state["step"].fill_(float(steps[0]))
            state["exp_avg"].copy_(part(moments["exp_avg"][name]))
            state["exp_avg_sq"].copy_(part(moments["exp_avg_sq"][name]))


def _assemble_pieces(saved: dict[str, torch.Tensor], start: str, tail: str,
                     shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    """Whole tensors from ZeRO pieces saved as ``<start><data rank>/<name>@<a>:<b><tail>``: the
    elements [a, b) of the flattened tensor of ``<name>`` (whose shape ``shapes`` gives)."""
    flat: dict[str, torch.Tensor] = {}
    for key, value in saved.items():
        if not (key.startswith(start) and key.endswith(tail)):
            continue
        replica, _, rest = key[len(start):len(key) - len(tail)].partition("/")
        if not replica.isdigit():
            continue
        name, _, span = rest.rpartition("@")
        if not name or name not in shapes:
            continue
        a, b = (int(x) for x in span.split(":"))
        if name not in flat:
            flat[name] = torch.zeros(shapes[name].numel(), dtype=value.dtype)
        flat[name][a:b] = value.reshape(-1)
    return {name: t.view(shapes[name]) for name, t in flat.items()}


def _only_params(read: Callable[[int, int], dict[str, torch.Tensor]], old: dict[str, int],
                 cfg: Any) -> Callable[[int, int], dict[str, torch.Tensor]]:
    """Keep the parameters of a saved coordinate (persistent buffers are rebuilt, not moved)."""
    def read_params(pp_rank: int, tp_rank: int) -> dict[str, torch.Tensor]:
        maps = shard_maps(cfg.model, cfg.model.kind, old["pipeline"], old["virtual_stages"],
                          pp_rank, old["tensor"], tp_rank, placement_of(old))
        return {k: v for k, v in read(pp_rank, tp_rank).items() if k in maps}
    return read_params
