"""The zero-bubble V schedule (ZBV; Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024),
registered by name (the contract: ``mcpar.registry.schedule``); the backward split, the W fill
and the replays it shares with ZB-H1 and ZB-H2 are ``zero_bubble.py``'s.

``zbv``: two chunks per rank in a V: rank ``i`` holds stages ``i`` and ``2p - 1 - i``, so the
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

Steps that overlap (``optimization.post_validation``: no synchronized optimizer step between
them) pay that fill once, not every step, if the ranks end a step as far apart as they start
it. The candidates are then ranked by the steady period of steps run back to back
(``v_period``; ``OverlappedZBV``): at F = B = W with free messages the phased order's period
is ``3m`` units, no bubble, where the order that is shortest for one synchronized step
(the filled one) keeps ``m``-independent waits on the first rank (50 units against 48 at
p = 4, m = 8).

Deadlock freedom: as ``zero_bubble.py`` states for every split schedule; the tests replay every
rank's list together.
"""

from __future__ import annotations

import functools
from collections import deque

from mcpar.controllers.compute.zero_bubble import (
    Orders,
    costed_candidates,
    costed_span,
    within,
)
from mcpar.registry.schedule import (
    SCHEDULES,
    Action,
    ActionCosts,
    PipelineSchedule,
    placed_stage,
    stage_rank,
)
from mcpar.registry.schedule_replay import EPS, critical_path, order_graph, steady_period


def v_stage(chunk: int, pp_rank: int, pp: int) -> int:
    return placed_stage(chunk, pp_rank, pp, "v")


# A message between ranks, in units of one chunk's forward: what the bench's fixed-cost step
# measured (1 ms per message next to a 10 ms chunk forward, p = 4, m = 8, 2 cores).
MESSAGE_LATENCY = 0.1


def v_orders(pp: int, m: int, overlapped: bool = False) -> Orders:
    """Every rank's ZBV order at unit costs with ``MESSAGE_LATENCY`` per message
    (``costed_v_orders``)."""
    return costed_v_orders(pp, m, ActionCosts.uniform(pp, 1.0, 1.0, 1.0, MESSAGE_LATENCY),
                           overlapped=overlapped)


def v_period(orders: Orders, pp: int, m: int, costs: ActionCosts) -> float:
    """The steady period of ZBV ``orders`` at ``costs`` when steps overlap (``steady_period``)."""
    return steady_period([list(o) for o in orders], lambda chunk, r: v_stage(chunk, r, pp), pp,
                         2 * pp - 1, m, costs.of, costs.latency)


@functools.lru_cache(maxsize=32)  # the planner asks for a few (pp, m) in turn, many times
def costed_v_orders(pp: int, m: int, costs: ActionCosts,
                    limits: tuple[int, ...] | None = None, overlapped: bool = False) -> Orders:
    """Every rank's ZBV order at the measured ``costs``: of the phased and the greedy orders
    and the phased one's forwards and B's with the W's placed at the costs
    (``fill_weight_grads``), the one whose step replays shortest at ``costs`` (the phased one
    on a tie); ``overlapped`` (steps not synchronized by the optimizer step): the one whose
    steady period (``v_period``) is shortest. With ``limits``, of those that hold within
    them, the greedy one capped at each rank's limit among them (the unbounded choice where
    none does: the limit is below what any V order can hold)."""
    def stage(chunk: int, r: int) -> int:
        return v_stage(chunk, r, pp)

    def duration(orders: Orders) -> float:
        return (v_period(orders, pp, m, costs) if overlapped
                else costed_span(orders, pp, stage, costs))

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
        return costed_v_orders(pp, m, costs, overlapped=overlapped)
    return min(candidates, key=duration)


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

    # Orders chosen by the steady period of steps that overlap (``for_overlapped_steps``).
    overlapped = False

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        return list(v_orders(pp, m, self.overlapped)[pp_rank])

    def costed_actions(self, pp_rank: int, pp: int, m: int, v: int,
                       costs: ActionCosts) -> list[Action]:
        return list(costed_v_orders(pp, m, costs, overlapped=self.overlapped)[pp_rank])

    takes_held_limits = True

    def limited_actions(self, pp_rank: int, pp: int, m: int, v: int, limits: tuple[int, ...],
                        costs: ActionCosts | None) -> list[Action]:
        if costs is None:
            return list(unit_limited_v_orders(pp, m, limits, self.overlapped)[pp_rank])
        return list(costed_v_orders(pp, m, costs, limits, self.overlapped)[pp_rank])

    def for_overlapped_steps(self) -> PipelineSchedule:
        return OVERLAPPED_ZBV


class OverlappedZBV(ZBV):
    """ZBV whose orders are chosen by the steady period of overlapping steps: the phased
    order's ranks end a step as far apart as they start it (the last rank ``(p - 1)/2``
    forwards after the first), so the next step's forwards meet each rank just as it is done,
    where the order that is shortest for one synchronized step makes the first rank wait at
    the end of each step. Not registered: the same entry, "zbv", as a step that overlaps the
    next runs it."""

    overlapped = True


OVERLAPPED_ZBV = OverlappedZBV()


@functools.lru_cache(maxsize=64)
def unit_limited_v_orders(pp: int, m: int, limits: tuple[int, ...],
                          overlapped: bool = False) -> Orders:
    """ZBV's orders within ``limits`` at unit costs (the planner's and the memory estimate's,
    asked for thousands of layouts): the unbounded order where it holds within them, else the
    unit-cost greedy capped at them (at unit costs with latency the shortest within them; the
    fills and the timed greedy, quadratic in the actions, are for measured costs), else the
    unbounded order where the limits leave no V able to turn."""
    free = v_orders(pp, m, overlapped)
    if within(free, limits):
        return free
    try:
        return v_greedy_orders(pp, m, tuple(min(2 * pp, c) for c in limits))
    except RuntimeError:
        return free


SCHEDULES.register(ZBV())
