"""A pipeline schedule's task (``Action``) and the measured costs a schedule may order by
(``ActionCosts``): what the schedule entries (``schedule.py``) produce and the replays
(``schedule_replay.py``) price."""

from __future__ import annotations

from dataclasses import dataclass


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
