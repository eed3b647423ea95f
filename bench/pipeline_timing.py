"""Running and timing one pipeline schedule's steps on mcpar's executor, as the pipeline
benches do (``pipeline_bubble.py``, ``pipeline_trace.py``): the executor's placement as the
ComputeController's plan wires it, the idle fraction of synchronized steps and of steps that
overlap, and the replayed theory each is compared with (the schedule's orders at fixed action
costs)."""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from mcpar.controllers.compute.plan import ComputePlan
from mcpar.controllers.compute.schedules import build_schedule
from mcpar.controllers.memory.measure import MemoryMeter
from mcpar.parallel.pipeline import PipelineExecutor
from mcpar.parallel.tasks import Task
from mcpar.registry.schedule import SCHEDULES, ActionCosts
from mcpar.registry.schedule_replay import critical_path, order_graph, steady_period


def theory(schedule: str, pp: int, m: int, v: int, b_ratio: float = 1.0,
           w_ratio: float = 1.0, costs: ActionCosts | None = None,
           limits: tuple[int, ...] | None = None, latency: float = 0.0) -> float:
    """Mean idle fraction of equal stages whose forward costs 1, B ``b_ratio`` and W
    ``w_ratio`` (an unsplit backward both), messages free (``latency``: each message that many
    forwards): the critical path of the schedule's orders (built at ``costs`` and within
    ``limits`` when given)."""
    entry = SCHEDULES.get(schedule)
    orders = [build_schedule(schedule, r, pp, m, v, costs, limits) for r in range(pp)]
    graph = order_graph(orders, lambda chunk, r: entry.stage_of(chunk, r, pp, v), pp,
                        pp * v - 1, schedule)
    per_kind = {"F": 1 / v, "B": (b_ratio if entry.splits_backward else b_ratio + w_ratio) / v,
                "W": w_ratio / v}
    span = critical_path(graph, lambda r, kind: per_kind[kind], latency)
    return 1 - m * (1 + b_ratio + w_ratio) / span


def overlapped_theory(schedule: str, pp: int, m: int, v: int, b_ratio: float = 1.0,
                      w_ratio: float = 1.0, latency: float = 0.0) -> float:
    """``theory`` of steps that overlap (post-validation: no synchronized optimizer step),
    the schedule's orders for them: the steady period's idle share (``steady_period``)."""
    entry = SCHEDULES.get(schedule)
    orders = [build_schedule(schedule, r, pp, m, v, overlapped=True) for r in range(pp)]
    per_kind = {"F": 1 / v, "B": (b_ratio if entry.splits_backward else b_ratio + w_ratio) / v,
                "W": w_ratio / v}
    period = steady_period(orders, lambda chunk, r: entry.stage_of(chunk, r, pp, v), pp,
                           pp * v - 1, m, lambda r, kind: per_kind[kind], latency)
    return 1 - m * (1 + b_ratio + w_ratio) / period


def splits(schedule: str) -> bool:
    return SCHEDULES.get(schedule).splits_backward


def placement(schedule: str, rank: int, pp: int, m: int, v: int,
              costs: ActionCosts | None = None, limits: tuple[int, ...] | None = None,
              overlapped: bool = False) -> dict:
    """The executor's stage placement and receives on this CPU, as the ComputeController's
    plan gives them."""
    plan = ComputePlan(pp=pp, virtual_stages=v, schedule=schedule, sequence_parallel=False,
                       micro_batch_size=1, num_microbatches=m, global_batch_size=m,
                       stage_cut=(), batch_splitting="fixed", balance=None,  # type: ignore
                       action_costs=costs, held_limits=limits, overlapped_steps=overlapped)
    return plan.executor_wiring(rank, "cpu")


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"pipeline_bubble: {message}", file=sys.stderr, flush=True)


def measure(executor: PipelineExecutor, tasks: list[Task],
            make_batches: Callable[[], tuple[list, list]],
            warmup: int, repeats: int, meter: MemoryMeter | None = None) -> dict:
    """Idle fraction (mean over ranks) of `repeats` steps, each timed from a common barrier;
    with ``meter``, every rank's peak activation bytes of the first timed step (the
    MemoryController's meter, as a training run measures them: what autograd saves, what W's
    store keeps, and the loss's transients)."""
    pp = dist.get_world_size()
    idle, step_s = [], []
    activations: list[int] | None = None
    for n in range(warmup + repeats):
        inputs, targets = make_batches()
        measured = meter is not None and n == warmup
        dist.barrier()
        with meter.step() if measured else contextlib.nullcontext():  # type: ignore[union-attr]
            executor.run(inputs if executor.holds_first_stage else None,
                         targets if executor.holds_last_stage else None, tasks)
        if measured:
            peaks = [None] * pp
            dist.all_gather_object(peaks, meter.activations)  # type: ignore[union-attr]
            activations = [int(p) for p in peaks]  # type: ignore[arg-type]
        stats = executor.last_stats
        step = torch.tensor([stats.total_s], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        rank_idle = torch.tensor([1 - stats.busy_s / step.item()], dtype=torch.float64)
        dist.all_reduce(rank_idle)
        if n >= warmup:
            idle.append(rank_idle.item() / pp)
            step_s.append(step.item())
    out = {"idle_fraction": statistics.fmean(idle), "idle_fraction_per_step": idle,
           "step_time_s_median": statistics.median(step_s),
           "step_time_s_min": min(step_s), "step_time_s_max": max(step_s)}
    if activations is not None:
        out["peak_activation_bytes_per_rank"] = activations
    return out


def measure_overlapped(executor: PipelineExecutor, tasks: list[Task],
                       make_batches: Callable[[], tuple[list, list]], warmup: int,
                       repeats: int) -> dict:
    """Idle fraction (mean over ranks) of steps that overlap, as post-validation runs them:
    one barrier, then ``warmup + repeats`` steps back to back, each rank starting its next
    step as soon as its own is done. A rank's period is the time between the ends of its
    first and last timed steps over ``repeats``; its idle share ``1 - busy / period``, busy
    its mean over the timed steps."""
    pp = dist.get_world_size()
    steps = max(warmup, 1) + repeats  # a step before the first timed one ends the fill
    ends, busy = [], []
    dist.barrier()
    for _ in range(steps):
        inputs, targets = make_batches()
        executor.run(inputs if executor.holds_first_stage else None,
                     targets if executor.holds_last_stage else None, tasks)
        ends.append(time.perf_counter())
        busy.append(executor.last_stats.busy_s)
    period = (ends[-1] - ends[-1 - repeats]) / repeats
    mine = torch.tensor([1 - statistics.fmean(busy[-repeats:]) / period, period],
                        dtype=torch.float64)
    rows: list = [None] * pp
    dist.all_gather_object(rows, mine.tolist())
    return {"idle_fraction": statistics.fmean(r[0] for r in rows),
            "idle_fraction_per_rank": [r[0] for r in rows],
            "period_s_per_rank": [r[1] for r in rows],
            "step_time_s_median": statistics.median(r[1] for r in rows)}
