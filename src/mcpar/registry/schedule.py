"""The contract of a pipeline schedule entry (the built-ins: ``controllers/compute/
pipeline_schedules.py``).

A schedule is a generator of each pipeline rank's ordered actions (forward "F" / backward "B" of
a local chunk for a micro-batch, and, for a schedule that splits the backward, "W": the weight
gradients that chunk's B deferred), its rule for the degrees it runs with, and its cost and
memory terms. The terms have defaults derived from the actions themselves, so a new schedule is
priced by the cost model and held to its in-flight activations by the memory estimate with no
formula of its own: ``span`` replays the actions (``replay``), ``in_flight`` counts the forwards
whose backward (under a split: whose W) has not run yet, and ``head_in_flight`` the
micro-batches whose loss the last stage keeps (from its forward to its B). The built-ins
override them with their closed forms where one exists.

Layout: with ``pp`` ranks and ``v`` chunks per rank the model is cut into ``pp * v`` global
stages, placed by the schedule's ``placement`` (``placed_stage``, the one rule for the runtime,
the checkpoints and the cost model): "round_robin", rank ``r`` holds stages ``r, r + pp, ...``
(its local chunks 0..v-1); "v" (two chunks), rank ``r`` holds stages ``r`` and ``2 pp - 1 - r``.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from mcpar.registry import Registry

EPS = 1e-12
# The weight gradients' share of a backward, where the replay prices a split schedule: a linear
# layer's weight gradient costs the FLOPs of its input gradient, and a transformer block's
# backward is its linear layers' to first order (attention's own backward, which has no weight
# part, goes to B; the figure is the even split the zero-bubble schedules are designed for).
WEIGHT_GRAD_SHARE = 0.5


PLACEMENTS = ("round_robin", "v")


def placed_stage(chunk: int, pp_rank: int, pp: int, placement: str = "round_robin") -> int:
    """The global stage of local chunk ``chunk`` of pipeline rank ``pp_rank``."""
    if placement == "v":
        if chunk not in (0, 1):
            raise ValueError(f"the V placement has 2 chunks per rank, not chunk {chunk}")
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    if placement != "round_robin":
        raise ValueError(f"unknown stage placement {placement!r}; one of {PLACEMENTS}")
    return chunk * pp + pp_rank


def stage_rank(stage: int, pp: int, placement: str = "round_robin") -> int:
    """The pipeline rank holding global stage ``stage`` (the inverse of ``placed_stage``)."""
    if placement == "v":
        return stage if stage < pp else 2 * pp - 1 - stage
    if placement != "round_robin":
        raise ValueError(f"unknown stage placement {placement!r}; one of {PLACEMENTS}")
    return stage % pp


def schedule_placement(schedule: str | None) -> str:
    """How ``schedule`` places a rank's stages (round robin where it names none: the default
    schedules)."""
    return SCHEDULES.get(schedule).placement if schedule else "round_robin"
@dataclass(frozen=True)
class Action:
    """One task of a rank's schedule: the forward ("F"), the backward ("B") of a chunk, or the
    weight gradients ("W") its backward deferred (a schedule that splits the backward)."""

    kind: str  # "F", "B" or "W"
    chunk: int  # local chunk index on this rank, 0..virtual_stages-1
    micro: int  # micro-batch index


@dataclass(frozen=True)
class ActionCosts:
    """Measured seconds of one chunk's actions on each pipeline rank, ``per_rank[r]`` =
    (forward, B, W) (an unsplit backward is B + W), and of a message between two ranks (its
    time on the wire and the receiver's wake-up). A schedule that follows measured costs
    (``PipelineSchedule.costed_actions``) builds its order from them."""

    per_rank: tuple[tuple[float, float, float], ...]
    latency: float = 0.0

    @classmethod
    def uniform(cls, pp: int, forward: float, backward_input: float, weight: float,
                latency: float = 0.0) -> ActionCosts:
        return cls(((forward, backward_input, weight),) * pp, latency)

    def of(self, rank: int, kind: str) -> float:
        return self.per_rank[rank]["FBW".index(kind)]


class PipelineSchedule(ABC):
    """A pipeline schedule. Subclasses set ``name``, ``multi_chunk`` and ``actions``."""

    name: str = ""
    multi_chunk: bool = False  # runs several chunks per rank (virtual_stages >= 2)
    # B computes only the input's gradient (and the parameters outside linear layers'); the
    # linear layers' weight gradients wait for the chunk's W action.
    splits_backward: bool = False
    placement: str = "round_robin"  # where its chunks' stages sit (``placed_stage``)
    summary: str = ""  # one line for `mcpar check` and the docs
    # Orders itself within a per-rank bound on the chunk activations it holds
    # (``limited_actions``): the MemoryController holds a split schedule to 1F1B's peak.
    takes_held_limits: bool = False

    def problem(self, pp: int, num_microbatches: int,
                virtual_stages: int) -> tuple[str, str] | None:
        """None if the schedule runs with these degrees, else (the layout field at fault: 'pp',
        'vp', 'schedule' or 'gradient_accumulation'; one line with the fix)."""
        if pp < 1:
            return "pp", f"pipeline degree must be at least 1, got {pp}"
        if num_microbatches < 1:
            return ("gradient_accumulation",
                    f"a pipeline step needs at least 1 micro-batch, got {num_microbatches}")
        if virtual_stages < 1:
            return "vp", f"virtual_stages must be at least 1, got {virtual_stages}"
        if not self.multi_chunk and virtual_stages != 1:
            multi = [s.name for s in SCHEDULES if s.multi_chunk]
            # Named on the schedule: chunks per rank ask for a schedule that runs them.
            return "schedule", (f"schedule {self.name} runs one stage per rank, but "
                                f"virtual_stages is {virtual_stages}; use virtual_stages 1"
                                + (f" or schedule {' / '.join(multi)}" if multi else ""))
        if self.multi_chunk and virtual_stages < 2:
            return "vp", (f"schedule {self.name} needs virtual_stages >= 2 (stages per rank); "
                          "set virtual_stages or use schedule 1f1b")
        if self.multi_chunk and pp < 2:
            return "pp", f"schedule {self.name} needs a pipeline of at least 2 ranks; use 1f1b"
        return None

    def stage_of(self, chunk: int, pp_rank: int, pp: int, virtual_stages: int) -> int:
        """The global stage that local chunk ``chunk`` of pipeline rank ``pp_rank`` holds."""
        return placed_stage(chunk, pp_rank, pp, self.placement)

    @abstractmethod
    def actions(self, pp_rank: int, pp: int, num_microbatches: int,
                virtual_stages: int) -> list[Action]:
        """Rank `pp_rank`'s ordered actions for one step (every schedule defines its own)."""

    def costed_actions(self, pp_rank: int, pp: int, num_microbatches: int,
                       virtual_stages: int, costs: ActionCosts) -> list[Action]:
        """The rank's actions when each action's measured cost is known (``costs``); a
        schedule whose order does not depend on them returns ``actions``."""
        return self.actions(pp_rank, pp, num_microbatches, virtual_stages)

    def limited_actions(self, pp_rank: int, pp: int, num_microbatches: int,
                        virtual_stages: int, limits: tuple[int, ...],
                        costs: ActionCosts | None) -> list[Action]:
        """The rank's actions (at ``costs`` where given) holding at most ``limits[r]`` chunk
        activations on rank ``r`` (counted until W under a split), where an order of the
        schedule does; a schedule with ``takes_held_limits`` defines it."""
        raise ValueError(f"schedule {self.name} takes no limit on what a rank holds")

    def for_overlapped_steps(self) -> PipelineSchedule:
        """This schedule with its orders chosen for steps that follow one another with no
        synchronized optimizer step between them (``optimization.post_validation``): each rank
        starts its next step as soon as its own last action is done, so what counts is the
        steady state's period (``steady_period``), not one step's span. The default: the same
        orders (a schedule whose order does not change with that)."""
        return self

    def held_within(self, limits: tuple[int, ...] | None) -> PipelineSchedule:
        """This schedule bounded to ``limits`` (``limited_actions``), itself without one."""
        if limits is None:
            return self
        if not self.takes_held_limits:
            raise ValueError(f"schedule {self.name} takes no limit on what a rank holds")
        return HeldWithin(self, tuple(limits))

    def checked_actions(self, pp_rank: int, pp: int, num_microbatches: int,
                        virtual_stages: int = 1,
                        costs: ActionCosts | None = None) -> list[Action]:
        """``actions`` (``costed_actions`` with ``costs``), after the schedule's rule and the
        rank's range are checked."""
        found = self.problem(pp, num_microbatches, virtual_stages)
        if found is not None:
            raise ValueError(found[1])
        if not 0 <= pp_rank < pp:
            raise ValueError(f"pp_rank {pp_rank} is outside the pipeline of {pp} ranks")
        if costs is not None:
            if len(costs.per_rank) != pp:
                raise ValueError(f"measured costs of {len(costs.per_rank)} ranks for a "
                                 f"pipeline of {pp}")
            return self.costed_actions(pp_rank, pp, num_microbatches, virtual_stages, costs)
        return self.actions(pp_rank, pp, num_microbatches, virtual_stages)

    def span(self, num_microbatches: int, w_max: float, w_sum: float, rank_work: list[float],
             virtual_stages: int, fwd_share: float) -> float:
        """Seconds from the first forward to the last backward, when pipeline rank r spends
        ``rank_work[r]`` on one micro-batch (all its chunks; ``fwd_share`` of it forward);
        ``w_max`` and ``w_sum`` are the largest and the sum of ``rank_work``."""
        m, cap = num_microbatches, replayed_microbatches(len(rank_work), virtual_stages)
        if m <= cap:
            return replay(self, rank_work, m, virtual_stages, fwd_share)
        # Past the fill, each more micro-batch adds about one steady-state period, measured
        # on the replay's last pp micro-batches (a planner may ask for m in the billions,
        # which no replay can list; within 2% of a full replay on stages 30% apart, tested).
        pp = len(rank_work)
        low = replay(self, rank_work, cap - pp, virtual_stages, fwd_share)
        high = replay(self, rank_work, cap, virtual_stages, fwd_share)
        return high + (m - cap) * (high - low) / pp

    def in_flight(self, pp: int, pp_rank: int, num_microbatches: int,
                  virtual_stages: int) -> float:
        """Micro-batches of the rank's layers whose activations are held at its peak."""
        # The peak is reached within the first micro-batches of a schedule that bounds what it
        # holds (every built-in but GPipe, which has its own): counted there for a large m.
        m = min(num_microbatches, replayed_microbatches(pp, virtual_stages))
        return _peak_in_flight(self, pp, pp_rank, m, virtual_stages)


    def head_in_flight(self, pp: int, num_microbatches: int, virtual_stages: int) -> int:
        """Micro-batches whose loss the rank of the last stage holds at once: from the last
        stage's forward to its backward (the head keeps its whole backward in B under a split,
        so W does not hold it). Counted from that rank's actions."""
        m = min(num_microbatches, replayed_microbatches(pp, virtual_stages))
        return _peak_head_in_flight(self, pp, m, virtual_stages)


class HeldWithin(PipelineSchedule):
    """A schedule that takes held limits, bounded to ``limits`` (``held_within``): the same
    entry to every reader (name, placement, rules), its orders ``limited_actions``'. Equal and
    hashed by both, so the replays' caches keep each bound apart."""

    def __init__(self, base: PipelineSchedule, limits: tuple[int, ...]) -> None:
        self.base, self.limits = base, limits
        self.name, self.summary = base.name, base.summary
        self.multi_chunk, self.splits_backward = base.multi_chunk, base.splits_backward
        self.placement, self.takes_held_limits = base.placement, True

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, HeldWithin) and other.base is self.base
                and other.limits == self.limits)

    def __hash__(self) -> int:
        return hash((id(self.base), self.limits))

    def __repr__(self) -> str:
        return f"{self.name} holding at most {list(self.limits)}"

    def problem(self, pp: int, num_microbatches: int,
                virtual_stages: int) -> tuple[str, str] | None:
        found = self.base.problem(pp, num_microbatches, virtual_stages)
        if found is None and len(self.limits) != pp:
            found = ("pp", f"held limits of {len(self.limits)} ranks for a pipeline of {pp}")
        return found

    def actions(self, pp_rank: int, pp: int, num_microbatches: int,
                virtual_stages: int) -> list[Action]:
        return self.base.limited_actions(pp_rank, pp, num_microbatches, virtual_stages,
                                         self.limits, None)

    def costed_actions(self, pp_rank: int, pp: int, num_microbatches: int,
                       virtual_stages: int, costs: ActionCosts) -> list[Action]:
        return self.base.limited_actions(pp_rank, pp, num_microbatches, virtual_stages,
                                         self.limits, costs)

    def held_within(self, limits: tuple[int, ...] | None) -> PipelineSchedule:
        return self.base.held_within(limits)


@functools.lru_cache(maxsize=4096)
def _peak_head_in_flight(schedule: PipelineSchedule, pp: int, m: int, v: int) -> int:
    last = pp * v - 1
    rank = stage_rank(last, pp, schedule.placement)
    held = peak = 0
    for a in schedule.actions(rank, pp, m, v):
        if schedule.stage_of(a.chunk, rank, pp, v) == last and a.kind in "FB":
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
    return peak


@functools.lru_cache(maxsize=4096)
def _peak_in_flight(schedule: PipelineSchedule, pp: int, pp_rank: int, m: int, v: int) -> float:
    """The default ``in_flight``, counted from the actions (the planner asks it for thousands
    of layouts with the same few degrees)."""
    # Under a split, W's inputs (the linear layers' inputs and output gradients) are held
    # until W: the activations are counted as held until then.
    freed_by = "W" if schedule.splits_backward else "B"
    held = peak = 0
    for a in schedule.actions(pp_rank, pp, m, v):
        held += 1 if a.kind == "F" else -1 if a.kind == freed_by else 0
        peak = max(peak, held)
    return peak / v


def replayed_microbatches(pp: int, virtual_stages: int) -> int:
    """The most micro-batches the default terms replay (a multiple of pp, past every built-in
    schedule's fill and warm-up)."""
    return pp * max(8, 4 * virtual_stages + 4)


SCHEDULES: Registry[PipelineSchedule] = Registry("pipeline schedule", "parallelism.schedule")
# What runs when nothing names a schedule: one chunk per rank, or several (interleaved).
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_MULTI_CHUNK_SCHEDULE = "interleaved_1f1b"


def default_schedule(virtual_stages: int) -> str:
    return DEFAULT_MULTI_CHUNK_SCHEDULE if virtual_stages > 1 else DEFAULT_SCHEDULE


def splits_backward(schedule: str | None, pp: int) -> bool:
    """Whether the job's schedule defers weight gradients to W tasks (no pipeline: never)."""
    return pp > 1 and schedule in SCHEDULES and SCHEDULES.get(schedule).splits_backward


# A graph holds 3 m pp v actions: a planner at 1024 GPUs asks for m in the thousands, so only a
# few are kept (512 of them filled 23 GB).
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


def steady_period(orders: list[list[Action]], stage_of: Callable[[int, int], int], pp: int,
                  last: int, num_microbatches: int, cost: Callable[[int, str], float],
                  latency: float = 0.0, steps: int = STEADY_STEPS) -> float:
    """Seconds per step when steps follow one another with nothing synchronizing them: each
    rank runs its next step's actions right after its own last one, each waiting only for its
    input. Replayed as ``steps`` steps in one graph (micro-batch k of step n numbered
    n m + k, so each step's messages pair with its own), the period is what each step after the
    first adds to the span: the first step's fill is paid once, which a step that ends in a
    synchronized optimizer step pays every time (``critical_path`` of one step)."""
    m = num_microbatches
    one = critical_path(order_graph(orders, stage_of, pp, last, "steady"), cost, latency)
    chained = [[Action(a.kind, a.chunk, a.micro + n * m) for n in range(steps) for a in order]
               for order in orders]
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


def replay(schedule: PipelineSchedule, rank_work: list[float], m: int, v: int,
           fwd_share: float, cores: float = float("inf"), threads_per_rank: float = 1.0,
           weight_grad_share: float = WEIGHT_GRAD_SHARE) -> float:
    """Makespan of one step of `schedule` as each rank orders its actions, a task starting when
    its input has arrived (the previous stage's forward, the next stage's backward).

    Workers may share CPU cores (more worker threads than cores): then a waiting rank frees its
    core for the others, so the step is neither "every rank at cores / threads speed" (that
    ignores the bubble freeing cores) nor "total work / cores" (that ignores the idle fill and
    drain). The replay is a fluid: the runnable ranks share `cores` equally, each at
    min(1, cores / demand) of full speed, demand counting `threads_per_rank` per runnable rank
    (``cores=inf``: every rank at full speed). A split schedule's W takes ``weight_grad_share``
    of each backward."""
    pp = len(rank_work)
    shares = {"F": fwd_share, "B": 1.0 - fwd_share}
    if schedule.splits_backward:
        shares = {"F": fwd_share, "B": (1.0 - fwd_share) * (1.0 - weight_grad_share),
                  "W": (1.0 - fwd_share) * weight_grad_share}

    def stage(r: int, a: Action) -> int:
        return schedule.stage_of(a.chunk, r, pp, v)

    def cost(r: int, a: Action) -> float:
        return rank_work[r] * shares[a.kind] / v

    if cores == float("inf"):
        # No rank ever waits for a core: each action starts when its rank is free and its
        # input has arrived, a longest path through the step's task graph.
        table = [{kind: work * share / v for kind, share in shares.items()}
                 for work in rank_work]
        return critical_path(_task_graph(schedule, pp, m, v), lambda r, kind: table[r][kind])

    orders = [schedule.actions(r, pp, m, v) for r in range(pp)]
    last = pp * v - 1

    done: set[tuple[str, int, int]] = set()  # (kind, global stage, micro)
    position = [0] * pp
    remaining = [cost(r, orders[r][0]) if orders[r] else 0.0 for r in range(pp)]

    def ready(r: int) -> bool:
        if position[r] >= len(orders[r]):
            return False
        a = orders[r][position[r]]
        s = stage(r, a)
        if a.kind == "F":
            return s == 0 or ("F", s - 1, a.micro) in done
        if a.kind == "W":
            return ("B", s, a.micro) in done
        return ("F", s, a.micro) in done and (s == last or ("B", s + 1, a.micro) in done)

    now = 0.0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        runnable = [r for r in range(pp) if ready(r)]
        if not runnable:
            raise RuntimeError(f"pipeline schedule {schedule.name} deadlocks")
        speed = min(1.0, cores / (threads_per_rank * len(runnable)))
        step = min(remaining[r] for r in runnable) / speed
        now += step
        for r in runnable:
            remaining[r] -= step * speed
            if remaining[r] <= EPS:
                a = orders[r][position[r]]
                done.add((a.kind, stage(r, a), a.micro))
                position[r] += 1
                remaining[r] = (cost(r, orders[r][position[r]])
                                if position[r] < len(orders[r]) else 0.0)
    return now
