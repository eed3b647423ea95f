"""The contract of a pipeline schedule entry (the built-ins: ``controllers/compute/
pipeline_schedules.py``).

A schedule is a generator of each pipeline rank's ordered actions (forward "F" / backward "B" of
a local chunk for a micro-batch), its rule for the degrees it runs with, and its cost and memory
terms. The terms have defaults derived from the actions themselves, so a new schedule is priced
by the cost model and held to its in-flight activations by the memory estimate with no formula
of its own: ``span`` replays the actions (``replay``), ``in_flight`` counts the forwards whose
backward has not run yet. The built-ins override them with their closed forms.

Layout: with ``pp`` ranks and ``v`` chunks per rank the model is cut into ``pp * v`` global
stages; rank ``r`` holds stages ``r, r + pp, ...`` (its local chunks 0..v-1).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from mcpar.registry import Registry

EPS = 1e-12


@dataclass(frozen=True)
class Action:
    """One task of a rank's schedule: the forward ("F") or backward ("B") of a chunk."""

    kind: str  # "F" or "B"
    chunk: int  # local chunk index on this rank, 0..virtual_stages-1
    micro: int  # micro-batch index


class PipelineSchedule(ABC):
    """A pipeline schedule. Subclasses set ``name``, ``multi_chunk`` and ``actions``."""

    name: str = ""
    multi_chunk: bool = False  # runs several chunks per rank (virtual_stages >= 2)
    summary: str = ""  # one line for `mcpar check` and the docs

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

    @abstractmethod
    def actions(self, pp_rank: int, pp: int, num_microbatches: int,
                virtual_stages: int) -> list[Action]:
        """Rank `pp_rank`'s ordered actions for one step (every schedule defines its own)."""

    def checked_actions(self, pp_rank: int, pp: int, num_microbatches: int,
                        virtual_stages: int = 1) -> list[Action]:
        """``actions``, after the schedule's rule and the rank's range are checked."""
        found = self.problem(pp, num_microbatches, virtual_stages)
        if found is not None:
            raise ValueError(found[1])
        if not 0 <= pp_rank < pp:
            raise ValueError(f"pp_rank {pp_rank} is outside the pipeline of {pp} ranks")
        return self.actions(pp_rank, pp, num_microbatches, virtual_stages)

    def span(self, num_microbatches: int, w_max: float, w_sum: float, rank_work: list[float],
             virtual_stages: int, fwd_share: float) -> float:
        """Seconds from the first forward to the last backward, when pipeline rank r spends
        ``rank_work[r]`` on one micro-batch (all its chunks; ``fwd_share`` of it forward);
        ``w_max`` and ``w_sum`` are the largest and the sum of ``rank_work``."""
        return replay(self, rank_work, num_microbatches, virtual_stages, fwd_share)

    def in_flight(self, pp: int, pp_rank: int, num_microbatches: int,
                  virtual_stages: int) -> float:
        """Micro-batches of the rank's layers whose activations are held at its peak."""
        held = peak = 0
        for a in self.actions(pp_rank, pp, num_microbatches, virtual_stages):
            held += 1 if a.kind == "F" else -1
            peak = max(peak, held)
        return peak / virtual_stages


SCHEDULES: Registry[PipelineSchedule] = Registry("pipeline schedule", "parallelism.schedule")
# What runs when nothing names a schedule: one chunk per rank, or several (interleaved).
DEFAULT_SCHEDULE = "1f1b"
DEFAULT_MULTI_CHUNK_SCHEDULE = "interleaved_1f1b"


def default_schedule(virtual_stages: int) -> str:
    return DEFAULT_MULTI_CHUNK_SCHEDULE if virtual_stages > 1 else DEFAULT_SCHEDULE


def replay(schedule: PipelineSchedule, rank_work: list[float], m: int, v: int,
           fwd_share: float, cores: float = float("inf"), threads_per_rank: float = 1.0) -> float:
    """Makespan of one step of `schedule` as each rank orders its actions, a task starting when
    its input has arrived (the previous stage's forward, the next stage's backward).

    Workers may share CPU cores (more worker threads than cores): then a waiting rank frees its
    core for the others, so the step is neither "every rank at cores / threads speed" (that
    ignores the bubble freeing cores) nor "total work / cores" (that ignores the idle fill and
    drain). The replay is a fluid: the runnable ranks share `cores` equally, each at
    min(1, cores / demand) of full speed, demand counting `threads_per_rank` per runnable rank
    (``cores=inf``: every rank at full speed)."""
    pp = len(rank_work)
    orders = [schedule.actions(r, pp, m, v) for r in range(pp)]
    last = pp * v - 1

    def cost(r: int, a: Action) -> float:
        share = fwd_share if a.kind == "F" else 1.0 - fwd_share
        return rank_work[r] * share / v

    done: set[tuple[str, int, int]] = set()  # (kind, global stage, micro)
    position = [0] * pp
    remaining = [cost(r, orders[r][0]) if orders[r] else 0.0 for r in range(pp)]

    def ready(r: int) -> bool:
        if position[r] >= len(orders[r]):
            return False
        a = orders[r][position[r]]
        stage = a.chunk * pp + r
        if a.kind == "F":
            return stage == 0 or ("F", stage - 1, a.micro) in done
        return ("F", stage, a.micro) in done and (
            stage == last or ("B", stage + 1, a.micro) in done)

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
                done.add((a.kind, a.chunk * pp + r, a.micro))
                position[r] += 1
                remaining[r] = (cost(r, orders[r][position[r]])
                                if position[r] < len(orders[r]) else 0.0)
    return now
