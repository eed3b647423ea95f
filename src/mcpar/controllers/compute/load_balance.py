"""Expert load balancer: where each MoE expert lives, re-decided as routing drifts.

Why hand-written
    With expert parallelism every MoE layer spreads its E experts over ``ep`` ranks, E/ep slots
    per rank (slot s on rank s // (E/ep)). Routing is skewed and the skew drifts during training,
    so the rank holding the hot experts stalls every step. No installable library re-places the
    experts of a PyTorch MoE at run time: DeepSpeed-MoE and Megatron-Core balance with auxiliary
    losses, capacity factors and token dropping, which change what the model computes, not where
    experts live, and the systems that migrate experts exist as research prototypes. So the
    decision lives here, in numpy (the load arithmetic in ``balance_math.py``).

Objective (the seed's)
    Minimize the discounted sum of step costs ``C_load + C_comm``, gamma = ``discount`` per step
    (0.99 by default: an effective horizon of 1 / (1 - gamma) = 100 steps, about the life of a
    skew worth moving experts for; greedy looks that far ahead, the agent's rules 10 to 300):

    - ``C_load``: the wait on the slowest expert rank, max - mean of the ranks' expert compute
      time in the step;
    - ``C_comm``: the expert all-to-alls of the step plus the wall time of the migrations.

    In a training job these are measured every step (``StepCosts``, filled by the
    ``MoERoutingController``: per expert-rank compute time of the expert layers, the all-to-all
    time the Communicator timed, the wall time of every migration) and are the same on every
    rank (all-reduced). Where nothing is measured (``costs=None``: offline replays, or the
    deterministic ``balance_costs: modeled`` setting) the step is modeled in units of a balanced
    expert phase: ``C_load`` = sum over layers of (max - mean rank load) / sum of mean rank loads
    (the mean over layers of max/mean, minus 1, when every layer routes as many tokens), and a
    migrated expert costs ``migration_cost`` of a step.

    Each decision's record (``decisions``, written to ``load_balance.jsonl`` by the trainer)
    carries ``reward``: minus the discounted cost of the interval that the decision closes,
    ``-sum_j gamma**j cost_j`` over the steps since the previous decision (since the start for
    the first one), measured or modeled as above; never null.

Policies (``controllers.compute.scheduler``)
    ``static``: expert e stays in slot e.

    ``greedy``: a fixed rule. An exponential moving average (EMA, weight 0.2) of each expert's
    tokens is the load estimate. Every ``interval`` steps a plan is built per layer
    (``plan_layer``: repeatedly, the swap that best evens out the most loaded rank and another);
    the plan's prefix that maximizes ``1/(1 - discount) x predicted imbalance reduction -
    migration_cost x experts moved`` is applied, ``migration_cost`` being the configured,
    fixed fraction of a step that moving one expert is assumed to cost.

    ``reinforcement``: the learning agent of ``placement_agent.py``: it runs greedy's planner
    under several assumptions (how long a skew lasts, a fast or a slow load estimate) in shadow
    on the real counts, charges each the measured cost it would have paid, follows the cheapest,
    and prices moves with the measured migration time. Its docstring says why that form.

Determinism
    Every rank runs its own balancer on the same (all-reduced) counts and measurements and must
    take the same decisions without talking: everything is numpy arithmetic in a fixed order
    with one seeded PCG64 generator, and ``state_tensors`` holds all of it, so a restored
    balancer continues with exactly the decisions the original would have taken.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
import torch

from mcpar.controllers.compute.balance_math import (
    Swap,
    excess_load,
    imbalance,
    plan_layer,
    rank_loads,
)
from mcpar.controllers.compute.placement_agent import PlacementAgent

__all__ = ["POLICIES", "ExpertLoadBalancer", "StepCosts", "Swap", "excess_load", "imbalance",
           "plan_layer", "rank_loads"]

POLICIES = ("static", "greedy", "reinforcement")
RATE_WEIGHT, MIGRATION_WEIGHT = 0.1, 0.3  # EMA weights of the measured cost rates


@dataclass(frozen=True)
class StepCosts:
    """What one step's expert phase cost (seconds), the same on every rank."""

    expert_s_per_assignment: float  # expert compute per routed (token, expert) assignment
    load_wait_s: float  # max - mean of the expert ranks' compute time: the wait on the slowest
    all_to_all_s: float  # the expert all-to-alls
    migration_s: float  # wall time of the migrations decided at the end of the previous step
    experts_migrated: int  # how many experts those migrations moved

    @property
    def total_s(self) -> float:
        return self.load_wait_s + self.all_to_all_s + self.migration_s


class ExpertLoadBalancer:
    """Observes tokens per expert (and what the step cost) each step; decides expert swaps every
    ``interval`` steps."""

    def __init__(self, policy: str, num_layers: int, num_experts: int, ep: int, *,
                 interval: int = 10, migration_cost: float = 0.02, discount: float = 0.99,
                 seed: int = 0, ema_weight: float = 0.2,
                 max_swaps: int | None = None, learning: str = "on"):
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
        self.agent = (PlacementAgent(num_layers, num_experts, ep, discount=discount,
                                     max_swaps=self.max_swaps, seed=seed, learning=learning)
                      if policy == "reinforcement" else None)
        self._estimate = np.zeros((num_layers, num_experts))
        self._steps_seen = 0
        self._num_decisions = 0
        self._moved_last_step = 0
        self._interval_steps = 0
        self._interval_cost = 0.0
        self._rate_s = -1.0  # measured seconds per excess assignment (EMA); -1: none yet
        self._migration_s = -1.0  # measured seconds per migrated expert (EMA); -1: none yet
        self.last_costs: StepCosts | None = None

    @property
    def experts_moved_last_step(self) -> int:
        """Experts the swaps returned by the last ``observe`` moved (2 per swap)."""
        return self._moved_last_step

    # -- costs -----------------------------------------------------------------------------------

    def modeled_costs(self, counts: np.ndarray) -> StepCosts:
        """The step in units of a balanced expert phase (see the module docstring)."""
        phase = float(counts.sum()) / self.ep
        rate = 1.0 / phase if phase > 0 else 0.0
        slot_counts = np.take_along_axis(counts, self.expert_of_slot, axis=1)
        wait = float(excess_load(slot_counts, self.ep).sum()) * rate
        moved = self._moved_last_step
        return StepCosts(rate, wait, 0.0, self.migration_cost * moved, moved)

    def _update_rates(self, costs: StepCosts, counts: np.ndarray) -> None:
        if self._rate_s < 0:
            self._rate_s = costs.expert_s_per_assignment
        else:
            self._rate_s += RATE_WEIGHT * (costs.expert_s_per_assignment - self._rate_s)
        if costs.experts_migrated > 0:
            per_expert = costs.migration_s / costs.experts_migrated
            if self._migration_s < 0:
                self._migration_s = per_expert
            else:
                self._migration_s += MIGRATION_WEIGHT * (per_expert - self._migration_s)

    def migration_s_per_expert(self) -> float:
        """Measured when a migration has been; until then the configured fraction of a balanced
        expert phase, priced at the measured rate."""
        if self._migration_s >= 0:
            return self._migration_s
        phase = float(self._estimate.sum()) / self.ep
        return self.migration_cost * phase * max(self._rate_s, 0.0)

    # -- observing -------------------------------------------------------------------------------

    def observe(self, step: int, counts: np.ndarray, costs: StepCosts | None = None) -> list[Swap]:
        """counts: [L, E] tokens per expert routed in this step; costs: what the step cost, as
        measured (None: modeled). Returns the swaps to apply now (already applied to
        ``expert_of_slot``)."""
        counts = np.asarray(counts, dtype=np.float64)
        if counts.shape != (self.num_layers, self.num_experts):
            raise ValueError(f"counts must be [layers, experts] = "
                             f"[{self.num_layers}, {self.num_experts}], got {list(counts.shape)}")
        if not np.isfinite(counts).all() or (counts < 0).any():
            raise ValueError("counts must be finite token counts >= 0")
        if costs is None:
            costs = self.modeled_costs(counts)
        self.last_costs = costs
        self._interval_cost += self.discount ** self._interval_steps * costs.total_s
        self._interval_steps += 1
        self._update_rates(costs, counts)
        first = self._steps_seen == 0
        if first:
            self._estimate = counts.copy()
        else:
            self._estimate += self.ema_weight * (counts - self._estimate)
        if self.agent is not None:
            self.agent.observe(counts, first, max(self._rate_s, 0.0),
                               self.migration_s_per_expert())
        self._steps_seen += 1
        self._moved_last_step = 0
        if self.policy == "static" or self._steps_seen % self.interval:
            return []
        if self.agent is not None:
            self.expert_of_slot, triples, record = self.agent.decide(
                self.expert_of_slot, max(self._rate_s, 0.0), self.migration_s_per_expert())
            swaps = [Swap(*t) for t in triples]
        else:
            record, swaps = self._decide_greedy()
        self._moved_last_step = 2 * len(swaps)
        self.decisions.append({
            "step": step, "policy": self.policy, **record,
            "swaps": [[s.layer, s.slot_a, s.slot_b] for s in swaps],
            "reward": -self._interval_cost, "reward_steps": self._interval_steps,
            "discount": self.discount, "step_costs": asdict(costs)})
        self._interval_cost, self._interval_steps = 0.0, 0
        self._num_decisions += 1
        return swaps

    # -- greedy ----------------------------------------------------------------------------------

    def _greedy_prefix(self, imbalances: list[float]) -> int:
        """The number of plan swaps worth their migration; 0 when none is."""
        values = [self.horizon * (imbalances[0] - imb) / self.num_layers
                  - 2 * self.migration_cost * k for k, imb in enumerate(imbalances)]
        return int(np.argmax(values))  # first maximum: the fewest swaps among equals

    def _decide_greedy(self) -> tuple[dict, list[Swap]]:
        before = float(imbalance(self._estimate, self.expert_of_slot, self.ep).mean())
        placement = self.expert_of_slot.copy()
        moved, applied = 0, []
        for layer in range(self.num_layers):
            swaps, imbs = plan_layer(self._estimate[layer], placement[layer], self.ep,
                                     self.max_swaps)
            k = self._greedy_prefix(imbs)
            for a, b in swaps[:k]:
                placement[layer, [a, b]] = placement[layer, [b, a]]
                applied.append(Swap(layer, a, b))
            moved += 2 * k
        self.expert_of_slot = placement
        after = float(imbalance(self._estimate, placement, self.ep).mean())
        return {"state": {"predicted_imbalance": before},
                "action": "migrate" if moved else "hold",
                "values": {"predicted_gain": self.horizon * (before - after),
                           "migration_cost": self.migration_cost * moved}}, applied

    # -- checkpointing ---------------------------------------------------------------------------

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Everything the future decisions depend on (the ``decisions`` log is not part of it)."""
        out = {
            "policy": torch.tensor(POLICIES.index(self.policy)),
            "expert_of_slot": torch.from_numpy(self.expert_of_slot.astype(np.int64)),
            "load_estimate": torch.from_numpy(self._estimate.copy()),
            "counters": torch.tensor([self._steps_seen, self._num_decisions,
                                      self._moved_last_step, self._interval_steps],
                                     dtype=torch.int64),
            "cost_state": torch.tensor([self._interval_cost, self._rate_s, self._migration_s],
                                       dtype=torch.float64),
        }
        if self.agent is not None:
            out.update({f"agent/{k}": v for k, v in self.agent.state_tensors().items()})
        return out

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        if "policy" in tensors and POLICIES[int(tensors["policy"])] != self.policy:
            raise ValueError(f"state was saved by policy '{POLICIES[int(tensors['policy'])]}', "
                             f"this balancer is '{self.policy}'")
        missing = set(self.state_tensors()) - set(tensors)
        if missing:
            raise ValueError(f"load balancer state lacks {sorted(missing)} (saved by an older "
                             "version of the balancer?)")
        placement = tensors["expert_of_slot"].numpy().astype(np.int64)
        if placement.shape != self.expert_of_slot.shape:
            raise ValueError(f"saved placement is {list(placement.shape)}, this balancer has "
                             f"{list(self.expert_of_slot.shape)} (layers, experts)")
        self.expert_of_slot = placement.copy()
        self._estimate = tensors["load_estimate"].numpy().astype(np.float64).copy()
        counters = [int(x) for x in tensors["counters"].tolist()]
        (self._steps_seen, self._num_decisions, self._moved_last_step,
         self._interval_steps) = counters
        self._interval_cost, self._rate_s, self._migration_s = (
            float(x) for x in tensors["cost_state"].tolist())
        if self.agent is not None:
            self.agent.load_state_tensors({k[len("agent/"):]: v for k, v in tensors.items()
                                           if k.startswith("agent/")})

