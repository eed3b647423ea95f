"""A checkpoint's training state in one canonical order, whatever its layout, and its hash.

A layout decides where each piece of state lives, never what it is: the same model trained to
the same step holds the same parameters and AdamW moments whether they sit whole on one rank,
cut by tensor and pipeline parallelism, split into ZeRO pieces over the data axis, or moved
between expert slots by the load balancer. ``canonical_state`` reads a checkpoint back into
that layout-free form, so that ``mcpar checkpoint verify`` can print one hash for it and a
reshard A -> B can be checked by comparing two hashes instead of trusting the resharder.

The pieces are put back by the checkpoint layer's reader, ``checkpoint/saved_state.py`` (the
training's sharding code run on element codes, ZeRO pieces joined by their element ranges,
experts put back in expert order), which resume on another layout uses too: what is hashed is
what a reshard loads. Every element of every tensor must be covered exactly once: a gap or an
overlap is reported, never hashed.

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
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mcpar.checkpoint.manager import read_meta, saved_layout
from mcpar.checkpoint.saved_state import PLACEMENT_BUFFERS, full_moments, layout_maps, model_shards
from mcpar.config import JobConfig, ModelConfig
from mcpar.interop.full_state import find_checkpoint, load_full_state
from mcpar.models.spec import get_model_spec


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
        if name.rsplit(".", 1)[-1] not in PLACEMENT_BUFFERS:
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
    shards = model_shards(model_saved)
    maps = {c: layout_maps(cfg, layout, c) for c in shards}
    named = list(get_model_spec(cfg.kind).build(cfg, 0).named_parameters())
    found = full_moments(cfg, optim_saved, shards, maps, named, where)
    if found is None:
        return {}
    moments, step = found
    out: dict[str, torch.Tensor] = {}
    for moment, full in moments.items():
        for name, t in full.items():
            out[f"optim/{name}/{moment}"] = t
    step_tensor = torch.tensor(step, dtype=torch.float32)
    for name, _ in named:
        out[f"optim/{name}/step"] = step_tensor
    return out


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
