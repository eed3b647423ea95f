"""Index maps: which elements of the full model each shard of any layout holds.

Every shard of every layout is a set of elements of the full model's parameters. To learn which,
the code that shards the model for training (the pipeline cut, then the tensor-parallel split,
then the expert split, as ``parallelize`` applies them) is run on an *index model*: the model
in float64 whose every element holds its own code, ``parameter number * 2**32 + element
number``. It is built on the meta device and only the coordinate's pipeline chunks get codes,
so a coordinate's maps cost its stage's elements (8 bytes each, twice while the tensor split
runs), not the whole model's. The index model's shards are then exact maps from local elements
to global ones, for
any layout, and no second description of how each layer is split exists to drift from the real
one (the QKV projection keeps whole heads of q, k and v, the embedding is split over the
vocabulary, each expert's width over the tensor axis, ...).

``assemble`` scatters shards into full tensors through their maps, ``take`` gathers a shard
from full tensors. ``saved_state.py`` reads a checkpoint back whole with them (verify, export),
and ``reshard_restore.py`` streams this rank's shards of another layout out of it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
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


def shard_maps(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int, tp: int,
               tp_rank: int, placement: str = "round_robin", ep: int = 1, ep_rank: int = 0,
               cache: bool = True) -> dict[str, torch.Tensor]:
    """For one (pipeline rank, tensor rank, expert rank) coordinate of a layout: local parameter
    name (``<chunk>.<name>``, as checkpoints store them) -> int64 codes of its elements.
    ``placement``: where the layout's schedule put the chunks' stages (a layout's
    ``placement`` key; absent: round robin). Experts are in their initial slots (expert e in
    slot e); ``saved_state.experts_in_order`` undoes a balancer's moves. ``cache``: keep
    them for the next call with the same arguments."""
    key = (model_cfg.model_dump_json(), kind, pp, virtual, pp_rank, tp, tp_rank, placement, ep,
           ep_rank)
    if key in _MAPS_CACHE:
        return _MAPS_CACHE[key]
    maps = _shard_maps(model_cfg, kind, pp, virtual, pp_rank, tp, tp_rank, placement, ep,
                       ep_rank)
    if cache:
        _MAPS_CACHE[key] = maps
    return maps


def placement_of(layout: dict[str, Any]) -> str:
    """A recorded layout's stage placement (checkpoints before it existed: round robin)."""
    return str(layout.get("placement", "round_robin"))


_MAPS_CACHE: dict[tuple, dict[str, torch.Tensor]] = {}


# Codes made at once while a coordinate's codes are computed (float64): 32 MiB, or one group
# of parameters (a block, the embedding, the head) where a group is larger.
_BATCH_ELEMENTS = 1 << 22


def _shard_maps(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int, tp: int,
                tp_rank: int, placement: str, ep: int, ep_rank: int) -> dict[str, torch.Tensor]:
    out = dict(coordinate_codes(model_cfg, kind, pp, virtual, pp_rank, tp, tp_rank, placement,
                                ep, ep_rank))
    # In the order the whole coordinate lists them (checkpoints and maps agree on it).
    chunks, _ = _cut(model_cfg, kind, pp, virtual, pp_rank, placement)
    _shard(chunks, kind, tp, tp_rank, ep, ep_rank)
    return {name: out[name] for name in _local_names(chunks)}


def coordinate_codes(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int,
                     tp: int, tp_rank: int, placement: str = "round_robin", ep: int = 1,
                     ep_rank: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(local name, int64 codes) of every parameter one coordinate holds, produced a batch at a
    time: a reader that uses each as it comes holds one batch of codes, not the coordinate's.

    The model is built on the meta device and only a batch of the coordinate's parameters gets
    codes at a time (whole blocks, so that a layer the split treats as one is all real or all
    meta); the meta ones are left out of each batch's shards."""
    chunks, number = _cut(model_cfg, kind, pp, virtual, pp_rank, placement)
    done: set[str] = set()
    codes = None
    for batch in _batches(chunks, number):
        chunks, number = _cut(model_cfg, kind, pp, virtual, pp_rank, placement)
        _fill_codes(chunks, number, batch)
        _shard(chunks, kind, tp, tp_rank, ep, ep_rank)
        for name, codes in index_codes(chunks).items():
            if name not in done:
                done.add(name)
                yield name, codes
        # The cut model's modules refer to each other: only the collector frees the batch's
        # float64 codes, and the next batch would otherwise come on top of them.
        del chunks, codes
        gc.collect()


def _cut(model_cfg: ModelConfig, kind: str, pp: int, virtual: int, pp_rank: int,
         placement: str) -> tuple[list[nn.Module], dict[int, int]]:
    """A coordinate's pipeline chunks of the model built on the meta device, and every
    parameter's global number (by identity)."""
    spec = get_model_spec(kind)
    with torch.device("meta"):
        full = spec.build(model_cfg, 0)
    number = {id(p): index for index, p in enumerate(full.parameters())}
    layer_ranges = partition_layers(model_cfg, pp * virtual)
    return [cut_model(full, layer_ranges, global_stage(c, pp_rank, pp, placement), spec.pieces)
            for c in range(virtual)], number


def _shard(chunks: list[nn.Module], kind: str, tp: int, tp_rank: int, ep: int,
           ep_rank: int) -> None:
    """Tensor and expert splits of the chunks, as ``parallelize`` applies them."""
    spec = get_model_spec(kind)
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


def _batches(chunks: list[nn.Module], number: dict[int, int]) -> list[set[int]]:
    """The coordinate's parameter numbers in batches of whole groups (a block, or another top
    piece of a chunk), each up to ``_BATCH_ELEMENTS`` unless one group is larger."""
    groups: dict[str, set[int]] = {}
    sizes: dict[int, int] = {}
    for index, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters(remove_duplicate=False):
            parts = name.split(".")
            group = ".".join(parts[:2] if parts[0] == "blocks" else parts[:1])
            groups.setdefault(f"{index}.{group}", set()).add(number[id(p)])
            sizes[number[id(p)]] = p.numel()
    batches: list[set[int]] = []
    size = 0
    for members in groups.values():
        elements = sum(sizes[n] for n in members)
        if batches and size + elements <= _BATCH_ELEMENTS:
            batches[-1] |= members
            size += elements
        else:
            batches.append(set(members))
            size = elements
    return batches


def _fill_codes(chunks: list[nn.Module], number: dict[int, int], batch: set[int]) -> None:
    """Give the chunks' (meta) parameters numbered in ``batch`` their element codes, in
    float64; a parameter the chunks share (tied weights) gets one tensor everywhere."""
    made: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for module in chunk.modules():
            for leaf, p in list(module._parameters.items()):
                if p is None or not p.is_meta or number.get(id(p)) not in batch:
                    continue
                if id(p) not in made:
                    codes = (torch.arange(p.numel(), dtype=torch.float64).view(p.shape)
                             + float(number[id(p)] << ELEMENT_BITS))
                    made[id(p)] = nn.Parameter(codes, requires_grad=False)
                module._parameters[leaf] = made[id(p)]


def _local_names(chunks: list[nn.Module]) -> list[str]:
    """Local names of the chunks' parameters (shared ones once), as ``index_codes`` keys them."""
    out: list[str] = []
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(f"{index}.{name}")
    return out


def index_codes(chunks: list[nn.Module]) -> dict[str, torch.Tensor]:
    """Each chunk's parameters that hold codes (shared ones once; those left on the meta device
    are skipped) as int64 codes, keyed like a rank's saved model tensors:
    ``"<chunk>.<parameter name>"``."""
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for index, chunk in enumerate(chunks):
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                if not p.is_meta:
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
