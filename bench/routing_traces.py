"""Non-stationary routing traces and a measured-cost model of the step, to try placement
policies offline (bench/moe_balance.py and tests/test_load_balance.py), on the same routing for
every policy.

Each trace is ``[steps, layers, experts]`` token-expert assignments per step, sampled from a
multinomial over per-expert shares (so counts carry a real step's sampling noise). What moves the
shares over time is what differs, and each pattern is one a real router shows:

- ``zipf_shift``: Zipf(``exponent``) popularity over a ranking of the experts; the ranking is
  redrawn at random times (segments of geometric length, mean ``mean_segment`` steps). The hot set
  changes abruptly and then stays, as when the data mixture changes phase (a curriculum, a new
  shard of another domain) and different specialists take over.
- ``bursts``: a mild, fixed Zipf base popularity, plus bursts: at each step, with probability
  ``burst_rate`` per layer, ``burst_experts`` random experts jointly receive an extra
  ``burst_share`` of the assignments for a geometric number of steps (mean ``burst_len``). Batches
  drawn from one source (a code file split over several sequences, a rare language) light up a
  few specialists for the few steps their documents fill the batches, then routing returns.
- ``drift``: the experts' log-popularities follow an Ornstein-Uhlenbeck walk around 0
  (stationary spread ``spread``, correlation time ``tau`` steps): a slow drift of router and
  experts adapting to each other, without sudden changes.

None of them is shaped around a policy: the parameters are round values of the phenomenon's size
(how skewed, how long it lasts), stated by the bench in its JSON, and every policy sees the same
counts. The recorded routing of the real model on the default corpus is the fourth trace
(``bench/data``), loaded by the bench.

The cost model (``StepCostModel``): the step's expert phase costs ``seconds_per_assignment`` per
excess assignment on the most loaded rank (its expert compute and the extra all-to-all bytes it
receives; the mean rank's share is the same under every placement and is left out), and a moved
expert ``migration_s`` (its weights and optimizer state over the link). Both are measured (the
bench's ``measure_costs``); this module never invents them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from mcpar.controllers.compute.balance_math import excess_load
from mcpar.controllers.compute.load_balance import ExpertLoadBalancer, StepCosts

TRACES = ("zipf_shift", "bursts", "drift")


def zipf_shares(num_experts: int, exponent: float) -> np.ndarray:
    """Share of the expert of each popularity rank, hottest first."""
    shares = np.arange(1, num_experts + 1, dtype=np.float64) ** -exponent
    return shares / shares.sum()


def zipf_shift(steps: int, layers: int, experts: int, *, assignments: int, seed: int,
               exponent: float = 0.8, mean_segment: float = 150.0) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(seed))
    zipf = zipf_shares(experts, exponent)
    rank_of = np.stack([rng.permutation(experts) for _ in range(layers)])
    out = np.empty((steps, layers, experts), dtype=np.int64)
    for step in range(steps):
        for layer in range(layers):
            if step and rng.random() < 1.0 / mean_segment:
                rank_of[layer] = rng.permutation(experts)
            out[step, layer] = rng.multinomial(assignments, zipf[rank_of[layer]])
    return out


def bursts(steps: int, layers: int, experts: int, *, assignments: int, seed: int,
           exponent: float = 0.5, burst_rate: float = 0.04, burst_experts: int = 2,
           burst_share: float = 0.3, burst_len: float = 5.0) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(seed))
    zipf = zipf_shares(experts, exponent)
    base = np.stack([zipf[rng.permutation(experts)] for _ in range(layers)])
    remaining = np.zeros(layers, dtype=np.int64)  # steps left in each layer's burst
    hot = np.zeros((layers, burst_experts), dtype=np.int64)
    out = np.empty((steps, layers, experts), dtype=np.int64)
    for step in range(steps):
        for layer in range(layers):
            if remaining[layer] == 0 and rng.random() < burst_rate:
                remaining[layer] = rng.geometric(1.0 / burst_len)
                hot[layer] = rng.choice(experts, burst_experts, replace=False)
            shares = base[layer] * (1.0 - burst_share) if remaining[layer] else base[layer]
            if remaining[layer]:
                shares = shares.copy()
                shares[hot[layer]] += burst_share / burst_experts
                remaining[layer] -= 1
            out[step, layer] = rng.multinomial(assignments, shares / shares.sum())
    return out


def drift(steps: int, layers: int, experts: int, *, assignments: int, seed: int,
          spread: float = 0.8, tau: float = 300.0) -> np.ndarray:
    rng = np.random.Generator(np.random.PCG64(seed))
    logits = rng.normal(0.0, spread, (layers, experts))
    pull = 1.0 / tau
    noise = spread * np.sqrt(2.0 * pull)  # keeps the stationary spread
    out = np.empty((steps, layers, experts), dtype=np.int64)
    for step in range(steps):
        logits += -pull * logits + noise * rng.normal(size=logits.shape)
        shares = np.exp(logits)
        shares /= shares.sum(axis=1, keepdims=True)
        for layer in range(layers):
            out[step, layer] = rng.multinomial(assignments, shares[layer])
    return out


def make_trace(name: str, steps: int, layers: int, experts: int, *, assignments: int,
               seed: int) -> np.ndarray:
    makers = {"zipf_shift": zipf_shift, "bursts": bursts, "drift": drift}
    if name not in makers:
        raise ValueError(f"unknown trace '{name}'; use one of {TRACES}")
    return makers[name](steps, layers, experts, assignments=assignments, seed=seed)


@dataclass(frozen=True)
class StepCostModel:
    """Measured prices: seconds per excess assignment on the straggler, seconds per moved
    expert."""

    seconds_per_assignment: float
    migration_s: float

    def greedy_migration_cost(self, counts: np.ndarray, ep: int) -> float:
        """The migration cost in greedy's unit (a fraction of a balanced expert phase), for the
        trace's mean step: greedy is configured with the right fixed price."""
        phase = float(counts.sum(axis=(1, 2)).mean()) / ep * self.seconds_per_assignment
        return self.migration_s / phase


def run_policy(policy: str, counts: np.ndarray, ep: int, model: StepCostModel, *,
               interval: int = 10, seed: int = 0, learning: str = "on",
               discount: float = 0.99) -> dict[str, float | int]:
    """Feeds the trace to a balancer with the model's costs as its measurements; returns the
    mean step cost (wait on the slowest rank + migrations decided in that step, seconds)."""
    layers, experts = counts.shape[1:]
    balancer = ExpertLoadBalancer(policy, layers, experts, ep, interval=interval, seed=seed,
                                  migration_cost=model.greedy_migration_cost(counts, ep),
                                  discount=discount, learning=learning)
    rate = model.seconds_per_assignment
    waits, moved_total, moved_prev = np.empty(len(counts)), 0, 0
    for step, step_counts in enumerate(counts):
        slot_counts = np.take_along_axis(step_counts, balancer.expert_of_slot, axis=1)
        waits[step] = float(excess_load(slot_counts, ep).sum()) * rate
        costs = StepCosts(rate, float(waits[step]), 0.0, model.migration_s * moved_prev,
                          moved_prev)
        moved_prev = 2 * len(balancer.observe(step, step_counts, costs))
        moved_total += moved_prev
    migration = moved_total * model.migration_s
    return {"mean_cost_s": float(waits.mean()) + migration / len(counts),
            "mean_wait_s": float(waits.mean()), "mean_migration_s": migration / len(counts),
            "experts_moved": moved_total, "decisions": len(balancer.decisions)}
