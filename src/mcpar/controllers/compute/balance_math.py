"""Load arithmetic of expert placement: rank loads, imbalance, excess load and the swap planner.

With expert parallelism every MoE layer spreads its E experts over ``ep`` ranks, E/ep slots per
rank (slot s on rank s // (E/ep)); a placement row says which expert each slot holds. A move is
a SWAP of two slots on different ranks, which keeps E/ep experts per rank. Moves cannot split an
expert: one whose share of the tokens exceeds 1/ep cannot be balanced at all, and the hottest
expert's rank also holds E/ep - 1 others, which sets the floor no placement beats.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Swap:
    layer: int
    slot_a: int
    slot_b: int  # on a different rank than slot_a


def _check_placement(counts: np.ndarray, expert_of_slot: np.ndarray, ep: int) -> None:
    if counts.ndim != 2 or counts.shape != expert_of_slot.shape:
        raise ValueError(f"counts {counts.shape} and expert_of_slot {expert_of_slot.shape} must "
                         "both be [layers, experts]")
    if ep < 1 or counts.shape[1] % ep:
        raise ValueError(f"{counts.shape[1]} experts do not divide over {ep} ranks")


def rank_loads(counts: np.ndarray, expert_of_slot: np.ndarray, ep: int) -> np.ndarray:
    """[L, ep] tokens each rank processes: the sum over its slots of their experts' counts."""
    counts, expert_of_slot = np.asarray(counts), np.asarray(expert_of_slot)
    _check_placement(counts, expert_of_slot, ep)
    slot_loads = np.take_along_axis(counts, expert_of_slot, axis=1)
    return slot_loads.reshape(counts.shape[0], ep, -1).sum(axis=2)


def imbalance(counts: np.ndarray, expert_of_slot: np.ndarray, ep: int) -> np.ndarray:
    """[L] max rank load / mean rank load; 1.0 for a layer that routed no token."""
    loads = rank_loads(counts, expert_of_slot, ep).astype(np.float64)
    mean = loads.mean(axis=1)
    return np.where(mean > 0, loads.max(axis=1) / np.where(mean > 0, mean, 1.0), 1.0)


def plan_layer(load: np.ndarray, expert_of_slot: np.ndarray, ep: int,
               max_swaps: int) -> tuple[list[tuple[int, int]], list[float]]:
    """Greedy swap sequence for one layer and the predicted imbalance after each prefix.

    Each swap takes the most loaded rank r and the (slot on r, slot elsewhere) pair that minimizes
    the larger of the two ranks' new loads, provided it is below r's old load: the sorted vector
    of rank loads then decreases, so the plan never cycles. Returns (swaps, imbalances) with
    ``imbalances[k]`` the predicted imbalance after the first k swaps.
    """
    per_rank = load.size // ep
    slot_load = load[expert_of_slot].astype(np.float64)
    rank_of = np.arange(load.size) // per_rank
    ranks = slot_load.reshape(ep, per_rank).sum(axis=1)
    mean = ranks.mean()
    if mean <= 0:
        return [], [1.0]
    swaps: list[tuple[int, int]] = []
    imbalances = [float(ranks.max() / mean)]
    for _ in range(max_swaps):
        r = int(np.argmax(ranks))
        on_r = np.arange(r * per_rank, (r + 1) * per_rank)
        others = np.flatnonzero(rank_of != r)
        delta = slot_load[on_r][:, None] - slot_load[others][None, :]
        pair_max = np.maximum(ranks[r] - delta, ranks[rank_of[others]][None, :] + delta)
        pair_max = np.where(delta > 0, pair_max, np.inf)
        best = int(np.argmin(pair_max))  # first minimum: ties go to the lowest slots
        if not pair_max.flat[best] < ranks[r] - 1e-9 * mean:
            break
        a, b = int(on_r[best // others.size]), int(others[best % others.size])
        d = slot_load[a] - slot_load[b]
        ranks[r] -= d
        ranks[rank_of[b]] += d
        slot_load[[a, b]] = slot_load[[b, a]]
        swaps.append((a, b))
        imbalances.append(float(ranks.max() / mean))
    return swaps, imbalances



def excess_load(slot_counts: np.ndarray, ep: int) -> np.ndarray:
    """[...] max rank load - mean rank load, from counts already in slot order ``[..., E]``: the
    assignments the most loaded rank processes while the mean rank waits (the wait on the
    slowest rank, in assignments)."""
    loads = slot_counts.reshape(*slot_counts.shape[:-1], ep, -1).sum(axis=-1)
    return loads.max(axis=-1) - loads.mean(axis=-1)
