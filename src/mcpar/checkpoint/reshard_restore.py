"""Resume a checkpoint saved under another layout: data, tensor, pipeline and expert degrees,
ZeRO stage, and experts moved between ranks by the load balancer.

This rank's state is cut out of the checkpoint one saved (pipeline, tensor, expert) coordinate
at a time, through each coordinate's index maps and this layout's (``reshard.py``), by the same
key and piece rules as ``saved_state`` (the reader ``mcpar checkpoint verify`` hashes):

- parameters and AdamW's moments and step: each saved piece (a stage, a tensor slice, the
  experts of an expert rank, ZeRO pieces joined over the data replicas) gives this rank the
  elements it holds (``shard_targets.py``); every element must be covered;
- experts: under another expert degree, a saved expert weight's elements are taken as the
  experts its slots held (the layer's saved ``expert_of_slot``) and the new run places them by
  its own initial placement (expert e in slot e): the old slots mean nothing there. Under the
  same expert degree they stay in their saved slots with their placement buffers, and the
  manager carries the load balancer's state (``load_balancer`` under ``carried``);
- persistent buffers whose meaning does not depend on the layout (the auxiliary-loss-free
  ``expert_bias`` of each router, indexed by expert) are copied whole;
- the data stream position is restored by the caller; the step comes with the optimizer state.

What cannot follow a layout change restarts, and the load's log says so (``restarted``): the
RNG states (one generator per rank: they start from ``training.seed``), the compression error
buffers of PowerSGD (one per data rank: zero) and of 1-bit Adam unless only the data degree
changed (then the manager redistributes them per element, ``comm/onebit_reshard.py``, and the
log says ``carried``), and, under another expert degree, the expert load balancer's own state
(its placement table, load estimates and the learning agent's shadow placements are per slot
of the old expert layout: the balancer starts afresh from the initial placement).

Memory (host, per rank): this rank's share three times over in float32 (parameters and both
moments) and its codes (int64, with their sorted copy and inverse: 24 bytes per element), plus,
for one saved coordinate at a time, that coordinate's saved tensors (one data replica's model
and optimizer tensors, or every replica's ZeRO pieces) and its codes. The whole model is never
put together on a host; no collective runs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from mcpar.checkpoint.files import SafeFileSystemReader
from mcpar.checkpoint.packing import PackedCheckpoint
from mcpar.checkpoint.reshard import ELEMENT_BITS, coordinate_codes, placement_of
from mcpar.checkpoint.saved_state import (
    MOMENTS,
    PLACEMENT_BUFFERS,
    Coord,
    coordinate_keys,
    global_name,
    join_optimizer_pieces,
)
from mcpar.checkpoint.shard_targets import ShardTargets, Sink, expert_order_codes
from mcpar.device import host_peak_rss, release_freed_host_memory
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


def restore_resharded(manager: Any, path: Path, meta: dict[str, Any]) -> int | None:
    """Load the checkpoint at ``path`` (saved under ``meta['layout']``) into this rank's
    parameters, persistent buffers and AdamW state under the manager's (different) layout,
    reading one saved coordinate at a time (``shard_targets.py``). Returns the host memory the
    reading held at its peak above this rank's own state (parameters, and AdamW's moments made
    first), in bytes; None where it cannot be measured."""
    saved = PackedCheckpoint(path, SafeFileSystemReader)
    coords = coordinate_keys(saved.keys())
    has_optim = any(optim for _, optim in coords.values())
    live = manager._named_tensors()
    states: list[dict[str, torch.Tensor]] = []
    sinks_of: dict[str, dict[str, Sink]] = {}
    if has_optim:
        # The optimizer state this rank holds anyway (AdamW makes it at the first step), made
        # and touched before the reading is measured.
        sinks_of, states = _moment_sinks(manager.optimizer, live)
    release_freed_host_memory()
    with host_peak_rss() as peak:
        steps = _read_coordinates(manager, path, meta, saved, coords, live, sinks_of)
    if states:
        if len(steps) != 1:
            raise UserError(problem(str(path), f"the optimizer's step differs between "
                                    f"parameters ({sorted(steps)}); the checkpoint cannot be "
                                    "read back"))
        step = steps.pop()
        for state in states:
            state["step"].fill_(step)
    return peak.bytes


def _read_coordinates(manager: Any, path: Path, meta: dict[str, Any], saved: PackedCheckpoint,
                      coords: dict[Coord, tuple[list[str], list[str]]],
                      live: dict[str, torch.Tensor], sinks_of: dict[str, dict[str, Sink]]
                      ) -> set[float]:
    """Every saved coordinate's pieces into this rank's tensors; the optimizer steps seen."""
    cfg, dims = manager.cfg.model, manager.dims
    old = {"zero_stage": 0, "experts": 1, **meta["layout"]}
    new = {"experts": 1, **manager.layout}
    where = str(path)
    with torch.device("meta"):  # names and sizes only
        named = list(get_model_spec(cfg.kind).build(cfg, 0).named_parameters())
    mine = (dims.axis_rank("pp"), dims.axis_rank("tp"), dims.axis_rank("ep"))
    targets = ShardTargets(coordinate_codes(
        cfg, cfg.kind, new["pipeline"], new["virtual_stages"], mine[0], new["tensor"], mine[1],
        placement_of(new), new["experts"], mine[2]))
    # The codes were made a batch at a time and are gone; their pages go back before the
    # reading starts (training keeps freed heap memory for reuse: ``keep_freed_host_memory``).
    release_freed_host_memory()
    first = {name: runs.parameter << ELEMENT_BITS for name, runs in targets.runs.items()}
    targets.add_kind("param", {name: [(0, live[name].numel(), live[name])]
                               for name in targets.runs})
    for moment, sinks in sinks_of.items():
        targets.add_kind(moment, sinks)
    # Under the same expert degree the experts stay in the slots the balancer had moved them
    # to (their placement buffers come back too), so that the balancer's state can follow.
    keep_slots = old["experts"] == new["experts"]
    wanted = _wanted_buffers(live, first, named, keep_placement=keep_slots)
    buffers: dict[str, torch.Tensor] = {}
    steps: set[float] = set()
    for coord, (model_keys, optim_keys) in coords.items():
        # One coordinate per call: its tensors (views into its packs) die with the call.
        steps |= _read_coordinate(cfg, old, coord, saved.read(model_keys),
                                  saved.read(optim_keys) if optim_keys else {}, targets, named,
                                  wanted, buffers, where, keep_slots)
        release_freed_host_memory()
    if targets.missing("param"):
        raise UserError(problem(where, f"the saved parameters are incomplete: "
                                f"{targets.missing('param')} elements of this rank's shards "
                                "are in no saved piece"))
    _restore_buffers(live, wanted, buffers, where)
    for moment in sinks_of:
        if targets.missing(moment):
            raise UserError(problem(where, f"the optimizer's {moment} is incomplete: "
                                    f"{targets.missing(moment)} elements of this rank's shards "
                                    "are in no saved piece"))
    return steps


def _read_coordinate(cfg: Any, old: dict[str, Any], coord: Coord,
                     model_saved: dict[str, torch.Tensor], optim_saved: dict[str, torch.Tensor],
                     targets: ShardTargets, named: list[tuple[str, Any]],
                     wanted: dict[str, str], buffers: dict[str, torch.Tensor],
                     where: str, keep_slots: bool) -> set[float]:
    """One saved coordinate's parameters, moments and wanted buffers into ``targets`` and
    ``buffers``; the optimizer steps it holds. ``keep_slots``: experts go to the slots they
    were saved in, not to their expert order."""
    model = {key.split("/", 2)[2]: value for key, value in model_saved.items()}
    del model_saved
    pieces: dict[str, dict[str, torch.Tensor]] = {}
    if optim_saved:
        shapes = {local: torch.empty(value.shape, device="meta")
                  for local, value in model.items()}
        pieces = join_optimizer_pieces(optim_saved, {coord: shapes}, {coord: shapes},
                                       where).get(coord, {})
        del optim_saved
        release_freed_host_memory()  # the read's staging copy
    plan = None if keep_slots else get_model_spec(cfg.kind).expert_parallel
    steps: set[float] = set()
    held: dict[str, int] = {}  # local parameter -> its first code (names its module)
    for local, codes in coordinate_codes(
            cfg, cfg.kind, old["pipeline"], old["virtual_stages"], coord[0], old["tensor"],
            coord[1], placement_of(old), old["experts"], coord[2]):
        if local not in model:
            raise UserError(problem(where, f"the saved parameters are incomplete: {local} of "
                                    f"coordinate {coord} is missing"))
        held[local] = int(codes.reshape(-1)[0])
        codes = _expert_codes(codes, local, model, plan, named)
        targets.scatter("param", codes, model[local])
        state = pieces.get(local)
        if state is not None:  # complete: join_optimizer_pieces checked it
            for moment in MOMENTS:
                targets.scatter(moment, codes, state[moment])
            steps.add(float(state["step"]))
    marks = {local: torch.tensor([code]) for local, code in held.items()}
    for local, value in model.items():
        if local in held:
            continue
        name = global_name(local, marks, named)
        if name in wanted and name not in buffers:
            buffers[name] = value.clone()  # a view would keep the coordinate's pack alive
    return steps


def _expert_codes(codes: torch.Tensor, local: str, model: dict[str, torch.Tensor], plan: Any,
                  named: list[tuple[str, Any]]) -> torch.Tensor:
    """A saved tensor's element codes; an expert weight's taken as the experts its slots held
    (its layer's saved ``expert_of_slot``, where the balancer had moved them)."""
    if plan is None:
        return codes
    for weight in plan.weights:
        if local.endswith("." + weight.path):
            placement = model.get(local[: -len(weight.path)] + "expert_of_slot")
            if placement is None:
                return codes
            full = named[int(codes.reshape(-1)[0]) >> ELEMENT_BITS][1].numel()
            return expert_order_codes(codes, placement, full)
    return codes


def _moment_sinks(optimizer: torch.optim.Optimizer, live: dict[str, torch.Tensor]
                  ) -> tuple[dict[str, dict[str, Sink]], list[dict[str, torch.Tensor]]]:
    """Where each moment of each local tensor goes: its AdamW state (made where the optimizer
    has none yet), whole, or the ranges a ZeRO piece of it holds; and those states."""
    out: dict[str, dict[str, Sink]] = {moment: {} for moment in MOMENTS}
    states = []
    name_of = {id(t): n for n, t in live.items()}
    for group in optimizer.param_groups:
        for param in group["params"]:
            # A ZeRO shard piece takes its elements of its parameter's state.
            source = getattr(param, "source", None)
            name = name_of[id(param if source is None else source)]
            state = optimizer.state.get(param)
            if state is None or "exp_avg" not in state:
                optimizer.state[param] = state = {
                    "step": torch.zeros((), dtype=torch.float32),
                    "exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
            for moment in MOMENTS:
                state[moment].zero_()  # resident now: it is this rank's state, not the read's
            states.append(state)
            start, end = ((0, param.numel()) if source is None
                          else (int(param.start), int(param.end)))
            for moment in MOMENTS:
                out[moment].setdefault(name, []).append((start, end, state[moment]))
    return out, states


def _wanted_buffers(live: dict[str, torch.Tensor], first: dict[str, int],
                    named: list[tuple[str, Any]], keep_placement: bool) -> dict[str, str]:
    """Global name -> local name of the persistent buffers this rank holds (``first``: each
    local parameter's first element code, which names its module); the expert placement only
    with ``keep_placement`` (else it stays this run's initial one)."""
    marks = {local: torch.tensor([code]) for local, code in first.items()}
    wanted: dict[str, str] = {}
    for local in live:
        if local in marks or (not keep_placement
                              and local.rsplit(".", 1)[-1] in PLACEMENT_BUFFERS):
            continue
        name = global_name(local, marks, named)
        if name is not None:
            wanted[name] = local
    return wanted


def _restore_buffers(live: dict[str, torch.Tensor], wanted: dict[str, str],
                     saved: dict[str, torch.Tensor], where: str) -> None:
    """Copy the saved persistent buffers (whole: buffers are replicated)."""
    with torch.no_grad():
        for name, value in saved.items():
            target = live[wanted[name]]
            if target.shape != value.shape:
                raise UserError(problem(where, f"buffer {name} was saved with shape "
                                        f"{list(value.shape)}, this run's is "
                                        f"{list(target.shape)}"))
            target.copy_(value.to(target.dtype))
