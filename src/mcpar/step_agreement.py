"""What the ranks agree on at the end of each optimizer step, in one collective over the world.

Before the update every rank must know whether any rank saw a non-finite value (the step is then
skipped everywhere) or was asked to stop; the same collective carries the step's figures for the
metrics: the mean loss over the ranks that hold one, the largest peak memory and parameter count,
and when each rank came to wait for its gradient reductions.

That last figure separates two things the wait for the reductions mixes: a reduction cannot end
before the last of its ranks comes, so a rank first waits for its slowest replica, then for the
wire. Each rank times it from its own step start; the previous step's collective lines the
starts up (to the spread of the few operations after it), and only durations are compared, so
it holds across hosts whose clocks differ. A straggler (a slow device, a time-sliced core, a
noisy neighbour) shows as the same rank last step after step; ranks time-sliced on shared cores
as a different rank last each step. (The profile report's straggler section goes further on a
profiled window: each rank's work split by kind, from the task logs.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mcpar.comm.communicator import Communicator


@dataclass
class Straggling:
    """When the ranks of one gradient-reduction group (replicas of one another) came to their
    reductions, seen from one of them."""

    slowest_rank: int  # global rank of the last to come
    spread_s: float  # the last to come after the first
    behind_mean_s: float  # the last after the group's mean: what the step loses to it
    own_wait_s: float  # this rank's wait for the last to come (part of its WAIT_GRADS time)


def straggling_of(came: list[float], group: list[int], rank: int) -> Straggling | None:
    """``Straggling`` of ``group`` seen from ``rank``, from every global rank's seconds from its
    step start to its reductions (``came``); None without replicas."""
    if len(group) < 2:
        return None
    times = {r: came[r] for r in group}
    slowest = max(times, key=times.__getitem__)
    last = times[slowest]
    return Straggling(slowest, last - min(times.values()),
                      last - sum(times.values()) / len(times), last - times[rank])


@dataclass
class StepFigures:
    """One rank's figures of the step, before they are agreed."""

    loss: float | None  # None on a rank without the last pipeline stage
    grad_norm: float
    nonfinite: bool
    peak_mem_bytes: int
    params: int
    stop_requested: bool
    came_to_reductions_s: float  # from this rank's step start


@dataclass
class StepResult:
    loss: float  # mean over the ranks that hold a loss
    grad_norm: float
    peak_mem_bytes: int  # the largest rank's
    max_params_per_rank: int
    stop_requested: bool  # some rank got SIGTERM
    skipped: bool  # non-finite loss or gradients somewhere: no optimizer step
    moe: dict[str, object] | None = None  # routing metrics of a MoE model
    # How far apart this rank's gradient-reduction group came to its reductions
    straggling: Straggling | None = None


def figures_row(mine: StepFigures, stage_norm_sq: float = 0.0) -> torch.Tensor:
    """This rank's row of the step's agreement (``stage_norm_sq``: its stage's sum of squared
    gradients, for a norm agreed after the step: ``mcpar.optim.post_validation``)."""
    return torch.tensor([0.0 if mine.loss is None else mine.loss, float(mine.loss is not None),
                         float(mine.peak_mem_bytes), float(mine.params),
                         float(mine.stop_requested), float(mine.nonfinite),
                         mine.came_to_reductions_s, stage_norm_sq], dtype=torch.float64)


NORM_SQ_COLUMN = 7  # ``figures_row``'s stage sum of squares


def agreed_result(rows: torch.Tensor, grad_norm: float, group: list[int],
                  rank: int) -> StepResult:
    """The ``StepResult`` of every rank's ``figures_row`` (``rows``, in global rank order)."""
    held = rows[:, 1] > 0
    loss = float(rows[held, 0].sum() / held.sum())
    return StepResult(loss, grad_norm, int(rows[:, 2].max()), int(rows[:, 3].max()),
                      bool(rows[:, 4].max() > 0), bool(rows[:, 5].max() > 0),
                      straggling=straggling_of(rows[:, 6].tolist(), group, rank))


def agree_on_step(comm: Communicator, mine: StepFigures, group: list[int],
                  rank: int) -> StepResult:
    """Every rank's ``StepFigures`` gathered over the world; ``group``: this rank's
    gradient-reduction group, whose straggling the result carries."""
    rows = torch.stack(comm.all_gather(figures_row(mine), axis="world"))
    return agreed_result(rows, mine.grad_norm, group, rank)
