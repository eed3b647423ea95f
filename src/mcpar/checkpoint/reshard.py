"""Index maps: which elements of the full model each shard of any layout holds.

Every shard of every layout is a set of elements of the full model's parameters. To learn which,
the code that shards the model for training (the pipeline cut, then the tensor-parallel split,
then the expert split, as ``parallelize`` applies them) is run on an *index model*: the full
model in float64 whose every element holds its own code, ``parameter number * 2**32 + element
number``. The index model's shards are then exact maps from local elements to global ones, for
any layout, and no second description of how each layer is split exists to drift from the real
one (the QKV projection keeps whole heads of q, k and v, the embedding is split over the
vocabulary, each expert's width over the tensor axis, ...).

``assemble`` scatters shards into full tensors through their maps, ``take`` gathers a shard
from full tensors. ``saved_state.py`` reads a checkpoint back whole with them, and
``reshard_restore.py`` cuts this rank's shards of another layout out of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from mcpar.config import ModelConfig
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.models.spec import get_model_spec
from mcpar.parallel.expert import apply_expert_parallel
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
               tp_rank: int, placement: str = "round_robin", ep: int = 1, ep_rank: int = 0
               ) -> dict[str, torch.Tensor]:
    """For one (pipeline rank, tensor rank, expert rank) coordinate of a layout: local parameter
    name (``<chunk>.<name>``, as checkpoints store them) -> int64 codes of its elements.
    ``placement``: where the layout's schedule put the chunks' stages (a layout's
    ``placement`` key; absent: round robin). Experts are in their initial slots (expert e in
    slot e); ``saved_state.experts_in_order`` undoes a balancer's moves."""
    key = (model_cfg.model_dump_json(), kind, pp, virtual, pp_rank, tp, tp_rank, placement, ep,
           ep_rank)
    if key not in _MAPS_CACHE:
        _MAPS_CACHE[key] = _shard_maps(model_cfg, kind, pp, virtual, pp_rank, tp, tp_rank,
                                       placement, ep, ep_rank)
    return _MAPS_CACHE[key]


def placement_of(layout: dict[str, Any]) -> str:
    """A recorded layout's stage placement (checkpoints before it existed: round robin)."""
    return str(layout.get("placement", "round_robin"))


_MAPS_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


def _shard_maps(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int, tp: int,
                tp_rank: int, placement: str, ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
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
    # The rule of parallelize: experts spread over 'ep', each expert's width over 'tp'.
    if spec.expert_parallel is not None and (ep > 1 or tp > 1):
        for chunk in chunks:
            apply_expert_parallel(chunk, spec.expert_parallel, None,  # type: ignore[arg-type]
                                  ep_rank, ep, tp_rank, tp)
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
