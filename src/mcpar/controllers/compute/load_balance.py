"""Expert load balancer: where each MoE expert lives, re-decided as routing drifts.

Why hand-written
    With expert parallelism every MoE layer spreads its E experts over ``ep`` ranks, E/ep slots
    per rank (slot s on rank s // (E/ep)). Routing is skewed and the skew drifts during training,
    so the rank holding the hot experts stalls every step. No installable library re-places the
    experts of a PyTorch MoE at run time: DeepSpeed-MoE and Megatron-Core balance with auxiliary
    losses, capacity factors and token dropping, which change what the model computes, not where
    experts live, and the systems that migrate experts exist as research prototypes. So the
    decision lives here, in a few hundred lines of numpy.

Objective
    Minimize the discounted sum of step costs, ``cost_t = imbalance_t + migration_cost * moved_t``:
    ``imbalance_t`` is the mean over layers of max rank load / mean rank load (1.0 = perfect), and
    ``moved_t`` the number of experts moved in that step (2 per swap). A move is a SWAP of two
    slots on different ranks, which keeps E/ep experts per rank. ``migration_cost`` is the share
    of a step that moving one expert stalls: a Mixtral-sized expert (3 x 4096 x 14336 = 176 M
    parameters) moves with its two Adam moments, 3 x 4 bytes x 176 M = 2.1 GB, about 42 ms on a
    50 GB/s link, against a step of about 2 s: 0.02, the default. Moves cannot split an expert:
    one whose share of the tokens exceeds 1/ep cannot be balanced at all, and the hottest
    expert's rank also holds E/ep - 1 others, which sets the floor no placement beats.

Policies (``controllers.compute.scheduler``)
    ``static``: expert e stays in slot e.

    ``greedy``: an exponential moving average (EMA) of each expert's tokens is the load estimate.
    Every ``interval`` steps a plan is built per layer: repeatedly, the swap between the most
    loaded rank and another rank that best evens out that pair (it must strictly lower the most
    loaded rank without lifting the other as high). The plan's prefix that maximizes
    ``horizon * predicted imbalance reduction - migration cost`` is applied, horizon being
    1 / (1 - discount) steps; no swap at all when no prefix pays for itself.

    ``reinforcement``: tabular Q-learning on the decisions of a semi-Markov process, one
    transition per ``interval`` steps.

    - State (48 cells): the predicted imbalance of the current placement under the EMA (4 bins);
      the predicted net value of the greedy policy's swaps, horizon x predicted imbalance
      reduction - migration cost (4 bins, the first one "greedy would hold"); and the drift of
      the load estimate since the last decision (3 bins: half the L1 distance between the
      normalized EMAs, mean over layers), high right after the routing shifted, when the EMA
      still lags. The predicted value is optimistic, since the plan also fits the EMA's noise;
      how much so, per state, is what the agent learns from the realized costs.
    - Actions: ``hold``; ``one_swap`` (the plan's first swap per layer); ``greedy`` (the greedy
      policy's cost-aware prefix); ``full_plan`` (every swap of the plan).
    - Reward: minus the discounted cost of the next ``interval`` steps, migration included,
      ``-(migration_cost * moved + sum_j discount**j * imbalance_j)``; the bootstrap discount of
      a transition is ``discount ** interval``.
    - Learning: routing does not depend on where experts live, so once an interval's token counts
      are known the reward of EVERY action is known too (its placement's imbalance on those
      counts); each decision updates all four actions, each towards its own next state (that
      placement's state under the new EMA). The actions are compared on the same counts, which
      removes most of the noise of comparing them on different steps. A state never updated is
      worth, as a bootstrap target, holding its predicted imbalance forever: the table's zeros
      would be wildly optimistic next to returns of about -imbalance / (1 - discount).
    - Exploration: epsilon-greedy, epsilon = 0.1 / (1 + decisions / 20), ties broken by the
      seeded RNG. Step size max(1 / visits, 0.1): the routing drifts, so old samples must fade.

Determinism
    Every rank runs its own balancer on the same (all-reduced) counts and must take the same
    decisions without talking: everything is numpy arithmetic in a fixed order and one seeded
    PCG64 generator, and ``state_tensors`` holds all of it, so a restored balancer continues
    with exactly the decisions the original would have taken.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch

POLICIES = ("static", "greedy", "reinforcement")
ACTIONS = ("hold", "one_swap", "greedy", "full_plan")
# Bin edges of the agent's state, around the figures that separate "leave it" from "move": a
# few % of imbalance; a greedy plan worth nothing, a few swaps' cost (0.04 each by default) or
# more; a drift well above the EMA's sampling noise (about 0.02 at 1000 tokens per expert).
IMBALANCE_EDGES = (1.08, 1.15, 1.3)
VALUE_EDGES = (1e-9, 0.2, 0.6)
DRIFT_EDGES = (0.03, 0.08)
NUM_STATES = (len(IMBALANCE_EDGES) + 1) * (len(VALUE_EDGES) + 1) * (len(DRIFT_EDGES) + 1)
EPSILON0, EPSILON_HALF, MIN_STEP_SIZE = 0.1, 20.0, 0.1


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


class ExpertLoadBalancer:
    """Observes tokens per expert each step and decides expert swaps every ``interval`` steps."""

    def __init__(self, policy: str, num_layers: int, num_experts: int, ep: int, *,
                 interval: int = 10, migration_cost: float = 0.02, discount: float = 0.9,
                 seed: int = 0, ema_weight: float = 0.2, max_swaps: int | None = None):
        if policy not in POLICIES:
            raise ValueError(f"unknown load-balancing policy '{policy}'; use one of {POLICIES}")
        if num_layers < 1 or num_experts < 1 or ep < 1:
            raise ValueError("num_layers, num_experts and ep must be >= 1")
        if num_experts % ep:
            raise ValueError(f"{num_experts} experts do not divide over {ep} expert-parallel "
                             "ranks; each rank must hold the same number of slots")
        if interval < 1 or migration_cost < 0 or not 0 <= discount < 1 or not 0 < ema_weight <= 1:
            raise ValueError("need interval >= 1, migration_cost >= 0, 0 <= discount < 1 and "
                             "0 < ema_weight <= 1")
        self.policy, self.ep = policy, ep
        self.num_layers, self.num_experts = num_layers, num_experts
        self.interval, self.migration_cost, self.discount = interval, migration_cost, discount
        self.ema_weight = ema_weight
        self.max_swaps = num_experts // ep if max_swaps is None else max_swaps
        self.horizon = 1.0 / (1.0 - discount)
        self.expert_of_slot = np.tile(np.arange(num_experts), (num_layers, 1))
        self.decisions: list[dict] = []
        self._rng = np.random.Generator(np.random.PCG64(seed))
        self._estimate = np.zeros((num_layers, num_experts))
        self._estimate_at_decision = np.zeros((num_layers, num_experts))
        self._steps_seen = 0
        self._num_decisions = 0
        self._q = np.zeros((NUM_STATES, len(ACTIONS)))
        self._visits = np.zeros((NUM_STATES, len(ACTIONS)), dtype=np.int64)
        # The last decision, until its reward is known: its state, every action's placement,
        # experts moved and discounted imbalance accumulated so far, and the steps elapsed.
        self._pending_state = -1
        self._pending_placements = np.zeros((len(ACTIONS), num_layers, num_experts), np.int64)
        self._pending_moved = np.zeros(len(ACTIONS), np.int64)
        self._pending_cost = np.zeros(len(ACTIONS))
        self._pending_steps = 0

    # -- observing -------------------------------------------------------------------------------

    def observe(self, step: int, counts: np.ndarray) -> list[Swap]:
        """counts: [L, E] tokens per expert routed in this step. Returns the swaps to apply now
        (already applied to ``expert_of_slot``)."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"counts must be [layers, experts] = "
                             f"[{self.num_layers}, {self.num_experts}], got {list(counts.shape)}")
        if not np.isfinite(counts).all() or (counts < 0).any():
            raise ValueError("counts must be finite token counts >= 0")
        if self._pending_state >= 0 and self._pending_steps < self.interval:
            weight = self.discount ** self._pending_steps
            for a in range(len(ACTIONS)):
                layer_imb = imbalance(counts, self._pending_placements[a], self.ep)
                self._pending_cost[a] += weight * float(layer_imb.mean())
            self._pending_steps += 1
        if self._steps_seen == 0:
            self._estimate = counts.copy()
            self._estimate_at_decision = counts.copy()
        else:
            self._estimate += self.ema_weight * (counts - self._estimate)
        self._steps_seen += 1
        if self.policy == "static" or self._steps_seen % self.interval:
            return []
        if self.policy == "greedy":
            swaps = self._decide_greedy(step)
        else:
            swaps = self._decide_reinforcement(step)
        self._estimate_at_decision = self._estimate.copy()
        self._num_decisions += 1
        return swaps

    # -- planning --------------------------------------------------------------------------------

    def _plans(self, placement: np.ndarray) -> list[tuple[list[tuple[int, int]], list[float]]]:
        return [plan_layer(self._estimate[layer], placement[layer], self.ep, self.max_swaps)
                for layer in range(self.num_layers)]

    def _greedy_prefix(self, imbalances: list[float]) -> int:
        """The number of plan swaps worth their migration; 0 when none is."""
        values = [self.horizon * (imbalances[0] - imb) / self.num_layers
                  - 2 * self.migration_cost * k for k, imb in enumerate(imbalances)]
        return int(np.argmax(values))  # first maximum: the fewest swaps among equals

    @staticmethod
    def _apply(placement: np.ndarray, plans: list, prefix: list[int]) -> tuple[np.ndarray,
                                                                               list[Swap]]:
        placement = placement.copy()
        swaps = []
        for layer, ((layer_swaps, _), k) in enumerate(zip(plans, prefix, strict=True)):
            for a, b in layer_swaps[:k]:
                placement[layer, [a, b]] = placement[layer, [b, a]]
                swaps.append(Swap(layer, a, b))
        return placement, swaps

    def _predicted(self, placement: np.ndarray) -> float:
        return float(imbalance(self._estimate, placement, self.ep).mean())

    def _decide_greedy(self, step: int) -> list[Swap]:
        plans = self._plans(self.expert_of_slot)
        prefix = [self._greedy_prefix(imbs) for _, imbs in plans]
        before = self._predicted(self.expert_of_slot)
        self.expert_of_slot, swaps = self._apply(self.expert_of_slot, plans, prefix)
        after = self._predicted(self.expert_of_slot)
        self.decisions.append({
            "step": step, "policy": "greedy", "action": "migrate" if swaps else "hold",
            "swaps": [[s.layer, s.slot_a, s.slot_b] for s in swaps],
            "predicted_imbalance_before": before, "predicted_imbalance_after": after,
            "predicted_gain": self.horizon * (before - after),
            "migration_cost": 2 * self.migration_cost * len(swaps)})
        return swaps

    # -- the reinforcement agent -----------------------------------------------------------------

    def _features(self, placement: np.ndarray) -> tuple[int, dict, list]:
        """(state index, raw features, plans) of `placement` under the current estimate."""
        plans = self._plans(placement)
        predicted = float(np.mean([imbs[0] for _, imbs in plans]))
        prefix = [self._greedy_prefix(imbs) for _, imbs in plans]
        gain = self.horizon * float(np.mean([imbs[0] - imbs[k]
                                             for (_, imbs), k in zip(plans, prefix, strict=True)]))
        value = gain - 2 * self.migration_cost * sum(prefix)
        now = self._estimate / np.maximum(self._estimate.sum(axis=1, keepdims=True), 1e-12)
        then = self._estimate_at_decision / np.maximum(
            self._estimate_at_decision.sum(axis=1, keepdims=True), 1e-12)
        drift = float(0.5 * np.abs(now - then).sum(axis=1).mean())
        bins = (int(np.searchsorted(IMBALANCE_EDGES, predicted, side="right")),
                int(np.searchsorted(VALUE_EDGES, value, side="right")),
                int(np.searchsorted(DRIFT_EDGES, drift, side="right")))
        state = (bins[0] * (len(VALUE_EDGES) + 1) + bins[1]) * (len(DRIFT_EDGES) + 1) + bins[2]
        features = {"predicted_imbalance": predicted, "greedy_net_value": value,
                    "drift": drift, "bins": list(bins)}
        return state, features, plans

    def _state_value(self, state: int, predicted_imbalance: float) -> float:
        """max_a Q(state, a); a state never updated is worth holding its imbalance forever
        (zero, the table's initial value, would let a "hold" that loops into a new state feed on
        its own optimism)."""
        if not self._visits[state].any():
            return -predicted_imbalance / (1.0 - self.discount)
        return float(self._q[state].max())

    def _learn(self, current: tuple[int, float]) -> None:
        """Update every action of the pending decision with the reward it got (or would have)."""
        gamma = self.discount ** self._pending_steps
        next_state = {self.expert_of_slot.tobytes(): current}
        rewards, targets = [], []
        for a in range(len(ACTIONS)):
            placement = self._pending_placements[a]
            key = placement.tobytes()
            if key not in next_state:
                state, features, _ = self._features(placement)
                next_state[key] = (state, features["predicted_imbalance"])
            reward = -(self.migration_cost * self._pending_moved[a] + self._pending_cost[a])
            rewards.append(float(reward))
            targets.append(reward + gamma * self._state_value(*next_state[key]))
        s = self._pending_state
        for a, target in enumerate(targets):
            self._visits[s, a] += 1
            step_size = max(1.0 / self._visits[s, a], MIN_STEP_SIZE)
            self._q[s, a] += step_size * (target - self._q[s, a])
        if self.decisions and self.decisions[-1].get("reward", 0) is None:
            record = self.decisions[-1]
            record["reward"] = rewards[ACTIONS.index(record["action"])]
            record["counterfactual_rewards"] = dict(zip(ACTIONS, rewards, strict=True))

    def _decide_reinforcement(self, step: int) -> list[Swap]:
        state, features, plans = self._features(self.expert_of_slot)
        if self._pending_state >= 0 and self._pending_steps > 0:
            self._learn((state, features["predicted_imbalance"]))
        prefixes = {
            "hold": [0] * self.num_layers,
            "one_swap": [min(1, len(swaps)) for swaps, _ in plans],
            "greedy": [self._greedy_prefix(imbs) for _, imbs in plans],
            "full_plan": [len(swaps) for swaps, _ in plans],
        }
        candidates = [self._apply(self.expert_of_slot, plans, prefixes[name]) for name in ACTIONS]
        epsilon = EPSILON0 / (1.0 + self._num_decisions / EPSILON_HALF)
        explored = bool(self._rng.random() < epsilon)
        if explored:
            action = int(self._rng.integers(len(ACTIONS)))
        else:
            best = np.flatnonzero(self._q[state] == self._q[state].max())
            action = int(best[self._rng.integers(best.size)]) if best.size > 1 else int(best[0])
        for a, (placement, swaps) in enumerate(candidates):
            self._pending_placements[a] = placement
            self._pending_moved[a] = 2 * len(swaps)
        self._pending_cost[:] = 0.0
        self._pending_steps = 0
        self._pending_state = state
        self.expert_of_slot, swaps = candidates[action]
        self.expert_of_slot = self.expert_of_slot.copy()
        self.decisions.append({
            "step": step, "policy": "reinforcement", "state": state, "features": features,
            "action": ACTIONS[action], "explored": explored, "epsilon": epsilon,
            "q_values": self._q[state].tolist(),
            "swaps": [[s.layer, s.slot_a, s.slot_b] for s in swaps],
            "migration_cost": self.migration_cost * 2 * len(swaps), "reward": None})
        return swaps

    # -- checkpointing ---------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything the future decisions depend on (the ``decisions`` log is not part of it)."""
        rng = json.dumps(self._rng.bit_generator.state).encode()
        return {
            "policy": torch.tensor(POLICIES.index(self.policy)),
            "expert_of_slot": torch.from_numpy(self.expert_of_slot.astype(np.int64)),
            "load_estimate": torch.from_numpy(self._estimate.copy()),
            "load_estimate_at_decision": torch.from_numpy(self._estimate_at_decision.copy()),
            "counters": torch.tensor([self._steps_seen, self._num_decisions, self._pending_state,
                                      self._pending_steps], dtype=torch.int64),
            "q_values": torch.from_numpy(self._q.copy()),
            "q_visits": torch.from_numpy(self._visits.copy()),
            "pending_placements": torch.from_numpy(self._pending_placements.copy()),
            "pending_moved": torch.from_numpy(self._pending_moved.copy()),
            "pending_cost": torch.from_numpy(self._pending_cost.copy()),
            "rng_state": torch.tensor(list(rng), dtype=torch.uint8),
        }

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        missing = set(self.state_tensors()) - set(tensors)
        if missing:
            raise ValueError(f"load balancer state lacks {sorted(missing)}")
        policy = POLICIES[int(tensors["policy"])]
        if policy != self.policy:
            raise ValueError(f"state was saved by policy '{policy}', this balancer is "
                             f"'{self.policy}'")
        placement = tensors["expert_of_slot"].numpy().astype(np.int64)
        if placement.shape != self.expert_of_slot.shape:
            raise ValueError(f"saved placement is {list(placement.shape)}, this balancer has "
                             f"{list(self.expert_of_slot.shape)} (layers, experts)")
        self.expert_of_slot = placement.copy()
        self._estimate = tensors["load_estimate"].numpy().astype(np.float64).copy()
        self._estimate_at_decision = (
            tensors["load_estimate_at_decision"].numpy().astype(np.float64).copy())
        counters = [int(x) for x in tensors["counters"].tolist()]
        self._steps_seen, self._num_decisions, self._pending_state, self._pending_steps = counters
        self._q = tensors["q_values"].numpy().astype(np.float64).copy()
        self._visits = tensors["q_visits"].numpy().astype(np.int64).copy()
        self._pending_placements = tensors["pending_placements"].numpy().astype(np.int64).copy()
        self._pending_moved = tensors["pending_moved"].numpy().astype(np.int64).copy()
        self._pending_cost = tensors["pending_cost"].numpy().astype(np.float64).copy()
        self._rng.bit_generator.state = json.loads(bytes(tensors["rng_state"].tolist()).decode())
