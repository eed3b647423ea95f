"""Exchange segments of 1-bit Adam: what one compressed exchange covers.

A segment is a list of ranges of the optimizer's flat momentum, in exchange order (a gradient
bucket's parameters, in the bucket's order), with its own error buffers in each of the
optimizer's two error storages and its runs of equal beta1 (one fused op per run when its local
momentum is formed). The default is one segment over the whole flat buffer.

Each segment also gets, once, the per-parameter views its step reads and writes
(:class:`SegmentViews`): a bucket holds its parameters in reverse order, so each is a range of
its own, and slicing them anew every step is hundreds of Python calls on the step's critical
path. The parameter update itself (:func:`apply_update`) is shared by the warm-up and the
compressed steps.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mcpar.comm.compression import OneBitErrorBuffers, onebit_padded_size

Ranges = list[tuple[int, int]]  # (start, end) in the flat buffers


@dataclass
class Segment:
    ranges: Ranges
    numel: int
    # Its error buffers in each of the two error storages (views).
    errors: tuple[OneBitErrorBuffers, OneBitErrorBuffers]
    # (start, end, beta1) within the segment, one beta1 each.
    beta_runs: list[tuple[int, int, float]]


def plan_segments(segments: Sequence[Ranges], group_betas: Sequence[tuple[int, int, float]],
                  exchange_world: int, intra: int, device: torch.device
                  ) -> tuple[list[Segment], tuple[OneBitErrorBuffers, OneBitErrorBuffers]]:
    """The segments and the two zeroed error storages they are views into (worker errors of
    every segment one after the other, then server errors likewise).

    ``group_betas``: (start, end, beta1) of every parameter group's flat range. ``intra``: ranks
    per node under a hierarchical data axis (each segment's 1/intra shard crosses nodes, so
    its errors are the shard's), else 1.
    """
    sizes = [onebit_padded_size(-(-sum(e - s for s, e in ranges) // intra), exchange_world)
             for ranges in segments]
    storages = tuple(OneBitErrorBuffers(
        worker=torch.zeros(sum(sizes), dtype=torch.float32, device=device),
        server=torch.zeros(sum(sizes) // exchange_world, dtype=torch.float32, device=device))
        for _ in range(2))
    planned = []
    worker_at = server_at = 0
    for ranges, size in zip(segments, sizes, strict=True):
        runs: list[tuple[int, int, float]] = []
        at = 0
        for start, end in ranges:
            for g_start, g_end, beta1 in group_betas:
                lo, hi = max(start, g_start), min(end, g_end)
                if lo >= hi:
                    continue
                a, b = at + lo - start, at + hi - start
                if runs and runs[-1][1] == a and runs[-1][2] == beta1:
                    runs[-1] = (runs[-1][0], b, beta1)
                else:
                    runs.append((a, b, beta1))
            at += end - start
        server_size = size // exchange_world
        errors = tuple(OneBitErrorBuffers(st.worker[worker_at:worker_at + size],
                                          st.server[server_at:server_at + server_size])
                       for st in storages)
        worker_at, server_at = worker_at + size, server_at + server_size
        planned.append(Segment(list(ranges), at, errors, runs))  # type: ignore[arg-type]
    return planned, storages  # type: ignore[return-value]


def bucket_ranges(buckets: Sequence[Sequence[torch.nn.Parameter]],
                  layout: Sequence[tuple[torch.nn.Parameter, int, int]]) -> list[Ranges]:
    """Each bucket's parameters as ranges of the flat layout ((param, offset, numel) entries),
    adjacent ones merged; every parameter of the layout must be in exactly one bucket."""
    where = {id(p): (offset, numel) for p, offset, numel in layout}
    seen: set[int] = set()
    segments = []
    for bucket in buckets:
        ranges: Ranges = []
        for p in bucket:
            if id(p) not in where or id(p) in seen:
                raise ValueError("exchange buckets must hold each of the optimizer's "
                                 "parameters exactly once")
            seen.add(id(p))
            offset, numel = where[id(p)]
            if ranges and ranges[-1][1] == offset:
                ranges[-1] = (ranges[-1][0], offset + numel)
            else:
                ranges.append((offset, offset + numel))
        if ranges:
            segments.append(ranges)
    if len(seen) != len(layout):
        raise ValueError("exchange buckets must hold each of the optimizer's parameters "
                         "exactly once")
    return segments


@dataclass
class SegmentViews:
    """The views a segment's step uses, made once."""

    params: list[torch.nn.Parameter]  # in segment order
    # Per parameter, its place in ``grad``: the segment's gradients, flat in segment order.
    grads: list[torch.Tensor]
    grad: torch.Tensor
    # Runs of consecutive parameters of one group: (group index, params, update views shaped
    # like them; the same views the whole-buffer update makes, so the arithmetic is identical).
    update_runs: list[tuple[int, list[torch.nn.Parameter], list[torch.Tensor]]]


def plan_segment_views(segments: Sequence[Segment],
                       layout: Sequence[tuple[torch.nn.Parameter, int, int]],
                       group_of: dict[int, int], grad_scratch: torch.Tensor,
                       update: torch.Tensor) -> list[SegmentViews]:
    """Views of every segment. ``layout``: (param, flat offset, numel); ``group_of``: id(param)
    -> group index; ``grad_scratch``: a flat buffer the segments' gradients are laid out in,
    one segment after the other; ``update``: the flat update buffer (optimizer order)."""
    at_offset = {offset: (p, numel) for p, offset, numel in layout}
    planned, start = [], 0
    for seg in segments:
        params: list[torch.nn.Parameter] = []
        grads: list[torch.Tensor] = []
        runs: list[tuple[int, list[torch.nn.Parameter], list[torch.Tensor]]] = []
        at = start
        for range_start, range_end in seg.ranges:
            offset = range_start
            while offset < range_end:  # ranges are made of whole parameters
                p, numel = at_offset[offset]
                params.append(p)
                grads.append(grad_scratch[at:at + numel])
                view = update[offset:offset + numel].view_as(p)
                group = group_of[id(p)]
                if not runs or runs[-1][0] != group:
                    runs.append((group, [], []))
                runs[-1][1].append(p)
                runs[-1][2].append(view)
                offset, at = offset + numel, at + numel
        planned.append(SegmentViews(params, grads, grad_scratch[start:at], runs))
        start = at
    return planned


def param_views(flat: torch.Tensor, params: Sequence[torch.nn.Parameter]) -> list[torch.Tensor]:
    """Views of ``flat`` shaped like ``params``, laid out one after the other from its start."""
    views, offset = [], 0
    for p in params:
        views.append(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    return views


def apply_update(group: dict[str, Any], params: list[torch.nn.Parameter],
                 views: list[torch.Tensor]) -> None:
    """x -= lr * (view + wd * x) for some of one group's parameters (the views are consumed).
    Parameter by parameter (torch's foreach ops loop over them on CPU), so updating a group in
    several calls gives the same bits as one."""
    if group["weight_decay"] != 0:
        torch._foreach_add_(views, params, alpha=group["weight_decay"])
    if all(p.dtype == torch.float32 for p in params):
        torch._foreach_add_(params, views, alpha=-group["lr"])
    else:
        for p, view in zip(params, views, strict=True):
            p.add_(view.to(p.dtype), alpha=-group["lr"])


def copy_grads(params: Sequence[torch.nn.Parameter], targets: Sequence[torch.Tensor]) -> None:
    """Each parameter's ``.grad`` into its flat target (a missing gradient counts as zero)."""
    for p, target in zip(params, targets, strict=True):
        if p.grad is None:
            target.zero_()
        elif p.grad.is_sparse:
            raise RuntimeError("OneBitAdam does not support sparse gradients")
        else:
            target.copy_(p.grad.reshape(-1))
