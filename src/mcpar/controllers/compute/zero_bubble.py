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

- ``zbv``: two chunks per rank in a V: rank ``i`` holds stages ``i`` and ``2p - 1 - i``, so the
  first and last stages share rank 0, a micro-batch's forward goes down the ranks and back up,
  and its backward the same way in reverse. Its order is the shortest, replayed at the costs
  (``costed_v_orders``), of:
  * the phased order (``v_phased_orders``): ``2(p - i) - 1`` forwards of the first chunk, then
    ``i`` pairs (second chunk's forward, first chunk's), ``p - i`` triples of the second chunk
    (F, B, W), a steady state of (F, B, W) of the first chunk then of the second, and a drain
    of B's then the W's left. Each B is followed by its own W in the steady state, so a
    message has a W's time to arrive before the rank needs it.
  * the phased order's forwards and B's with its W's placed by the costs
    (``fill_weight_grads``): a list schedule in time where a rank runs a pending W while the
    input of its next forward or B is still on its way (or a forward would hold more than the
    phased order does), tried at the thresholds ``FILL_THRESHOLDS``.
  * the greedy order (``v_greedy_orders``): a list schedule at unit costs; at each tick a free
    rank runs a forward whose input has arrived (its second chunk's first) while it holds
    fewer than ``2p`` chunk activations, else a ready B (second chunk first), else its oldest
    pending W. It packs F's and B's back to back, which wins at few micro-batches (p = 4,
    m = 2: 19 unit costs against 21) but leaves no slack for a message's latency.
  All hold at most ``2p`` chunk activations on a rank (``p`` micro-batches of the whole rank:
  1F1B's first-rank memory); rank 0 reaches it while it also holds the head's input and loss for
  one micro-batch (the V puts the last stage there), so its peak is 1F1B's plus the head's:
  1.06x on the bubble bench's GPT at p = 4, m = 8 (71.6 MB against 67.4; its other ranks 67.9).
  Where that passes 1F1B's peak, the MemoryController bounds the rank (``held_limits``,
  ``limited_actions``): of the candidates above, those within the limits, and the greedy
  capped at them, at unit costs and as a list schedule in time at the costs
  (``v_timed_greedy_orders``); under a cap below ``2p`` the first chunk's forwards leave the
  second a slot, or the V could not turn. On that GPT rank 0 then holds ``2p - 1`` (63.2 MB
  estimated), for a step 3.3% longer at unit costs with latency (53.6 units against 51.9) and
  11% longer at B = 1.2 F, W = 0.5 F (54.0 against 48.5; 18% at p = 8, m = 16): the bound costs
  throughput, which the cost model prices. Without measured costs (``actions``) the costs
  are one unit per action and ``MESSAGE_LATENCY`` units per message: a step of the bench's
  fixed-cost stages (p = 4, m = 8, a chunk's forward 10 ms) lasted what the replay gives with 1
  ms per message; there the phased order replays 52.3 units, the greedy 53.4 and the filled one
  51.9 (all 51 without latency). With measured costs (``costed_actions``: ``ActionCosts``, the
  seconds of each rank's F, B and W and of a message) the order is built at those: with B = 1.2
  F and W = 0.5 F the order built at them replays 1.4% shorter than the unit-cost one at p = 4,
  m = 8 and 1.0% at p = 8, m = 16 (0.1 F a message; tested). At F = B = W the V's bound before a
  synchronized optimizer step is ``3m + (p-1)/2`` unit costs (the last rank's fill is half a
  forward per rank: the chunks are half the work): a bubble of 5.9% at p = 4, m = 8. A rank may
  read a peer's messages in another order than the peer sends them (a V's two chunks talk to the
  same neighbour); the executor then posts its receives in the sender's order
  (``ComputePlan.send_order``), which a backend that matches messages by order, not tag (NCCL),
  needs.
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
from mcpar.registry.schedule import (
    EPS,
    SCHEDULES,
    Action,
    ActionCosts,
    PipelineSchedule,
    critical_path,
    order_graph,
    placed_stage,
    stage_rank,
)


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


def v_stage(chunk: int, pp_rank: int, pp: int) -> int:
    return placed_stage(chunk, pp_rank, pp, "v")


# A message between ranks, in units of one chunk's forward: what the bench's fixed-cost step
# measured (1 ms per message next to a 10 ms chunk forward, p = 4, m = 8, 2 cores).
MESSAGE_LATENCY = 0.1


def v_orders(pp: int, m: int) -> Orders:
    """Every rank's ZBV order at unit costs with ``MESSAGE_LATENCY`` per message
    (``costed_v_orders``)."""
    return costed_v_orders(pp, m, ActionCosts.uniform(pp, 1.0, 1.0, 1.0, MESSAGE_LATENCY))


@functools.lru_cache(maxsize=32)  # the planner asks for a few (pp, m) in turn, many times
def costed_v_orders(pp: int, m: int, costs: ActionCosts,
                    limits: tuple[int, ...] | None = None) -> Orders:
    """Every rank's ZBV order at the measured ``costs``: of the phased and the greedy orders
    and the phased one's forwards and B's with the W's placed at the costs
    (``fill_weight_grads``), the one whose step replays shortest at ``costs`` (the phased one
    on a tie). With ``limits``, of those that hold within them, the greedy one capped at each
    rank's limit among them (the unbounded choice where none does: the limit is below what
    any V order can hold)."""
    def stage(chunk: int, r: int) -> int:
        return v_stage(chunk, r, pp)

    candidates = costed_candidates(v_phased_orders(pp, m), pp, stage, costs, limits)
    candidates += [o for o in (v_greedy_orders(pp, m), ) if within(o, limits)]
    if limits is not None:
        caps = tuple(min(2 * pp, c) for c in limits)
        for greedy in (lambda: v_greedy_orders(pp, m, caps),
                       lambda: v_timed_greedy_orders(pp, m, costs, caps)):
            try:
                candidates += costed_candidates(greedy(), pp, stage, costs, limits)
            except RuntimeError:
                continue  # a cap under what a V needs to turn deadlocks the greedy
    if not candidates:
        return costed_v_orders(pp, m, costs)
    return min(candidates, key=lambda orders: costed_span(orders, pp, stage, costs))


def v_step_units(orders: Orders, pp: int, latency: float) -> float:
    """Replayed step of ZBV ``orders`` with every action one unit and ``latency`` per message."""
    graph = order_graph([list(o) for o in orders], lambda chunk, r: v_stage(chunk, r, pp), pp,
                        2 * pp - 1, "zbv")
    return critical_path(graph, lambda r, kind: 1.0, latency)


def v_phased_orders(pp: int, m: int) -> Orders:
    """Every rank's phased ZBV order (the module's text). Each phase's actions are skipped
    where they do not exist at this m (a forward past the last micro-batch, a B before its F,
    a W before its B); the drain runs whatever is left, B's first."""
    return tuple(tuple(_v_phased_order(pp, m, r)) for r in range(pp))


def _v_phased_order(pp: int, m: int, rank: int) -> list[Action]:
    order: list[Action] = []
    done = {"F": [0, 0], "B": [0, 0], "W": [0, 0]}  # per kind and chunk: how many so far
    before = {"F": None, "B": "F", "W": "B"}  # a B needs its F, a W its B

    def run(kind: str, chunk: int) -> None:
        k, limit = done[kind][chunk], m if before[kind] is None else done[before[kind]][chunk]
        if k < limit:
            order.append(Action(kind, chunk, k))
            done[kind][chunk] += 1

    for _ in range(2 * (pp - rank) - 1):  # fill: the first chunk's forwards
        run("F", 0)
    for _ in range(rank):  # the second chunk's forwards come back up the V
        run("F", 1)
        run("F", 0)
    for _ in range(pp - rank):  # the second chunk's first backwards
        for kind in ("F", "B", "W"):
            run(kind, 1)
    while done["F"][0] < m or done["F"][1] < done["F"][0]:  # steady state
        for chunk in (0, 1):
            for kind in ("F", "B", "W"):
                run(kind, chunk)
    for _ in range(rank):  # drain: B's the next rank down waits for, W's after
        run("B", 0)
        run("B", 1)
    for _ in range(pp - rank):
        run("B", 0)
        run("W", 0)
    for kind in ("B", "W"):
        for chunk in (1, 0):
            while done[kind][chunk] < m:
                run(kind, chunk)
    return order


@functools.lru_cache(maxsize=64)
def v_greedy_orders(pp: int, m: int, caps: tuple[int, ...] | None = None) -> Orders:
    """Every rank's greedy ZBV order: the list schedule at unit costs (the module's text),
    rank ``r`` holding at most ``caps[r]`` chunk activations (``2p`` each without caps)."""
    last, caps = 2 * pp - 1, caps or (2 * pp,) * pp
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
                # Under a cap below the V's 2p, the first chunk leaves the second a slot: its
                # forwards alone would fill the cap before the V turns, and no B could start.
                room = caps[r] - (1 if chunk == 0 and caps[r] < 2 * pp else 0)
                if k < m and held[r] < room and (s == 0 or done(("F", s - 1, k))):
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


def v_timed_greedy_orders(pp: int, m: int, costs: ActionCosts, caps: tuple[int, ...]) -> Orders:
    """The greedy ZBV order as a list schedule in time at the measured ``costs``: each rank,
    when free, runs a forward whose input has arrived (the second chunk's first, within its cap,
    the first chunk leaving the second a slot below ``2p``), else a B whose gradient has
    arrived (the second chunk's first), else its oldest pending W, else waits for the next
    input. The unit-cost greedy (``v_greedy_orders``) packs ticks, which uneven costs break."""
    last = 2 * pp - 1
    ended: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro) -> when it ended
    free, held = [0.0] * pp, [0] * pp
    next_f, next_b = [[0, 0] for _ in range(pp)], [[0, 0] for _ in range(pp)]
    pending: list[deque[tuple[int, int]]] = [deque() for _ in range(pp)]
    orders: list[list[Action]] = [[] for _ in range(pp)]

    def arrival(r: int, kind: str, chunk: int, k: int) -> float | None:
        """When the task's input is in on rank ``r`` (None while it is not produced)."""
        s = v_stage(chunk, r, pp)
        if kind == "F" and s == 0:
            return 0.0
        if kind == "F":
            key = ("F", s - 1, k)
        else:
            key = ("F", s, k) if s == last else ("B", s + 1, k)
        if key not in ended:
            return None
        local = stage_rank(key[1], pp, "v") == r
        return ended[key] + (0.0 if local else costs.latency)

    def candidates(r: int) -> list[tuple[str, int, int]]:
        out = []
        for chunk in (1, 0):
            room = caps[r] - (1 if chunk == 0 and caps[r] < 2 * pp else 0)
            if next_f[r][chunk] < m and held[r] < room:
                out.append(("F", chunk, next_f[r][chunk]))
        out += [("B", chunk, next_b[r][chunk]) for chunk in (1, 0)
                if next_b[r][chunk] < next_f[r][chunk]]
        return out

    now, left = 0.0, 6 * m * pp
    while left:
        started = False
        for r in range(pp):
            if free[r] > now + EPS:
                continue  # busy
            ready = [task for task in candidates(r)
                     if (at := arrival(r, *task)) is not None and at <= now + EPS]
            if not ready and not pending[r]:
                continue
            kind, chunk, k = ready[0] if ready else ("W", *pending[r].popleft())
            free[r] = now + costs.of(r, kind)
            ended[(kind, v_stage(chunk, r, pp), k)] = free[r]
            orders[r].append(Action(kind, chunk, k))
            left, started = left - 1, True
            if kind == "F":
                next_f[r][chunk] += 1
                held[r] += 1
            elif kind == "B":
                next_b[r][chunk] += 1
                pending[r].append((chunk, k))
            else:
                held[r] -= 1
        if started:
            continue
        # Nothing could start now: on to the next task's end or input's arrival.
        later = [f for f in free if f > now + EPS]
        later += [at for r in range(pp) for task in candidates(r)
                  if (at := arrival(r, *task)) is not None and at > now + EPS]
        if not later:
            raise RuntimeError(f"the timed ZBV greedy made no progress at pp {pp}, m {m}")
        now = min(later)
    return tuple(tuple(order) for order in orders)


class ZBV(PipelineSchedule):
    name = "zbv"
    multi_chunk = True
    splits_backward = True
    placement = "v"
    summary = ("zero bubble V: two chunks per rank in a V (rank i: stages i and 2p-1-i), the "
               "backward split; 1F1B's first-rank memory, and the head's on rank 0")

    def problem(self, pp: int, m: int, v: int) -> tuple[str, str] | None:
        found = super().problem(pp, m, v)
        if found is None and v != 2:
            found = ("vp", f"schedule zbv places exactly 2 stages per rank (a V), but "
                           f"virtual_stages is {v}; set virtual_stages 2")
        return found

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        return list(v_orders(pp, m)[pp_rank])

    def costed_actions(self, pp_rank: int, pp: int, m: int, v: int,
                       costs: ActionCosts) -> list[Action]:
        return list(costed_v_orders(pp, m, costs)[pp_rank])

    takes_held_limits = True

    def limited_actions(self, pp_rank: int, pp: int, m: int, v: int, limits: tuple[int, ...],
                        costs: ActionCosts | None) -> list[Action]:
        if costs is None:
            return list(unit_limited_v_orders(pp, m, limits)[pp_rank])
        return list(costed_v_orders(pp, m, costs, limits)[pp_rank])


@functools.lru_cache(maxsize=64)
def unit_limited_v_orders(pp: int, m: int, limits: tuple[int, ...]) -> Orders:
    """ZBV's orders within ``limits`` at unit costs (the planner's and the memory estimate's,
    asked for thousands of layouts): the unbounded order where it holds within them, else the
    unit-cost greedy capped at them (at unit costs with latency the shortest within them; the
    fills and the timed greedy, quadratic in the actions, are for measured costs), else the
    unbounded order where the limits leave no V able to turn."""
    free = v_orders(pp, m)
    if within(free, limits):
        return free
    try:
        return v_greedy_orders(pp, m, tuple(min(2 * pp, c) for c in limits))
    except RuntimeError:
        return free


for _schedule in (ZBH1(), ZBH2(), ZBV()):
    SCHEDULES.register(_schedule)
