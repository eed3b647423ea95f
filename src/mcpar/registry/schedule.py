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

from mcpar.registry import Registry
from mcpar.registry.pipeline_action import Action, ActionCosts
from mcpar.registry.schedule_replay import replay, steady_replay

__all__ = ["Action", "ActionCosts"]  # the schedules' task types, read from here by the entries

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
             virtual_stages: int, fwd_share: float, latency: float = 0.0) -> float:
        """Seconds from the first forward to the last backward, when pipeline rank r spends
        ``rank_work[r]`` on one micro-batch (all its chunks; ``fwd_share`` of it forward) and a
        message between ranks spends ``latency`` on the wire; ``w_max`` and ``w_sum`` are the
        largest and the sum of ``rank_work`` (``extrapolated`` past the micro-batches a replay
        lists)."""
        return extrapolated(lambda m: replay(self, rank_work, m, virtual_stages, fwd_share,
                                             latency=latency),
                            num_microbatches, len(rank_work), virtual_stages)

    def period(self, num_microbatches: int, rank_work: list[float], virtual_stages: int,
               fwd_share: float, latency: float = 0.0) -> float:
        """Seconds per step when steps follow one another with no synchronized optimizer step
        between them (``steps_overlap``; this entry as ``for_overlapped_steps`` gives it): the
        steady period of its orders (``steady_replay``) at ``span``'s costs (``extrapolated``
        past the micro-batches a replay lists)."""
        return extrapolated(lambda m: steady_replay(self, rank_work, m, virtual_stages, fwd_share,
                                                    latency=latency),
                            num_microbatches, len(rank_work), virtual_stages)

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


def extrapolated(price: Callable[[int], float], num_microbatches: int, pp: int,
                 virtual_stages: int) -> float:
    """``price(m)`` of a replay, for an ``m`` past what a replay lists: past the fill, each more
    micro-batch adds about one steady-state period, measured on the replay's last pp
    micro-batches (a planner may ask for m in the billions; within 2% of a full replay on
    stages 30% apart, tested)."""
    m, cap = num_microbatches, replayed_microbatches(pp, virtual_stages)
    if m <= cap:
        return price(m)
    low, high = price(cap - pp), price(cap)
    return high + (m - cap) * (high - low) / pp


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


def steps_overlap(pp: int, post_validation: bool) -> bool:
    """Whether each pipeline rank starts its next step as soon as its own update is done
    (``optimization.post_validation``, which checks a step's global figures one step later):
    the one rule the compute plan, the memory estimate and the cost model read. Without a
    pipeline there is nothing to overlap."""
    return pp > 1 and post_validation


def schedule_as_run(name: str, limits: tuple[int, ...] | None,
                    overlapped: bool) -> PipelineSchedule:
    """The entry ``name`` as a job runs it: its orders for overlapping steps where they
    overlap (``for_overlapped_steps``), bounded to ``limits`` (``held_within``; None: unbounded).
    The runtime's orders, the memory estimate and the cost model's replay all read this one."""
    entry = SCHEDULES.get(name)
    if overlapped:
        entry = entry.for_overlapped_steps()
    return entry.held_within(limits)


def splits_backward(schedule: str | None, pp: int) -> bool:
    """Whether the job's schedule defers weight gradients to W tasks (no pipeline: never)."""
    return pp > 1 and schedule in SCHEDULES and SCHEDULES.get(schedule).splits_backward
