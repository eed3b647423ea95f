"""A checkpoint's saved pieces read back whole: one reader for every user of saved state.

Resume on another layout (``reshard_restore.py``), ``mcpar checkpoint verify``, export and
``mcpar generate`` all need a checkpoint's state put back together from the pieces a layout
saved: pipeline stages, tensor slices, experts spread over the expert axis (and moved between
slots by the load balancer), ZeRO pieces of the optimizer state over the data axis. The rules
for that live here, once:

- ``layout_maps``: which elements of the full model each saved coordinate holds (the index maps
  of ``reshard.py``: the training's own sharding code run on element codes);
- ``model_shards``: the saved model tensors grouped by (pipeline, tensor, expert) coordinate,
  one data replica of each;
- ``experts_in_order``: every MoE layer's experts put back in expert order, through the layer's
  saved ``expert_of_slot`` placement;
- ``join_optimizer_pieces``: AdamW's state per local tensor, ZeRO pieces joined by their
  element ranges, every element covered exactly once (a gap or an overlap is refused);
- ``full_parameters``, ``full_moments`` and ``saved_buffers``: the above composed into full
  tensors by the built model's names.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from mcpar.checkpoint.reshard import ELEMENT_BITS, assemble, placement_of, shard_maps
from mcpar.config import ModelConfig
from mcpar.errors import UserError, problem
from mcpar.models.spec import get_model_spec

Coord = tuple[int, int, int]  # (pipeline rank, tensor rank, expert rank)
Named = list[tuple[str, Any]]  # the built model's named_parameters, in order
MOMENTS = ("exp_avg", "exp_avg_sq")
# Where the balancer put each expert: a placement, not state. It is not hashed, and a reshard
# leaves the new run's own initial placement (its experts come in expert order).
PLACEMENT_BUFFERS = ("expert_of_slot",)

MODEL_KEY = re.compile(r"model/pp(\d+)-tp(\d+)(?:-ep(\d+))?(?:-dp(\d+))?/(.+)")
OPTIM_KEY = re.compile(
    r"optim/pp(\d+)-tp(\d+)(?:-ep(\d+))?(?:-dp(\d+))?/(.+)/(exp_avg|exp_avg_sq|step)")
PIECE = re.compile(r"(.+)@(\d+):(\d+)")


def layout_maps(cfg: ModelConfig, layout: dict[str, Any], coord: Coord, cache: bool = True
                ) -> dict[str, torch.Tensor]:
    """Local parameter name -> element codes, for one (pp, tp, ep) coordinate of ``layout``
    (a checkpoint's recorded layout: ``pipeline``, ``tensor``, ``experts``, ...); ``cache``:
    keep them for the next call (a streaming reader reads each coordinate once)."""
    return shard_maps(cfg, cfg.kind, layout["pipeline"], layout["virtual_stages"], coord[0],
                      layout["tensor"], coord[1], placement_of(layout),
                      ep=layout.get("experts", 1), ep_rank=coord[2], cache=cache)


def model_shards(saved: dict[str, torch.Tensor]) -> dict[Coord, dict[str, torch.Tensor]]:
    """Saved model tensors grouped by coordinate, one data replica (the lowest) of each."""
    return {coord: {key.split("/", 2)[2]: saved[key] for key in model_keys}
            for coord, (model_keys, _) in coordinate_keys(set(saved)).items()}


def coordinate_keys(keys: set[str]) -> dict[Coord, tuple[list[str], list[str]]]:
    """(pipeline, tensor, expert) coordinate -> (model keys, optimizer keys) to read for it:
    the lowest data replica's model tensors and whole optimizer tensors (replicas hold the
    same bits), and every replica's ZeRO pieces."""
    model: dict[Coord, dict[int, list[str]]] = {}
    whole: dict[tuple[Coord, str, str], tuple[int, str]] = {}
    pieces: dict[Coord, list[str]] = {}
    for key in sorted(keys):
        if (m := MODEL_KEY.fullmatch(key)) is not None:
            coord = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
            model.setdefault(coord, {}).setdefault(int(m.group(4) or 0), []).append(key)
        elif (m := OPTIM_KEY.fullmatch(key)) is not None:
            coord = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
            replica, local = int(m.group(4) or 0), m.group(5)
            if PIECE.fullmatch(local):
                pieces.setdefault(coord, []).append(key)
                continue
            known = whole.get((coord, local, m.group(6)))
            if known is None or replica < known[0]:
                whole[(coord, local, m.group(6))] = (replica, key)
    optim: dict[Coord, list[str]] = {c: list(keys) for c, keys in pieces.items()}
    for (coord, _, _), (_, key) in whole.items():
        optim.setdefault(coord, []).append(key)
    return {coord: (replicas[min(replicas)], optim.get(coord, []))
            for coord, replicas in sorted(model.items())}


def global_name(local: str, maps: dict[str, torch.Tensor], named: Named) -> str | None:
    """The built model's name of a local buffer, through a parameter of the same module (whose
    codes name its global parameter); None when its module holds no parameter."""
    module, _, leaf = local.rpartition(".")
    for name, codes in maps.items():
        if name.startswith(module + "."):
            rest = name[len(module):]
            full = named[int(codes.reshape(-1)[0]) >> ELEMENT_BITS][0]
            return full[: len(full) - len(rest)] + "." + leaf
    return None


def experts_in_order(cfg: ModelConfig, full: dict[str, torch.Tensor], named: Named,
                     shards: dict[Coord, dict[str, torch.Tensor]],
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


def _full(cfg: ModelConfig, parts: dict[Coord, dict[str, torch.Tensor]], named: Named,
          shards: dict[Coord, dict[str, torch.Tensor]],
          maps: dict[Coord, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    flat = assemble(parts, maps, [p.numel() for _, p in named])
    full = {name: t.view(p.shape) for (name, p), t in zip(named, flat, strict=True)}
    experts_in_order(cfg, full, named, shards, maps)
    return full


def full_parameters(cfg: ModelConfig, shards: dict[Coord, dict[str, torch.Tensor]],
                    maps: dict[Coord, dict[str, torch.Tensor]], named: Named
                    ) -> dict[str, torch.Tensor]:
    """Every parameter of the built model, full shape, float32, experts in expert order."""
    params = {c: {k: v for k, v in t.items() if k in maps[c]} for c, t in shards.items()}
    return _full(cfg, params, named, shards, maps)


def saved_buffers(shards: dict[Coord, dict[str, torch.Tensor]],
                  maps: dict[Coord, dict[str, torch.Tensor]], named: Named,
                  wanted: set[str]) -> dict[str, torch.Tensor]:
    """The saved persistent buffers by the built model's names (those in ``wanted``); buffers
    are replicated, so any coordinate's copy is the buffer."""
    out: dict[str, torch.Tensor] = {}
    for coord, tensors in shards.items():
        for key, value in tensors.items():
            if key in maps[coord]:
                continue
            name = global_name(key, maps[coord], named)
            if name in wanted:
                out[name] = value
    return out


def full_moments(cfg: ModelConfig, optim_saved: dict[str, torch.Tensor],
                 shards: dict[Coord, dict[str, torch.Tensor]],
                 maps: dict[Coord, dict[str, torch.Tensor]], named: Named, where: str
                 ) -> tuple[dict[str, dict[str, torch.Tensor]], float] | None:
    """AdamW's moments (``MOMENTS`` -> built model name -> full tensor, experts in expert
    order) and its step; None when the checkpoint holds no optimizer state (saved before the
    first step). Incomplete or inconsistent state is a UserError naming ``where``."""
    if not optim_saved:
        return None
    per_coord = join_optimizer_pieces(optim_saved, shards, maps, where)
    moments: dict[str, dict[str, torch.Tensor]] = {}
    for moment in MOMENTS:
        parts = {c: {n: s[moment] for n, s in states.items()} for c, states in per_coord.items()}
        try:
            moments[moment] = _full(cfg, parts, named, shards, maps)
        except ValueError as err:
            raise UserError(problem(where, f"the optimizer's {moment} is incomplete: {err}; "
                                    "the checkpoint cannot be read back whole")) from None
    steps = {float(s["step"]) for states in per_coord.values() for s in states.values()}
    if len(steps) != 1:
        raise UserError(problem(where, f"the optimizer's step differs between parameters "
                                f"({sorted(steps)}); the checkpoint cannot be read back whole"))
    return moments, steps.pop()


def join_optimizer_pieces(optim_saved: dict[str, torch.Tensor],
                          shards: dict[Coord, dict[str, torch.Tensor]],
                          maps: dict[Coord, dict[str, torch.Tensor]], where: str
                          ) -> dict[Coord, dict[str, dict[str, torch.Tensor]]]:
    """coordinate -> local parameter name -> {exp_avg, exp_avg_sq, step}, whole local tensors.

    A whole tensor is read from the lowest data replica that saved it (replicas hold the same
    bits). ZeRO pieces (``<name>@<a>:<b>``, the elements [a, b) of the flattened tensor, saved
    by their owner) are joined across the data axis; each element must come from exactly one
    piece."""
    whole: dict[tuple[Coord, str, str], tuple[int, torch.Tensor]] = {}
    pieces: dict[tuple[Coord, str, str], list[tuple[int, int, torch.Tensor]]] = {}
    for key, value in optim_saved.items():
        m = OPTIM_KEY.fullmatch(key)
        if m is None:
            continue
        coord = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        replica, local, kind = int(m.group(4) or 0), m.group(5), m.group(6)
        piece = PIECE.fullmatch(local)
        if piece is None:
            known = whole.get((coord, local, kind))
            if known is None or replica < known[0]:
                whole[(coord, local, kind)] = (replica, value)
        else:
            pieces.setdefault((coord, piece.group(1), kind), []).append(
                (int(piece.group(2)), int(piece.group(3)), value))
    out: dict[Coord, dict[str, dict[str, torch.Tensor]]] = {}
    for (coord, local, kind), (_, value) in whole.items():
        out.setdefault(coord, {}).setdefault(local, {})[kind] = value
    for (coord, local, kind), spans in pieces.items():
        saved_param = shards.get(coord, {}).get(local)
        if saved_param is None:
            raise UserError(problem(where, f"optimizer pieces of {local} at {coord} belong to "
                                    "no saved parameter; the checkpoint cannot be read back"))
        if kind == "step":
            values = {float(v) for _, _, v in spans}
            if len(values) != 1:
                raise UserError(problem(where, f"the pieces of {local} disagree on the step"))
            out.setdefault(coord, {}).setdefault(local, {})[kind] = spans[0][2]
            continue
        numel = saved_param.numel()
        flat = torch.empty(numel, dtype=spans[0][2].dtype)
        covered = torch.zeros(numel, dtype=torch.int32)
        for a, b, v in spans:
            if not 0 <= a <= b <= numel or v.numel() != b - a:
                raise UserError(problem(where, f"optimizer piece {local}@{a}:{b} does not fit "
                                        f"its parameter of {numel} elements"))
            flat[a:b] = v.reshape(-1)
            covered[a:b] += 1
        if not bool((covered == 1).all()):
            gaps, doubles = int((covered == 0).sum()), int((covered > 1).sum())
            raise UserError(problem(where, f"the ZeRO pieces of {local}'s {kind} leave {gaps} "
                                    f"elements out and hold {doubles} twice; the checkpoint "
                                    "cannot be read back"))
        out.setdefault(coord, {}).setdefault(local, {})[kind] = flat.view(saved_param.shape)
    for coord, states in out.items():
        for local, state in states.items():
            if local in maps.get(coord, {}) and set(state) != {"step", *MOMENTS}:
                raise UserError(problem(where, f"the optimizer state of {local} at {coord} "
                                        f"has only {sorted(state)}"))
    return {c: {n: s for n, s in states.items() if n in maps.get(c, {})}
            for c, states in out.items()}
