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
  ``i`` holds ``min(p, m)`` micro-batches at its peak, the peak of 1F1B's first rank; the last
  rank holds the head's input and loss beside them (1.06x 1F1B's peak on the bubble bench's
  GPT at p = 4, m 8). A lag of ``p - 2`` there would hold ``p - 1`` but replays one unit
  longer (28 against 27 at p = 4, m = 8). Its critical path crosses ``4(p - 1)`` messages
  (a micro-batch's forward and backward across the ranks twice: the first rank's first
  backward, then the forward it lets the first rank start; ZB-H2's crosses ``p - 1``, ZBV's
  ``3(p - 1)``), so a message's cost weighs on it most: at p = 4, m = 8 it replays
  ``27 + 12 x`` units with ``x`` a forward per message, and a search that moved each rank's
  actions (adjacent swaps and short moves, annealed, 4 restarts) found no order holding at most
  ``p`` micro-batches that replays shorter at ``x`` = 0.035.
- ``zb_h2``: more warm-up forwards (``2(p - i) - 2`` on rank ``i``, up to ``2p - 1`` micro-batches
  held on the first rank) and each W ``2i`` backwards late, so a rank has W's in hand to fill
  the waits that a backward costlier than its W opens. With a step that ends at a synchronized
  optimizer step, no schedule of one chunk per rank hides the warm-up fill ``(p-1) F`` of the
  last rank, so the step is at least ``(p-1) F + m (F + B + W)``: at F = B = W both schedules
  reach it; with B = 1.4 F and W = 0.6 F (replayed at p = 4, m = 8 and p = 8, m = 16) ZB-H1 is
  8.9-10.2% above it and ZB-H2 2.2-2.5%.

- ``zbv``: two chunks per rank in a V (``zero_bubble_v.py``).
- ZB-H2 with measured costs: its orders and the same fill of its W's at the costs, the
  shorter kept (``costed_orders``).

Deadlock freedom: as for every schedule (``schedules.py``), a task waits only for the task it
depends on; the orders keep each rank's forwards and backwards in micro-batch order, a W after
its own B, and the warm-up of rank ``i`` at least one more than rank ``i + 1``'s, so every
receive's message has been (or will be, without waiting on this rank) sent. The tests replay
every rank's list together.
"""

from __future__ import annotations

import functools
from abc import abstractmethod
from collections import deque
from collections.abc import Callable

from mcpar.controllers.compute.pipeline_schedules import one_f_one_b, one_f_one_b_warmup
from mcpar.registry.schedule import SCHEDULES, Action, ActionCosts, PipelineSchedule
from mcpar.registry.schedule_replay import EPS, critical_path, order_graph


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


StageOf = Callable[[int, int], int]  # (local chunk, rank) -> global stage
Orders = tuple[tuple[Action, ...], ...]  # every rank's actions
# A W fills a wait only where the wait is at least this share of the W (0: any wait): the
# candidates tried, each replayed at the measured costs, the shortest kept.
FILL_THRESHOLDS = (0.0, 0.5, 1.0)


def fill_weight_grads(skeletons: list[list[Action]], pp: int, stage_of: StageOf,
                      costs: ActionCosts, caps: list[int],
                      threshold: float = 0.0) -> Orders:
    """Every rank's order: its forwards and B's in the order of ``skeletons[rank]``, and its W's
    where the measured ``costs`` say the rank would otherwise wait: a list schedule in time,
    each rank at its free time runs its next forward or B if that task's input has arrived,
    else its oldest pending W (when the wait is at least ``threshold`` of that W, or not known
    yet because the producer is still busy), and runs a W first where a forward would hold
    more than ``caps[rank]`` micro-batches (counted until W). The W's left run at the end."""
    chunks = 1 + max((a.chunk for o in skeletons for a in o), default=0)
    last = pp * chunks - 1
    rank_of = {stage_of(c, r): r for r in range(pp) for c in range(chunks)}
    ended: dict[tuple[str, int, int], float] = {}
    free, position, held = [0.0] * pp, [0] * pp, [0] * pp
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
    out: list[list[Action]] = [[] for _ in range(pp)]

    def run(r: int, a: Action, start: float) -> None:
        free[r] = start + costs.of(r, a.kind)
        out[r].append(a)
        ended[(a.kind, stage_of(a.chunk, r), a.micro)] = free[r]

    def arrival(r: int, a: Action) -> tuple[float | None, int]:
        """(when ``a``'s input is in, or None while it is not produced; the producing rank)."""
        s = stage_of(a.chunk, r)
        if a.kind == "F":
            if s == 0:
                return 0.0, r
            key = ("F", s - 1, a.micro)
        else:
            if s == last:
                return ended[("F", s, a.micro)], r
            key = ("B", s + 1, a.micro)
        src = rank_of[key[1]]
        if key not in ended:
            return None, src
        return ended[key] + (costs.latency if src != r else 0.0), src

    while any(position[r] < len(skeletons[r]) for r in range(pp)):
        for r in sorted(range(pp), key=lambda rank: free[rank]):
            if position[r] >= len(skeletons[r]):
                continue
            a = skeletons[r][position[r]]
            at, src = arrival(r, a)
            if at is None and free[src] <= free[r] + EPS:
                continue  # its producer may still deliver by now: decide after it
            full = a.kind == "F" and held[r] >= caps[r]
            if pending[r] and (full or at is None or at > free[r] + threshold
                               * costs.of(r, "W") + EPS):
                chunk, micro = pending[r].popleft()
                held[r] -= 1
                run(r, Action("W", chunk, micro), free[r])
                break
            if at is None or full:
                continue
            run(r, a, max(at, free[r]))
            position[r] += 1
            if a.kind == "F":
                held[r] += 1
            else:
                pending[r].append((a.chunk, a.micro))
            break
        else:
            raise RuntimeError("the weight-gradient fill found no rank able to run")
    for r in range(pp):
        while pending[r]:
            chunk, micro = pending[r].popleft()
            run(r, Action("W", chunk, micro), free[r])
    return tuple(tuple(order) for order in out)


def costed_span(orders: Orders, pp: int, stage_of: StageOf,
                costs: ActionCosts) -> float:
    """Replayed step of ``orders`` at the measured ``costs`` (each message ``costs.latency``)."""
    chunks = 1 + max((a.chunk for o in orders for a in o), default=0)
    graph = order_graph([list(o) for o in orders], stage_of, pp, pp * chunks - 1, "costed")
    return critical_path(graph, costs.of, costs.latency)


def held_peaks(orders: Orders) -> list[int]:
    """Each rank's most forwards whose W has not run (what a split schedule holds)."""
    peaks = []
    for order in orders:
        held = peak = 0
        for a in order:
            held += 1 if a.kind == "F" else -1 if a.kind == "W" else 0
            peak = max(peak, held)
        peaks.append(peak)
    return peaks


def within(orders: Orders, limits: tuple[int, ...] | None) -> bool:
    """No rank of ``orders`` holds more chunk activations than its limit (None: no limit)."""
    return limits is None or all(h <= cap for h, cap in zip(held_peaks(orders), limits,
                                                            strict=True))


def costed_candidates(orders: Orders, pp: int, stage_of: StageOf, costs: ActionCosts,
                      limits: tuple[int, ...] | None = None) -> list[Orders]:
    """``orders`` and their forwards and B's with the W's placed by ``fill_weight_grads`` at
    ``costs`` (each threshold of ``FILL_THRESHOLDS``, no rank holding more than in ``orders``
    nor past ``limits``), those within ``limits``: a fill that a limit leaves no way to run
    is no candidate."""
    skeletons = [[a for a in order if a.kind != "W"] for order in orders]
    caps = held_peaks(orders)
    if limits is not None:
        caps = [min(c, cap) for c, cap in zip(caps, limits, strict=True)]
    candidates = [orders]
    # A skeleton that runs more forwards before its first B than a rank may hold leaves no
    # fill within the limits (no W can run before that B): none is tried.
    ahead = [next((i for i, a in enumerate(s) if a.kind == "B"), len(s)) for s in skeletons]
    thresholds = FILL_THRESHOLDS if all(n <= c for n, c in zip(ahead, caps, strict=True)) else ()
    for threshold in thresholds:
        try:
            candidates.append(fill_weight_grads(skeletons, pp, stage_of, costs, caps,
                                                threshold))
        except RuntimeError:
            continue
    return [o for o in candidates if within(o, limits)]


def costed_orders(orders: Orders, pp: int, stage_of: StageOf, costs: ActionCosts) -> Orders:
    """Of ``costed_candidates``, the one whose step replays shortest at ``costs`` (``orders``
    on a tie)."""
    return min(costed_candidates(orders, pp, stage_of, costs),
               key=lambda o: costed_span(o, pp, stage_of, costs))


class _ZeroBubble(PipelineSchedule):
    """One chunk per rank, 1F1B's pairs of forward and B, the W's placed by ``lag``."""

    splits_backward = True

    @abstractmethod
    def warmup(self, pp_rank: int, pp: int, m: int) -> int:
        """Forwards a rank runs before its first B."""

    @abstractmethod
    def lag(self, pp_rank: int, pp: int, m: int) -> int:
        """How many backwards after its own B a W runs (the W of the k-th B follows the
        (k + lag)-th B)."""

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        order = one_f_one_b([Action("F", 0, k) for k in range(m)],
                            [Action("B", 0, k) for k in range(m)], self.warmup(pp_rank, pp, m))
        return with_weight_grads(order, self.lag(pp_rank, pp, m))


class ZBH1(_ZeroBubble):
    name = "zb_h1"
    summary = ("zero bubble H1: 1F1B with the backward split, the weight gradients fill the "
               "bubble; 1F1B's first-rank memory")
    takes_held_limits = True

    def limited_actions(self, pp_rank: int, pp: int, m: int, v: int, limits: tuple[int, ...],
                        costs: ActionCosts | None) -> list[Action]:
        # The longest lag, up to the rank's own, whose order holds within the limit: each W
        # run a backward sooner gives a stash back, and leaves a unit of the drain unfilled.
        order = one_f_one_b([Action("F", 0, k) for k in range(m)],
                            [Action("B", 0, k) for k in range(m)], self.warmup(pp_rank, pp, m))
        # A lag L holds the warm-up's forwards, one more, and L stashes (at most m): start there.
        start = min(self.lag(pp_rank, pp, m),
                    limits[pp_rank] - self.warmup(pp_rank, pp, m) - 1)
        for lag in range(max(start, 0), 0, -1):
            placed = with_weight_grads(order, lag)
            if held_peaks((tuple(placed),))[0] <= limits[pp_rank]:
                return placed
        return with_weight_grads(order, 0)  # 1F1B's own holding: no lag holds less

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

    def costed_actions(self, pp_rank: int, pp: int, m: int, v: int,
                       costs: ActionCosts) -> list[Action]:
        return list(_costed_h2_orders(self, pp, m, costs)[pp_rank])


@functools.lru_cache(maxsize=8)
def _costed_h2_orders(schedule: ZBH2, pp: int, m: int,
                      costs: ActionCosts) -> Orders:
    """ZB-H2's orders with the W's placed at the measured costs (``costed_orders``)."""
    orders = tuple(tuple(schedule.actions(r, pp, m, 1)) for r in range(pp))
    return costed_orders(orders, pp, lambda chunk, r: r, costs)


for _schedule in (ZBH1(), ZBH2()):
    SCHEDULES.register(_schedule)
