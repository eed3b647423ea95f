"""Resume a checkpoint saved under another layout: data, tensor, pipeline and expert degrees,
ZeRO stage, and experts moved between ranks by the load balancer.

This rank's state is cut out of the checkpoint's full state, read back by ``saved_state``
(the same reader ``mcpar checkpoint verify`` hashes), through this layout's index maps:

- parameters and AdamW's moments and step: the saved pieces (stages, tensor slices, experts of
  every expert rank, ZeRO pieces) are joined into full tensors with the experts in expert
  order, then this rank's elements are taken; every element must be covered;
- experts: the new run places them by its own initial placement (expert e in slot e) and its
  ``expert_of_slot`` buffers stay as built; where the old run's balancer had moved them does
  not follow them (it was a placement, not state);
- persistent buffers whose meaning does not depend on the layout (the auxiliary-loss-free
  ``expert_bias`` of each router, indexed by expert) are copied whole;
- the data stream position is restored by the caller; the step comes with the optimizer state.

What cannot follow a layout change restarts, and the load's log says so (``restarted``): the
RNG states (one generator per rank: they start from ``training.seed``), the compression error
buffers of PowerSGD (one per data rank: zero) and of 1-bit Adam unless only the data degree
changed (then the manager redistributes them per element, ``comm/onebit_reshard.py``, and the
log says ``redistributed``), and the expert load balancer's
own state (its placement table, load estimates and the learning agent's shadow placements are
per slot of the old expert layout: the balancer starts afresh from the initial placement).

Memory (host, per rank, P parameters): the checkpoint's model and optimizer tensors as saved
(with ``strategy: full``, every data replica's copy), the int64 index maps of every saved
coordinate (8 P bytes, more where tensor ranks replicate a tensor), the full parameters (4 P)
and then both full moments (8 P), float32. As before experts could be resharded, the whole
model is gathered on every host: that is what makes any-to-any resharding possible without
DTensor metadata, with no collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcpar.checkpoint.files import load_tensors
from mcpar.checkpoint.reshard import take
from mcpar.checkpoint.saved_state import (
    MOMENTS,
    PLACEMENT_BUFFERS,
    full_moments,
    full_parameters,
    global_name,
    layout_maps,
    model_shards,
    saved_buffers,
)
from mcpar.errors import UserError, problem
from mcpar.models.spec import get_model_spec
from mcpar.registry.codec import CODECS

# Layout keys the resharder follows; a checkpoint recording another one (a later version's
# axis) is refused before launch, naming it.
RESHARDABLE = ("data", "tensor", "pipeline", "experts", "virtual_stages", "world_size",
               "zero_stage", "placement", "context")


def reshard_problems(meta: dict[str, Any]) -> list[str]:
    """Why the checkpoint described by ``meta`` cannot be resharded onto another layout: one
    line per recorded layout key the resharder does not follow, naming it."""
    layout = meta.get("layout", {})
    return [problem(f"layout.{key}", f"the checkpoint was saved with {key} {layout[key]!r}, "
                    "which this version cannot reshard; resume it on its saved layout "
                    f"({layout}), or with the mcpar version that wrote it")
            for key in sorted(layout) if key not in RESHARDABLE]


def restarted_state(meta: dict[str, Any]) -> list[str]:
    """The per-rank state of a checkpoint that a reshard cannot carry (for the load's log)."""
    out = ["rng"]
    config = meta.get("config", {})
    # The codec's entry says whether it keeps per-rank error feedback (1-bit Adam is the 1bit
    # codec, asked by the optimizer key).
    codec = ("1bit" if config.get("optimization", {}).get("optimizer") == "onebit_adam"
             else config.get("controllers", {}).get("communication", {}).get("compression"))
    if codec in CODECS and CODECS.get(codec).error_state_bytes(1.0, 2) > 0:
        out.append("compression_errors")
    if (meta["layout"].get("experts", 1) > 1
            and config.get("controllers", {}).get("compute", {}).get("scheduler", "static")
            != "static"):
        out.append("load_balancer")
    return out


def restore_resharded(manager: Any, path: Path, meta: dict[str, Any]) -> None:
    """Load the checkpoint at ``path`` (saved under ``meta['layout']``) into this rank's
    parameters, persistent buffers and AdamW state under the manager's (different) layout."""
    cfg, dims = manager.cfg.model, manager.dims
    old = {"zero_stage": 0, **meta["layout"]}
    where = str(path)
    shards = model_shards(load_tensors(path, "model/"))
    maps = {c: layout_maps(cfg, old, c) for c in shards}
    named = list(get_model_spec(cfg.kind).build(cfg, 0).named_parameters())
    new_maps = layout_maps(cfg, manager.layout, (dims.axis_rank("pp"), dims.axis_rank("tp"),
                                                 dims.axis_rank("ep")))
    live = manager._named_tensors()
    try:
        full = full_parameters(cfg, shards, maps, named)
    except ValueError as err:
        raise UserError(problem(where, f"the saved parameters are incomplete: {err}")) from None
    flat = [full[name].reshape(-1) for name, _ in named]
    with torch.no_grad():
        for name, codes in new_maps.items():
            live[name].copy_(take(flat, codes).to(live[name].dtype))
    del full, flat
    _restore_buffers(live, new_maps, named, shards, maps, where)
    found = full_moments(cfg, load_tensors(path, "optim/"), shards, maps, named, where)
    if found is None:
        return  # saved before the first optimizer step: nothing more to restore
    moments, step = found
    flats = {m: [moments[m][name].reshape(-1) for name, _ in named] for m in MOMENTS}
    del moments
    optimizer = manager.optimizer
    name_of = {id(t): n for n, t in live.items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            # A ZeRO shard piece takes its elements of its parameter's state.
            source = getattr(param, "source", None)
            name = name_of[id(param if source is None else source)]
            if name not in new_maps:
                continue
            state = optimizer.state.get(param)
            if state is None or "exp_avg" not in state:
                optimizer.state[param] = state = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            state["step"].fill_(step)
            for moment in MOMENTS:
                value = take(flats[moment], new_maps[name])
                if source is not None:
                    value = value.reshape(-1)[param.start:param.end]
                state[moment].copy_(value.view_as(state[moment]))


def _restore_buffers(live: dict[str, torch.Tensor], new_maps: dict[str, torch.Tensor],
                     named: list[tuple[str, Any]], shards: dict, maps: dict, where: str) -> None:
    """Copy the saved persistent buffers this rank holds (whole: buffers are replicated),
    except the expert placement, which stays this run's initial one."""
    wanted: dict[str, str] = {}
    for local in live:
        if local in new_maps or local.rsplit(".", 1)[-1] in PLACEMENT_BUFFERS:
            continue
        name = global_name(local, new_maps, named)
        if name is not None:
            wanted[name] = local
    saved = saved_buffers(shards, maps, named, set(wanted))
    with torch.no_grad():
        for name, value in saved.items():
            target = live[wanted[name]]
            if target.shape != value.shape:
                raise UserError(problem(where, f"buffer {name} was saved with shape "
                                        f"{list(value.shape)}, this run's is "
                                        f"{list(target.shape)}"))
            target.copy_(value.to(target.dtype))
