"""A checkpoint's training state in one canonical order, whatever its layout, and its hash.

A layout decides where each piece of state lives, never what it is: the same model trained to
the same step holds the same parameters and AdamW moments whether they sit whole on one rank,
cut by tensor and pipeline parallelism, split into ZeRO pieces over the data axis, or moved
between expert slots by the load balancer. ``canonical_state`` reads a checkpoint back into
that layout-free form, so that ``mcpar checkpoint verify`` can print one hash for it and a
reshard A -> B can be checked by comparing two hashes instead of trusting the resharder.

The pieces are put back with the checkpoint's own machinery: the index maps of
``checkpoint/reshard.py`` (the training's sharding code run on element codes, as export does),
ZeRO pieces joined by their element ranges, experts put back in expert order. Every element of
every tensor must be covered exactly once: a gap or an overlap is reported, never hashed.

What the canonical state holds, sorted by name:

- ``param/<name>``: every parameter of the built model, full shape, float32;
- ``buffer/<name>``: persistent buffers, except where the balancer put each expert (a
  placement, not state: the experts themselves are already in expert order);
- ``optim/<name>/exp_avg``, ``optim/<name>/exp_avg_sq``, ``optim/<name>/step``: AdamW's state;
- ``step`` and ``data_stream``: the optimizer step and the data stream's position.

Left out, because they are per rank by nature and would make the hash a function of the
layout: the RNG states (one generator per rank) and the compression error buffers of 1-bit Adam
and PowerSGD (one per rank of the data axis).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcpar.checkpoint.manager import read_meta, saved_layout
from mcpar.checkpoint.reshard import assemble
from mcpar.config import JobConfig, ModelConfig
from mcpar.errors import UserError, problem
from mcpar.interop.full_state import (
    Coord,
    experts_in_order,
    find_checkpoint,
    layout_maps,
    load_full_state,
    model_shards,
)
from mcpar.models.spec import get_model_spec

MOMENTS = ("exp_avg", "exp_avg_sq")
_OPTIM_KEY = re.compile(
    r"optim/pp(\d+)-tp(\d+)(?:-ep(\d+))?(?:-dp(\d+))?/(.+)/(exp_avg|exp_avg_sq|step)")
_PIECE = re.compile(r"(.+)@(\d+):(\d+)")
# Where the balancer put each expert: a placement, not state (see the module docstring).
_PLACEMENT_BUFFERS = ("expert_of_slot",)


@dataclass
class CanonicalState:
    step: int
    path: Path  # the checkpoint folder read
    layout: dict[str, Any]  # the layout it was saved under
    job: JobConfig
    tensors: dict[str, torch.Tensor]  # sorted by name, as described in the module docstring
    data_stream: dict[str, Any]

    def digest(self) -> str:
        return digest_of(self.tensors, self.step, self.data_stream)

    def group_digests(self) -> dict[str, str]:
        """One hash per kind of state, to see which part differs when the whole does."""
        groups: dict[str, dict[str, torch.Tensor]] = {}
        for name, t in self.tensors.items():
            groups.setdefault(name.split("/", 1)[0], {})[name] = t
        return {kind: digest_of(ts, None, None) for kind, ts in groups.items()}


def digest_of(tensors: dict[str, torch.Tensor], step: int | None,
              data_stream: dict[str, Any] | None) -> str:
    """sha256 over every tensor's name, dtype, shape and little-endian bytes, in name order, then
    the step and the data position as canonical JSON."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        # Through uint8 so that every dtype hashes (numpy has no bfloat16).
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    if step is not None or data_stream is not None:
        h.update(json.dumps({"step": step, "data_stream": data_stream},
                            sort_keys=True).encode())
    return h.hexdigest()


def canonical_state(run_dir: Path, step: int | None = None) -> CanonicalState:
    """The canonical state of a run's checkpoint (``step``, or the newest valid one)."""
    from mcpar.checkpoint.files import load_tensors  # the packed reader, only when loading

    full = load_full_state(run_dir, step)
    meta = read_meta(full.path)
    layout = saved_layout(meta)
    cfg = ModelConfig.model_validate(meta["config"]["model"])
    tensors: dict[str, torch.Tensor] = {}
    for name, t in full.params.items():
        tensors[f"param/{name}"] = t.to(torch.float32)
    for name, t in full.buffers.items():
        if name.rsplit(".", 1)[-1] not in _PLACEMENT_BUFFERS:
            tensors[f"buffer/{name}"] = t
    with warnings.catch_warnings():  # DCP's note that it reads in one process: it is meant to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        model_saved = load_tensors(full.path, "model/")
        optim_saved = load_tensors(full.path, "optim/")
    tensors.update(_optimizer_state(cfg, layout, model_saved, optim_saved, str(full.path)))
    return CanonicalState(full.step, full.path, layout, full.job,
                          dict(sorted(tensors.items())), meta.get("data_stream", {}))


def _optimizer_state(cfg: ModelConfig, layout: dict[str, Any],
                     model_saved: dict[str, torch.Tensor], optim_saved: dict[str, torch.Tensor],
                     where: str) -> dict[str, torch.Tensor]:
    """``optim/<name>/<state>`` for every parameter of the built model; empty before the first
    optimizer step."""
    if not optim_saved:
        return {}
    shards = model_shards(model_saved)
    maps = {c: layout_maps(cfg, layout, c) for c in shards}
    per_coord = join_optimizer_pieces(optim_saved, shards, maps, where)
    model = get_model_spec(cfg.kind).build(cfg, 0)
    named = list(model.named_parameters())
    sizes = [p.numel() for _, p in named]
    out: dict[str, torch.Tensor] = {}
    for moment in MOMENTS:
        parts = {c: {n: s[moment] for n, s in states.items()} for c, states in per_coord.items()}
        try:
            flat = assemble(parts, maps, sizes)
        except ValueError as err:
            raise UserError(problem(where, f"the optimizer's {moment} is incomplete: {err}; "
                                    "the checkpoint cannot be verified")) from None
        full = {name: t.view(p.shape) for (name, p), t in zip(named, flat, strict=True)}
        experts_in_order(cfg, full, named, shards, maps)
        for name, t in full.items():
            out[f"optim/{name}/{moment}"] = t
    steps = {float(s["step"]) for states in per_coord.values() for s in states.values()}
    if len(steps) != 1:
        raise UserError(problem(where, f"the optimizer's step differs between parameters "
                                f"({sorted(steps)}); the checkpoint cannot be verified"))
    step = torch.tensor(steps.pop(), dtype=torch.float32)
    for name, _ in named:
        out[f"optim/{name}/step"] = step
    return out


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
        m = _OPTIM_KEY.fullmatch(key)
        if m is None:
            continue
        coord = (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0))
        replica, local, kind = int(m.group(4) or 0), m.group(5), m.group(6)
        piece = _PIECE.fullmatch(local)
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
                                    "no saved parameter; the checkpoint cannot be verified"))
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
                                    "cannot be verified"))
        out.setdefault(coord, {}).setdefault(local, {})[kind] = flat.view(saved_param.shape)
    for coord, states in out.items():
        for local, state in states.items():
            if local in maps.get(coord, {}) and set(state) != {"step", *MOMENTS}:
                raise UserError(problem(where, f"the optimizer state of {local} at {coord} "
                                        f"has only {sorted(state)}"))
    return {c: {n: s for n, s in states.items() if n in maps.get(c, {})}
            for c, states in out.items()}


@dataclass(frozen=True)
class Difference:
    name: str
    max_abs: float  # inf where the shapes or the names differ


def compare(a: CanonicalState, b: CanonicalState) -> list[Difference]:
    """Every entry whose values differ between two canonical states, largest difference first;
    the step and the data position as entries ``step`` and ``data_stream``."""
    out: list[Difference] = []
    for name in sorted(set(a.tensors) | set(b.tensors)):
        x, y = a.tensors.get(name), b.tensors.get(name)
        if x is None or y is None or x.shape != y.shape:
            out.append(Difference(name, float("inf")))
            continue
        if not torch.equal(x, y):
            diff = (x.double() - y.double()).abs().max().item()
            out.append(Difference(name, diff if diff == diff else float("inf")))
    if a.step != b.step:
        out.append(Difference("step", float(abs(a.step - b.step))))
    if a.data_stream != b.data_stream:
        out.append(Difference("data_stream", float("inf")))
    return sorted(out, key=lambda d: -d.max_abs)


def describe_layout(layout: dict[str, Any]) -> str:
    words = [f"{axis} {layout[axis]}" for axis in ("data", "tensor", "pipeline", "experts")
             if layout.get(axis, 1) != 1]
    if layout.get("zero_stage"):
        words.append(f"ZeRO {layout['zero_stage']}")
    return " x ".join(words) or "single process"


def locate(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder ``canonical_state`` would read (for messages)."""
    return find_checkpoint(run_dir, step)[2]
