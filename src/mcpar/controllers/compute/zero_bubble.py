"""The zero-bubble pipeline schedules (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024),
registered by name (the contract: ``mcpar.registry.schedule``).

Each backward is split in two (``mcpar.parallel.weight_grad``): B computes the gradient of the
stage's input, which the previous stage waits for, and W the weight gradients of the stage's
linear layers, which nobody waits for. The W's are what fills the bubble: a rank that would
idle while a gradient travels back runs a pending W instead.

- ``zb_h1``: 1F1B's forwards and B's, in 1F1B's order; rank ``i`` runs each W ``i`` backwards
  late, and its last ``i`` W's in the drain, where 1F1B idles. With F = B = W the step lasts
  ``3m + p - 1`` unit costs, a bubble of ``(p-1)/(3m+p-1)`` (1F1B's is ``(p-1)/(m+p-1)`` with
  the same units), i.e. a third of 1F1B's at large m. Activations: counted held until W, rank
  ``i`` holds ``min(p, m)`` micro-batches at its peak, the peak of 1F1B's first rank.
- ``zb_h2``: more warm-up forwards (``2(p - i) - 2`` on rank ``i``, up to ``2p - 1`` micro-batches
  held on the first rank) and each W ``2i`` backwards late, so a rank has W's in hand to fill
  the waits that a backward costlier than its W opens. With a step that ends at a synchronized
  optimizer step, no schedule of one chunk per rank hides the warm-up fill ``(p-1) F`` of the
  last rank, so the step is at least ``(p-1) F + m (F + B + W)``: at F = B = W both schedules
  reach it; with B = 1.4 F and W = 0.6 F (replayed at p = 4, m = 8 and p = 8, m = 16) ZB-H1 is
  8.9-10.2% above it and ZB-H2 2.2-2.5%.

Deadlock freedom: as for every schedule (``schedules.py``), a task waits only for the task it
depends on; the orders keep each rank's forwards and backwards in micro-batch order, a W after
its own B, and the warm-up of rank ``i`` at least one more than rank ``i + 1``'s, so every
receive's message has been (or will be, without waiting on this rank) sent. The tests replay
every rank's list together.
"""

from __future__ import annotations

from mcpar.controllers.compute.pipeline_schedules import one_f_one_b, one_f_one_b_warmup
from mcpar.registry.schedule import SCHEDULES, Action, PipelineSchedule


def with_weight_grads(order: list[Action], lag: int) -> list[Action]:
    """``order`` (forwards and backwards) with the W of the k-th backward right after the
    (k + lag)-th backward, and the W's left over at the end, oldest first."""
    backwards = [a for a in order if a.kind == "B"]
    out: list[Action] = []
    seen = 0
    for action in order:
        out.append(action)
        if action.kind == "B":
            if seen >= lag:
                b = backwards[seen - lag]
                out.append(Action("W", b.chunk, b.micro))
            seen += 1
    out += [Action("W", b.chunk, b.micro) for b in backwards[max(seen - lag, 0):]]
    return out


class _ZeroBubble(PipelineSchedule):
    """One chunk per rank, 1F1B's pairs of forward and B, the W's placed by ``lag``."""

    splits_backward = True

    def warmup(self, pp_rank: int, pp: int, m: int) -> int:
        raise NotImplementedError

    def lag(self, pp_rank: int, pp: int, m: int) -> int:
        raise NotImplementedError

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        order = one_f_one_b([Action("F", 0, k) for k in range(m)],
                            [Action("B", 0, k) for k in range(m)], self.warmup(pp_rank, pp, m))
        return with_weight_grads(order, self.lag(pp_rank, pp, m))


class ZBH1(_ZeroBubble):
    name = "zb_h1"
    summary = ("zero bubble H1: 1F1B with the backward split, the weight gradients fill the "
               "bubble; 1F1B's first-rank memory")

    def warmup(self, pp_rank: int, pp: int, m: int) -> int:
        return one_f_one_b_warmup(pp_rank, pp, m)

    def lag(self, pp_rank: int, pp: int, m: int) -> int:
        # Rank i's drain is i backwards long in 1F1B: that many W's wait for it.
        return min(pp_rank, m)


class ZBH2(_ZeroBubble):
    name = "zb_h2"
    summary = ("zero bubble H2: the backward split, about twice 1F1B's warm-up and W's held "
               "back to fill the waits; up to 2p - 1 micro-batches held")

    def warmup(self, pp_rank: int, pp: int, m: int) -> int:
        return min(2 * (pp - pp_rank) - 2, m)

    def lag(self, pp_rank: int, pp: int, m: int) -> int:
        return min(2 * pp_rank, m)


for _schedule in (ZBH1(), ZBH2()):
    SCHEDULES.register(_schedule)
