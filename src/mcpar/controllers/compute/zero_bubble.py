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

- ``zbv``: two chunks per rank in a V: rank ``i`` holds stages ``i`` and ``2p - 1 - i``, so the
  first and last stages share rank 0, a micro-batch's forward goes down the ranks and back up,
  and its backward the same way in reverse. Each rank's order is a greedy list schedule at
  unit costs (``v_orders``): at each tick a free rank runs a forward whose input has arrived
  (its second chunk's first) while it holds fewer than ``2p`` chunk activations (``p``
  micro-batches of the whole rank: 1F1B's first-rank memory), else a ready B (second chunk
  first), else its oldest pending W. A rank may read a peer's messages in another order than
  the peer sends them (a V's two chunks talk to the same neighbour); the executor then posts
  its receives in the sender's order (``ComputePlan.send_order``), which a backend that
  matches messages by order, not tag (NCCL), needs. Replayed at F = B = W it reaches the
  bound of a V before a synchronized optimizer step, ``3m + (p-1)/2`` unit costs (the last
  rank's fill is half a forward per rank: the chunks are half the work): a bubble of 5.9% at
  p = 4, m = 8.

Deadlock freedom: as for every schedule (``schedules.py``), a task waits only for the task it
depends on; the orders keep each rank's forwards and backwards in micro-batch order, a W after
its own B, and the warm-up of rank ``i`` at least one more than rank ``i + 1``'s, so every
receive's message has been (or will be, without waiting on this rank) sent. The tests replay
every rank's list together.
"""

from __future__ import annotations

import functools
from collections import deque

from mcpar.controllers.compute.pipeline_schedules import one_f_one_b, one_f_one_b_warmup
from mcpar.registry.schedule import SCHEDULES, Action, PipelineSchedule, placed_stage


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


def v_stage(chunk: int, pp_rank: int, pp: int) -> int:
    return placed_stage(chunk, pp_rank, pp, "v")


@functools.lru_cache(maxsize=8)
def v_orders(pp: int, m: int) -> tuple[tuple[Action, ...], ...]:
    """Every rank's ZBV order: the greedy list schedule at unit costs (the module's text)."""
    last, cap = 2 * pp - 1, 2 * pp
    ended: dict[tuple[str, int, int], int] = {}  # (kind, stage, micro) -> tick it ended
    orders: list[list[Action]] = [[] for _ in range(pp)]
    next_f, next_b = [[0, 0] for _ in range(pp)], [[0, 0] for _ in range(pp)]
    pending_w: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
    held = [0] * pp
    tick, left = 0, 6 * m * pp

    def done(key: tuple[str, int, int]) -> bool:
        return ended.get(key, tick + 1) <= tick

    while left:
        for r in range(pp):
            choice: tuple[str, int, int] | None = None
            for chunk in (1, 0):  # forwards first, the second chunk's first
                k, s = next_f[r][chunk], v_stage(chunk, r, pp)
                if k < m and held[r] < cap and (s == 0 or done(("F", s - 1, k))):
                    choice = ("F", chunk, k)
                    break
            if choice is None:
                for chunk in (1, 0):
                    k, s = next_b[r][chunk], v_stage(chunk, r, pp)
                    if k < next_f[r][chunk] and done(("F", s, k)) and (
                            s == last or done(("B", s + 1, k))):
                        choice = ("B", chunk, k)
                        break
            if choice is None and pending_w[r]:
                choice = ("W", *pending_w[r][0])
            if choice is None:
                continue
            kind, chunk, k = choice
            orders[r].append(Action(kind, chunk, k))
            ended[(kind, v_stage(chunk, r, pp), k)] = tick + 1
            left -= 1
            if kind == "F":
                next_f[r][chunk] += 1
                held[r] += 1
            elif kind == "B":
                next_b[r][chunk] += 1
                pending_w[r].append((chunk, k))
            else:
                pending_w[r].popleft()
                held[r] -= 1
        tick += 1
        if tick > 12 * m * pp + 8 * pp:
            raise RuntimeError(f"the ZBV greedy made no progress at pp {pp}, m {m}")
    return tuple(tuple(order) for order in orders)


class ZBV(PipelineSchedule):
    name = "zbv"
    multi_chunk = True
    splits_backward = True
    placement = "v"
    summary = ("zero bubble V: two chunks per rank in a V (rank i: stages i and 2p-1-i), the "
               "backward split; 1F1B's first-rank memory")

    def problem(self, pp: int, m: int, v: int) -> tuple[str, str] | None:
        found = super().problem(pp, m, v)
        if found is None and v != 2:
            found = ("vp", f"schedule zbv places exactly 2 stages per rank (a V), but "
                           f"virtual_stages is {v}; set virtual_stages 2")
        return found

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        return list(v_orders(pp, m)[pp_rank])


for _schedule in (ZBH1(), ZBH2(), ZBV()):
    SCHEDULES.register(_schedule)
