"""The built-in pipeline schedules, registered by name (the contract: ``mcpar.registry.schedule``).

- ``gpipe``: every forward, then every backward. Holds all ``m`` micro-batches' activations.
- ``1f1b``: ``pp - rank - 1`` warm-up forwards, then one forward / one backward alternately, then
  the remaining backwards. Same bubble as GPipe, ``(pp-1)/(m+pp-1)`` of the step idle, but at
  most ``pp - rank`` micro-batches in flight. Any ``m >= 1`` (the warm-up is capped).
- ``interleaved_1f1b``: Megatron-LM's interleaved schedule over ``v >= 2`` chunks per rank; the
  bubble shrinks to ``(pp-1)/(v m + pp-1)``, paid for with ``v`` times the point-to-point
  traffic. Micro-batches go through the chunks in groups of ``pp``, so ``m`` must be a multiple
  of ``pp``.
- ``zb_h1``, ``zb_h2``: zero-bubble schedules (``zero_bubble.py``): the backward split into B
  (the input's gradient) and W (the weight gradients), the W's placed into what would be 1F1B's
  bubble.

Deadlock freedom of every schedule: see ``schedules.py``; the tests replay every rank's list.
"""

from __future__ import annotations

from mcpar.registry.schedule import SCHEDULES, Action, PipelineSchedule


def one_f_one_b(fwd: list[Action], bwd: list[Action], warmup: int) -> list[Action]:
    """`warmup` forwards, then forward / backward pairs, then the remaining backwards."""
    actions = fwd[:warmup]
    steady = len(fwd) - warmup
    for k in range(steady):
        actions += [fwd[warmup + k], bwd[k]]
    return actions + bwd[steady:]


class _FillDrain(PipelineSchedule):
    """A schedule whose step is its closed form: the busiest rank's m slots plus the others'
    fill and drain (divided by the chunks when interleaved), and never less than one
    micro-batch crossing every stage forward and back. Messages that spend time on a wire
    (``latency``) are replayed instead: the closed form has no place for them."""

    def span(self, m: int, w_max: float, w_sum: float, rank_work: list[float], v: int,
             fwd_share: float, latency: float = 0.0) -> float:
        if latency > 0:
            return super().span(m, w_max, w_sum, rank_work, v, fwd_share, latency)
        return max(m * w_max + (w_sum - w_max) / v, w_sum)


class GPipe(_FillDrain):
    name = "gpipe"
    summary = "all forwards, then all backwards; holds every micro-batch's activations"

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]

    def in_flight(self, pp: int, pp_rank: int, m: int, v: int) -> float:
        return m

    def head_in_flight(self, pp: int, m: int, v: int) -> int:
        return m


class OneFOneB(_FillDrain):
    name = "1f1b"
    summary = "one forward, one backward; at most pp - rank micro-batches in flight"

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        return one_f_one_b([Action("F", 0, k) for k in range(m)],
                            [Action("B", 0, k) for k in range(m)],
                            one_f_one_b_warmup(pp_rank, pp, m))

    def in_flight(self, pp: int, pp_rank: int, m: int, v: int) -> float:
        return min(pp - pp_rank, m)


class Interleaved1F1B(_FillDrain):
    name = "interleaved_1f1b"
    multi_chunk = True
    summary = "Megatron-LM's interleaved 1F1B over virtual_stages chunks per rank"

    def problem(self, pp: int, m: int, v: int) -> tuple[str, str] | None:
        found = super().problem(pp, m, v)
        if found is None and (m < pp or m % pp):
            # Micro-batches go through the chunks in groups of pp (Megatron-LM's order), and
            # the order cannot express a partial group.
            found = ("gradient_accumulation",
                     f"schedule interleaved_1f1b needs the number of micro-batches ({m}) to be "
                     f"a multiple of the pipeline degree {pp} (at least {pp}); raise "
                     f"gradient_accumulation to a multiple of {pp}")
        return found

    def actions(self, pp_rank: int, pp: int, m: int, v: int) -> list[Action]:
        def action(kind: str, k: int) -> Action:
            # The k-th forward (or backward) of this rank, in Megatron-LM's order: groups of pp
            # micro-batches sweep the chunks in turn (backwards in reverse chunk order).
            chunk = (k // pp) % v
            return Action(kind, v - 1 - chunk if kind == "B" else chunk,
                          (k // (pp * v)) * pp + k % pp)

        total = m * v
        # Megatron-LM's warm-up: enough forwards that the rank's first backward has arrived by
        # the time it is needed (2 per downstream rank, plus one sweep of the other chunks).
        warmup = min((pp - pp_rank - 1) * 2 + (v - 1) * pp, total)
        return one_f_one_b([action("F", k) for k in range(total)],
                            [action("B", k) for k in range(total)], warmup)

    # ``in_flight``: the default, counted from each rank's actions. The first rank holds
    # pp (1 + (pp - 1) / (pp v)) micro-batches (Narayanan et al. 2021); a later rank's warm-up
    # is 2 forwards shorter per rank (the bench's real model at pp 4, m 8: measured 92.7, 75.8,
    # 59.0 and 46.3 MB on ranks 0-3, where the first rank's figure for every rank gave 92.6 MB
    # and 96.8 MB with the head).


def one_f_one_b_warmup(pp_rank: int, pp: int, m: int) -> int:
    """1F1B's warm-up forwards on ``pp_rank``: one per downstream rank (capped at ``m``)."""
    return min(pp - pp_rank - 1, m)


for _schedule in (GPipe(), OneFOneB(), Interleaved1F1B()):
    SCHEDULES.register(_schedule)
