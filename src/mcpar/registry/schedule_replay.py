"""Pricing a pipeline schedule by replaying its orders: each rank's actions as a task graph
(``order_graph``), its makespan when no rank waits for a core (``critical_path``) or when ranks
share cores (``replay``), and the period of steps that follow one another with nothing
synchronizing them (``steady_period``). The schedule entries' default cost terms
(``PipelineSchedule.span`` and ``period``) and the zero-bubble orders' ranking read them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol

from mcpar.registry.pipeline_action import Action


class PipelineSchedule(Protocol):
    """What a replay reads of a schedule entry (``schedule.PipelineSchedule``): its orders,
    where its chunks sit, and whether it splits the backward. Hashable: the graphs are cached
    per entry."""

    name: str
    splits_backward: bool

    def actions(self, pp_rank: int, pp: int, num_microbatches: int,
                virtual_stages: int) -> list[Action]: ...

    def stage_of(self, chunk: int, pp_rank: int, pp: int, virtual_stages: int) -> int: ...


EPS = 1e-12
# The weight gradients' share of a backward, where the replay prices a split schedule: a linear
# layer's weight gradient costs the FLOPs of its input gradient, and a transformer block's
# backward is its linear layers' to first order (attention's own backward, which has no weight
# part, goes to B; the figure is the even split the zero-bubble schedules are designed for).
WEIGHT_GRAD_SHARE = 0.5


def order_graph(orders: list[list[Action]], stage_of: Callable[[int, int], int], pp: int,
                last: int, name: str) -> tuple[tuple[int, str, int, int], ...]:
    """Every action of the ranks' ``orders`` as (rank, kind, index of the rank's previous action,
    index of the action whose output it waits for), in an order where both come first; -1:
    none. ``stage_of(chunk, rank)`` is the global stage of a rank's chunk, ``last`` the last
    global stage. Raises if the orders deadlock (some rank waits for a task no order reaches)."""
    index: dict[tuple[str, int, int], int] = {}
    graph: list[tuple[int, str, int, int]] = []
    position, previous = [0] * pp, [-1] * pp
    moved = True
    while moved:
        moved = False
        for r in range(pp):
            order = orders[r]
            while position[r] < len(order):
                a = order[position[r]]
                s = stage_of(a.chunk, r)
                if a.kind == "F":
                    dep = ("F", s - 1, a.micro) if s > 0 else None
                elif a.kind == "W":
                    dep = ("B", s, a.micro)
                else:
                    dep = ("B", s + 1, a.micro) if s < last else ("F", s, a.micro)
                if dep is not None and dep not in index:
                    break  # waits for another rank
                index[(a.kind, s, a.micro)] = len(graph)
                graph.append((r, a.kind, previous[r], -1 if dep is None else index[dep]))
                previous[r] = len(graph) - 1
                position[r] += 1
                moved = True
    if any(position[r] < len(orders[r]) for r in range(pp)):
        raise RuntimeError(f"pipeline schedule {name} deadlocks")
    return tuple(graph)


def critical_path(graph: tuple[tuple[int, str, int, int], ...],
                  cost: Callable[[int, str], float], latency: float = 0.0) -> float:
    """Makespan of a task graph (``order_graph``) when no rank waits for a core: each action
    starts once its rank is free and its input has arrived, ``latency`` after the producing
    action ends when that ran on another rank (a message's time on the wire and the receiver's
    wake-up)."""
    finish: list[float] = []
    for r, kind, previous, dep in graph:
        start = finish[previous] if previous >= 0 else 0.0
        if dep >= 0:
            arrives = finish[dep] + (latency if graph[dep][0] != r else 0.0)
            start = max(start, arrives)
        finish.append(start + cost(r, kind))
    return max(finish) if finish else 0.0


# Steps replayed back to back for a steady state's period: the orders built here reach their
# period from the second step on (the span of 3 and of 4 steps grow by the same at p = 4, m = 8).
STEADY_STEPS = 4


def chained_orders(orders: list[list[Action]], num_microbatches: int,
                   steps: int = STEADY_STEPS) -> list[list[Action]]:
    """Each rank's ``orders`` for ``steps`` steps back to back, micro-batch k of step n
    numbered n m + k so that each step's messages pair with its own."""
    m = num_microbatches
    return [[Action(a.kind, a.chunk, a.micro + n * m) for n in range(steps) for a in order]
            for order in orders]


def steady_period(orders: list[list[Action]], stage_of: Callable[[int, int], int], pp: int,
                  last: int, num_microbatches: int, cost: Callable[[int, str], float],
                  latency: float = 0.0, steps: int = STEADY_STEPS) -> float:
    """Seconds per step when steps follow one another with nothing synchronizing them: each
    rank runs its next step's actions right after its own last one, each waiting only for its
    input. Replayed as ``steps`` steps in one graph (micro-batch k of step n numbered
    n m + k, so each step's messages pair with its own), the period is what each step after the
    first adds to the span: the first step's fill is paid once, which a step that ends in a
    synchronized optimizer step pays every time (``critical_path`` of one step)."""
    one = critical_path(order_graph(orders, stage_of, pp, last, "steady"), cost, latency)
    chained = chained_orders(orders, num_microbatches, steps)
    many = critical_path(order_graph(chained, stage_of, pp, last, "steady"), cost, latency)
    return (many - one) / (steps - 1)


# A graph holds 3 m pp v actions: a planner at 1024 GPUs asks for m in the thousands, so only a
# few are kept (512 of them filled 23 GB).
@functools.lru_cache(maxsize=16)
def _task_graph(schedule: PipelineSchedule, pp: int, m: int,
                v: int) -> tuple[tuple[int, str, int, int], ...]:
    """The step's task graph (``order_graph``) of ``schedule``'s orders. Fixed by the
    schedule, whatever the costs: priced once, replayed many times."""
    return order_graph([schedule.actions(r, pp, m, v) for r in range(pp)],
                       lambda chunk, r: schedule.stage_of(chunk, r, pp, v), pp, pp * v - 1,
                       schedule.name)


@functools.lru_cache(maxsize=16)
def _chained_task_graph(schedule: PipelineSchedule, pp: int, m: int,
                        v: int) -> tuple[tuple[int, str, int, int], ...]:
    """The task graph of ``STEADY_STEPS`` steps of ``schedule`` back to back
    (``chained_orders``), cached as ``_task_graph`` is."""
    orders = [schedule.actions(r, pp, m, v) for r in range(pp)]
    return order_graph(chained_orders(orders, m),
                       lambda chunk, r: schedule.stage_of(chunk, r, pp, v), pp, pp * v - 1,
                       schedule.name)


def _action_shares(schedule: PipelineSchedule, fwd_share: float,
                   weight_grad_share: float) -> dict[str, float]:
    """Each kind of action's share of a rank's work on one micro-batch."""
    if schedule.splits_backward:
        return {"F": fwd_share, "B": (1.0 - fwd_share) * (1.0 - weight_grad_share),
                "W": (1.0 - fwd_share) * weight_grad_share}
    return {"F": fwd_share, "B": 1.0 - fwd_share}


def steady_replay(schedule: PipelineSchedule, rank_work: list[float], m: int, v: int,
                  fwd_share: float, weight_grad_share: float = WEIGHT_GRAD_SHARE,
                  latency: float = 0.0) -> float:
    """``steady_period`` of ``schedule``'s orders at ``replay``'s costs (no rank waiting for a
    core): seconds per step of steps that overlap."""
    pp = len(rank_work)
    shares = _action_shares(schedule, fwd_share, weight_grad_share)
    table = [{kind: work * share / v for kind, share in shares.items()} for work in rank_work]

    def cost(r: int, kind: str) -> float:
        return table[r][kind]

    one = critical_path(_task_graph(schedule, pp, m, v), cost, latency)
    many = critical_path(_chained_task_graph(schedule, pp, m, v), cost, latency)
    return (many - one) / (STEADY_STEPS - 1)


def replay(schedule: PipelineSchedule, rank_work: list[float], m: int, v: int,
           fwd_share: float, cores: float = float("inf"), threads_per_rank: float = 1.0,
           weight_grad_share: float = WEIGHT_GRAD_SHARE, latency: float = 0.0) -> float:
    """Makespan of one step of `schedule` as each rank orders its actions, a task starting when
    its input has arrived (the previous stage's forward, the next stage's backward), `latency`
    after the action that produced it ended on another rank: a message's time on a wire that
    the ranks do not drive (the stage executor posts its sends and receives around compute).

    Workers may share CPU cores (more worker threads than cores): then a waiting rank frees its
    core for the others, so the step is neither "every rank at cores / threads speed" (that
    ignores the bubble freeing cores) nor "total work / cores" (that ignores the idle fill and
    drain). The replay is a fluid: the runnable ranks share `cores` equally, each at
    min(1, cores / demand) of full speed, demand counting `threads_per_rank` per runnable rank
    (``cores=inf``: every rank at full speed). A split schedule's W takes ``weight_grad_share``
    of each backward."""
    pp = len(rank_work)
    shares = _action_shares(schedule, fwd_share, weight_grad_share)

    def stage(r: int, a: Action) -> int:
        return schedule.stage_of(a.chunk, r, pp, v)

    def cost(r: int, a: Action) -> float:
        return rank_work[r] * shares[a.kind] / v

    if cores == float("inf"):
        # No rank ever waits for a core: each action starts when its rank is free and its
        # input has arrived, a longest path through the step's task graph.
        table = [{kind: work * share / v for kind, share in shares.items()}
                 for work in rank_work]
        return critical_path(_task_graph(schedule, pp, m, v), lambda r, kind: table[r][kind],
                             latency)

    orders = [schedule.actions(r, pp, m, v) for r in range(pp)]
    last = pp * v - 1

    done: dict[tuple[str, int, int], tuple[float, int]] = {}  # (kind, stage, micro): end, rank
    position = [0] * pp
    remaining = [cost(r, orders[r][0]) if orders[r] else 0.0 for r in range(pp)]

    def inputs(r: int) -> list[tuple[str, int, int]]:
        a = orders[r][position[r]]
        s = stage(r, a)
        if a.kind == "F":
            return [] if s == 0 else [("F", s - 1, a.micro)]
        if a.kind == "W":
            return [("B", s, a.micro)]
        return [("F", s, a.micro)] + ([] if s == last else [("B", s + 1, a.micro)])

    def arrival(r: int) -> float | None:
        """When the next action's inputs are all at rank r; None while one is not produced."""
        at = 0.0
        for key in inputs(r):
            if key not in done:
                return None
            end, producer = done[key]
            at = max(at, end + (latency if producer != r else 0.0))
        return at

    now = 0.0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        arrivals = {r: arrival(r) for r in range(pp) if position[r] < len(orders[r])}
        runnable = [r for r, at in arrivals.items() if at is not None and at <= now + EPS]
        upcoming = [at for at in arrivals.values() if at is not None and at > now + EPS]
        if not runnable:
            if not upcoming:
                raise RuntimeError(f"pipeline schedule {schedule.name} deadlocks")
            now = min(upcoming)  # every rank waits on the wire
            continue
        speed = min(1.0, cores / (threads_per_rank * len(runnable)))
        step = min(remaining[r] for r in runnable) / speed
        if upcoming:  # a message lands meanwhile: its rank joins and the shares change
            step = min(step, min(upcoming) - now)
        now += step
        for r in runnable:
            remaining[r] -= step * speed
            if remaining[r] <= EPS:
                a = orders[r][position[r]]
                done[(a.kind, stage(r, a), a.micro)] = (now, r)
                position[r] += 1
                remaining[r] = (cost(r, orders[r][position[r]])
                                if position[r] < len(orders[r]) else 0.0)
    return now
