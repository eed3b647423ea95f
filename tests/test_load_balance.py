"""The MoE expert load balancer: load arithmetic, policies, the learning agent against greedy and
against itself with learning off, determinism, checkpointing and the decision log."""

from __future__ import annotations

import io
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import TINY, train_metrics

from mcpar.controllers.compute.load_balance import (
    ExpertLoadBalancer,
    StepCosts,
    Swap,
    excess_load,
    imbalance,
    plan_layer,
    rank_loads,
)

REPO = Path(__file__).resolve().parents[1]
# The synthetic routing traces and the step's cost model are the bench's (bench/routing_traces.py).
sys.path.insert(0, str(REPO / "bench"))
from routing_traces import StepCostModel, make_trace, run_policy  # noqa: E402

# Prices measured by bench/moe_balance_costs.py (an expert of 1024 x 4096 with its Adam state;
# loopback gloo and an emulated 100 Mbit/s link), committed with the bench.
MEASURED = json.loads((REPO / "bench" / "data" / "moe_balance_costs.json").read_text())


def link_model(kind: str) -> StepCostModel:
    link = MEASURED["links"][kind]
    return StepCostModel(link["seconds_per_excess_assignment"], link["migration_s"])


def zipf_trace(steps: int, layers: int, experts: int, exponent: float, shift_every: int,
               seed: int, assignments: int = 65536) -> np.ndarray:
    """[steps, layers, experts] multinomial counts of a Zipf popularity whose ranking half
    re-permutes every `shift_every` steps (the bench's trace, small)."""
    rng = np.random.default_rng(seed)
    shares = np.arange(1, experts + 1, dtype=np.float64) ** -exponent
    shares /= shares.sum()
    rank_of = np.stack([rng.permutation(experts) for _ in range(layers)])
    counts = np.empty((steps, layers, experts))
    for step in range(steps):
        if step and step % shift_every == 0:
            for layer in range(layers):
                chosen = rng.choice(experts, experts // 2, replace=False)
                rank_of[layer, chosen] = rank_of[layer, rng.permutation(chosen)]
        for layer in range(layers):
            counts[step, layer] = rng.multinomial(assignments, shares[rank_of[layer]])
    return counts


def run(balancer: ExpertLoadBalancer, counts: np.ndarray, first_step: int = 0,
        model: StepCostModel | None = None) -> dict:
    """Feeds `counts` (with `model`'s prices as the measured costs, else none: modeled); returns
    the mean step cost and every step's swaps and placement."""
    costs, swaps, placements = [], [], []
    moved = balancer.experts_moved_last_step
    for offset, step_counts in enumerate(counts):
        imb = float(imbalance(step_counts, balancer.expert_of_slot, balancer.ep).mean())
        measured = None
        if model is not None:
            slots = np.take_along_axis(step_counts, balancer.expert_of_slot, axis=1)
            wait = float(excess_load(slots, balancer.ep).sum()) * model.seconds_per_assignment
            measured = StepCosts(model.seconds_per_assignment, wait, 0.0,
                                 model.migration_s * moved, moved)
        step_swaps = balancer.observe(first_step + offset, step_counts, measured)
        moved = 2 * len(step_swaps)
        costs.append(imb + balancer.migration_cost * moved)
        swaps.append(step_swaps)
        placements.append(balancer.expert_of_slot.copy())
    return {"cost": float(np.mean(costs)), "swaps": swaps, "placements": placements}


def test_rank_loads_and_imbalance_by_hand():
    counts = np.array([[10, 0, 5, 5], [4, 4, 4, 4]])
    identity = np.array([[0, 1, 2, 3], [0, 1, 2, 3]])
    assert rank_loads(counts, identity, 2).tolist() == [[10, 10], [8, 8]]
    np.testing.assert_allclose(imbalance(counts, identity, 2), [1.0, 1.0])
    # Experts 0 and 2 together on rank 0: 15 tokens against 5, mean 10.
    moved = np.array([[0, 2, 1, 3], [3, 2, 1, 0]])
    assert rank_loads(counts, moved, 2).tolist() == [[15, 5], [8, 8]]
    np.testing.assert_allclose(imbalance(counts, moved, 2), [1.5, 1.0])
    assert rank_loads(counts, identity, 4).tolist() == [[10, 0, 5, 5], [4, 4, 4, 4]]
    np.testing.assert_allclose(imbalance(counts, identity, 4), [2.0, 1.0])
    np.testing.assert_allclose(imbalance(np.zeros((1, 4)), identity[:1], 2), [1.0])
    # Excess = max - mean rank load, from counts already in slot order: [15, 5] -> 5.
    np.testing.assert_allclose(excess_load(np.array([[10, 5, 0, 5], [4, 4, 4, 4]]), 2), [5, 0])


def test_plan_layer_evens_out_the_hot_rank():
    load = np.array([9.0, 5.0, 3.0, 1.0, 1.0, 1.0])  # ranks of 3 slots: 17 and 3, mean 10
    swaps, imbs = plan_layer(load, np.arange(6), 2, max_swaps=4)
    # 9 <-> 1 gives ranks 9 and 11; no further swap lowers the 11 without lifting the 9 as high.
    assert swaps == [(0, 3)]
    np.testing.assert_allclose(imbs, [17 / 10, 11 / 10])
    placement = np.array([3, 4, 5, 0, 1, 2])  # the same loads, the hot rank now rank 1
    assert plan_layer(load, placement, 2, max_swaps=4)[0] == [(3, 0)]


def test_static_never_moves():
    counts = zipf_trace(60, 2, 16, 1.0, 1000, seed=0)
    balancer = ExpertLoadBalancer("static", 2, 16, 4, interval=5)
    result = run(balancer, counts)
    assert all(not s for s in result["swaps"])
    assert (balancer.expert_of_slot == np.arange(16)).all()
    assert balancer.decisions == []


def test_greedy_balances_a_stationary_skew_with_valid_swaps():
    experts, ep = 32, 4
    counts = zipf_trace(200, 2, experts, 0.6, 10**6, seed=1)
    # Horizon 10 steps: at 0.02 of a step per expert moved, sampling noise is not worth a swap.
    balancer = ExpertLoadBalancer("greedy", 2, experts, ep, discount=0.9)
    start = imbalance(counts[:20].mean(0), balancer.expert_of_slot, ep).mean()
    previous = balancer.expert_of_slot.copy()
    result = run(balancer, counts)
    for step_swaps, placement in zip(result["swaps"], result["placements"], strict=True):
        expected = previous.copy()
        for s in step_swaps:
            assert s.slot_a // (experts // ep) != s.slot_b // (experts // ep)
            expected[s.layer, [s.slot_a, s.slot_b]] = expected[s.layer, [s.slot_b, s.slot_a]]
        assert (placement == expected).all()
        # Each layer stays a permutation: every expert in exactly one slot, E/ep per rank.
        assert (np.sort(placement, axis=1) == np.arange(experts)).all()
        previous = placement
    end = imbalance(counts[-20:].mean(0), balancer.expert_of_slot, ep).mean()
    assert start > 1.3 and end < 1.1, (start, end)
    moved = sum(len(s) for s in result["swaps"])
    assert 0 < moved <= 2 * 20  # a stationary trace settles: no swaps for the noise
    assert len(balancer.decisions) == 20 and balancer.decisions[0]["action"] == "migrate"


def test_same_seed_same_decisions():
    counts = zipf_trace(300, 2, 32, 0.6, 100, seed=2)
    a = run(ExpertLoadBalancer("reinforcement", 2, 32, 4, seed=7), counts)
    b = run(ExpertLoadBalancer("reinforcement", 2, 32, 4, seed=7), counts)
    assert a["swaps"] == b["swaps"]
    assert all((x == y).all() for x, y in zip(a["placements"], b["placements"], strict=True))


@pytest.mark.parametrize("policy", ["greedy", "reinforcement"])
def test_restored_balancer_continues_identically(policy):
    counts = zipf_trace(500, 2, 32, 0.6, 100, seed=3)
    model = link_model("100mbit")
    original = ExpertLoadBalancer(policy, 2, 32, 4, seed=5)
    run(original, counts[:255], model=model)  # mid-interval: an interval's reward is pending
    if policy == "reinforcement":  # the agent has learned something worth restoring
        assert original.agent.scores.std() > 0
    buffer = io.BytesIO()
    torch.save(original.state_tensors(), buffer)
    buffer.seek(0)
    restored = ExpertLoadBalancer(policy, 2, 32, 4, seed=99)
    restored.load_state_tensors(torch.load(buffer))
    after_original = run(original, counts[255:], first_step=255, model=model)
    after_restored = run(restored, counts[255:], first_step=255, model=model)
    assert after_original["swaps"] == after_restored["swaps"]
    assert sum(len(s) for s in after_original["swaps"]) > 0
    assert (original.expert_of_slot == restored.expert_of_slot).all()
    for key, tensor in original.state_tensors().items():
        assert torch.equal(tensor, restored.state_tensors()[key]), key
    assert original.decisions[-1] == restored.decisions[-1]


# Traces and ranks small enough for a unit test (1500 steps, 32 experts over 4 ranks, 2 layers,
# 16384 assignments per layer and step), priced with the 100 Mbit/s link's measured costs.
SMALL = {"steps": 1500, "layers": 2, "experts": 32, "assignments": 16384, "seed": 0}


@pytest.mark.parametrize("trace", ["bursts", "drift"])
def test_learning_beats_greedy_and_the_agent_without_learning(trace):
    """The agent with learning beats greedy by >= 5%; the same agent with learning off (frozen
    initial values: it keeps greedy's rule; random: a random rule per decision) is >= 3% worse
    than with learning. Without learning the first two inequalities cannot both hold."""
    counts = make_trace(trace, SMALL["steps"], SMALL["layers"], SMALL["experts"],
                        assignments=SMALL["assignments"], seed=SMALL["seed"])
    model = link_model("100mbit")
    cost = {name: run_policy(policy, counts, 4, model, learning=learning)["mean_cost_s"]
            for name, policy, learning in (("greedy", "greedy", "on"),
                                           ("learned", "reinforcement", "on"),
                                           ("frozen", "reinforcement", "frozen"),
                                           ("random", "reinforcement", "random"))}
    assert cost["learned"] <= 0.95 * cost["greedy"], cost
    assert cost["frozen"] >= 1.03 * cost["learned"], cost
    assert cost["random"] >= 1.03 * cost["learned"], cost


def test_every_decision_logs_state_action_values_and_its_measured_reward():
    counts = zipf_trace(120, 2, 32, 0.6, 50, seed=4)
    model = link_model("loopback")
    for policy in ("greedy", "reinforcement"):
        balancer = ExpertLoadBalancer(policy, 2, 32, 4, seed=0)
        run(balancer, counts, model=model)
        assert len(balancer.decisions) == 12
        json.dumps(balancer.decisions)  # they go to load_balance.jsonl
        # Recompute the first decision's reward from the step costs fed to it: minus the
        # discounted cost (wait + all-to-all + migration) of the steps since the start.
        placement = np.tile(np.arange(32), (2, 1))
        expected = -sum(0.99 ** j * float(excess_load(np.take_along_axis(
            counts[j], placement, axis=1), 4).sum()) * model.seconds_per_assignment
                        for j in range(10))
        first = balancer.decisions[0]
        assert first["reward"] == pytest.approx(expected, rel=1e-12)
        for record in balancer.decisions:
            assert isinstance(record["reward"], float) and record["reward"] < 0
            assert {"state", "action", "values", "swaps", "step_costs"} <= set(record)
    # The agent priced its moves with the measured migration time once it had one.
    assert balancer.migration_s_per_expert() == pytest.approx(model.migration_s)
    assert set(balancer.decisions[-1]["values"]["discounted_cost_s"]) >= {"H100_fast",
                                                                         "H30_slow"}


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="unknown load-balancing policy"):
        ExpertLoadBalancer("round_robin", 1, 8, 2)
    with pytest.raises(ValueError, match="10 experts do not divide over 4"):
        ExpertLoadBalancer("greedy", 1, 10, 4)
    balancer = ExpertLoadBalancer("greedy", 2, 8, 2)
    with pytest.raises(ValueError, match=r"counts must be \[layers, experts\] = \[2, 8\]"):
        balancer.observe(0, np.ones((1, 8)))
    with pytest.raises(ValueError, match="finite token counts"):
        balancer.observe(0, -np.ones((2, 8)))
    with pytest.raises(ValueError, match="must both be"):
        rank_loads(np.ones((2, 8)), np.zeros((1, 8), dtype=int), 2)
    with pytest.raises(ValueError, match="saved by policy 'greedy'"):
        ExpertLoadBalancer("reinforcement", 2, 8, 2).load_state_tensors(balancer.state_tensors())
    with pytest.raises(ValueError, match="learning must be one of"):
        ExpertLoadBalancer("reinforcement", 2, 8, 2, learning="sometimes")
    with pytest.raises(ValueError, match=r"saved agent 'estimates' is \[2, 2, 8\]"):
        wider = ExpertLoadBalancer("reinforcement", 2, 16, 2)
        state = ExpertLoadBalancer("reinforcement", 2, 8, 2).state_tensors()
        state["expert_of_slot"] = torch.from_numpy(wider.expert_of_slot.copy())
        wider.load_state_tensors(state)
    assert Swap(0, 1, 5) == Swap(layer=0, slot_a=1, slot_b=5)


@pytest.mark.slow
def test_training_logs_rewards_made_of_measured_costs(tmp_path):
    """A 2-rank MoE job with the learning balancer on measured costs (the default): every step
    logs what it measured, every decision its reward, and a reward is minus the discounted sum
    of the measured step costs of its interval (the numbers the trainer logged per step)."""
    run_dir = tmp_path / "run"
    records = train_metrics(run_dir, 2, [
        *TINY, "model.kind=moe", "model.num_experts=4", "model.top_k=2",
        "parallelism.data=2", "parallelism.experts=2", "training.steps=9",
        "controllers.compute.scheduler=reinforcement", "controllers.compute.balance_interval=3"])
    costs = [r["moe"]["step_costs"] for r in records]
    assert all(c["expert_s_per_assignment"] > 0 and c["all_to_all_s"] > 0
               and c["load_wait_s"] >= 0 for c in costs)
    decisions = [json.loads(line) for line in (run_dir / "load_balance.jsonl").read_text()
                 .splitlines()]
    assert [d["step"] for d in decisions] == [2, 5, 8]
    for k, decision in enumerate(decisions):
        assert decision["step_costs"] == costs[3 * k + 2]
        expected = -sum(0.99 ** j * (c["load_wait_s"] + c["all_to_all_s"] + c["migration_s"])
                        for j, c in enumerate(costs[3 * k:3 * k + 3]))
        assert decision["reward"] == pytest.approx(expected, rel=1e-9)
        assert {"state", "action", "values"} <= set(decision)


def test_never_move_is_scored_from_the_current_placement():
    """Staying keeps the placement the experts are in at the decision, not the one they started
    in: here the start (identity) is balanced for the routing and the current placement is not,
    so staying must cost the current placement's wait and lose the lead to a rule that moves."""
    from mcpar.controllers.compute.placement_agent import STAY, PlacementAgent

    agent = PlacementAgent(1, 4, 2, discount=0.99, max_swaps=2, seed=0)
    agent.leader = STAY
    counts = np.array([[10.0, 1.0, 10.0, 1.0]])  # identity: ranks 11 and 11
    current = np.array([[0, 2, 1, 3]])  # ranks 20 and 2
    agent.observe(counts, True, 1.0, 1.0)
    placement, swaps, _ = agent.decide(current, 1.0, 1.0)
    assert np.array_equal(agent.shadows[STAY], current)
    for _ in range(9):
        agent.observe(counts, False, 1.0, 1.0)
    # Staying cost the current placement's excess, 9 assignments a step; the start cost nothing.
    assert agent.scores[STAY] > 0 and agent.scores.min() == 0
    placement, swaps, record = agent.decide(placement, 1.0, 1.0)
    assert record["action"]["rule"] != "H0_fast" and swaps
    assert excess_load(np.take_along_axis(counts, placement, axis=1), 2)[0] == 0


def test_staying_is_not_credited_with_a_moving_leaders_placement():
    """While a moving rule leads, the current placement was bought by its migrations: staying's
    shadow keeps the placement it last held instead of taking that one for free."""
    from mcpar.controllers.compute.placement_agent import STAY, PlacementAgent

    agent = PlacementAgent(1, 4, 2, discount=0.99, max_swaps=2, seed=0)
    agent.leader = STAY + 1  # a moving rule
    counts = np.array([[10.0, 1.0, 10.0, 1.0]])
    agent.observe(counts, True, 1.0, 1.0)
    held = agent.shadows[STAY].copy()
    agent.decide(np.array([[0, 2, 1, 3]]), 1.0, 1.0)
    assert np.array_equal(agent.shadows[STAY], held)


def test_a_move_is_charged_over_the_objectives_horizon_not_at_once():
    """A rule that moves owes its migration seconds and pays 1 - discount of what it still owes
    each step: right after a move it is charged that share, and in all the full price."""
    from mcpar.controllers.compute.placement_agent import STAY, PlacementAgent

    agent = PlacementAgent(1, 4, 2, discount=0.99, max_swaps=2, seed=0)
    counts = np.array([[10.0, 10.0, 1.0, 1.0]])  # identity: ranks 20 and 2, one swap evens it
    agent.observe(counts, True, 1.0, 1.0)
    agent.decide(np.array([[0, 1, 2, 3]]), 1.0, 3.0)
    movers = [r for r in range(len(agent.scores)) if r != STAY]
    before = agent.scores.copy()
    agent.observe(counts, False, 1.0, 3.0)
    for r in movers:  # one swap = 2 experts at 3 s: 6 s owed, 1% of it charged now, no wait
        assert agent.scores[r] - 0.998 * before[r] == pytest.approx(0.06), r
        assert agent.debts[r] == pytest.approx(5.94), r
    for _ in range(3000):
        agent.observe(counts, False, 1.0, 3.0)
    assert agent.debts[movers].max() < 1e-9
    assert agent.debts[STAY] == 0.0


def test_the_first_rule_followed_is_the_shortest_horizon():
    """Before any rule has a record the agent follows the rule whose moves must pay back within
    10 steps; without learning it is greedy's rule."""
    from mcpar.controllers.compute.placement_agent import PlacementAgent, rule_name

    assert rule_name(PlacementAgent(1, 4, 2, discount=0.99, max_swaps=2, seed=0).leader) \
        == "H10_fast"
    frozen = PlacementAgent(1, 4, 2, discount=0.99, max_swaps=2, seed=0, learning="frozen")
    assert rule_name(frozen.leader) == "H100_fast"


def test_an_agent_saved_before_amortizing_is_refused_by_name():
    balancer = ExpertLoadBalancer("reinforcement", 2, 8, 2, seed=0)
    run(balancer, zipf_trace(40, 2, 8, 0.8, 20, seed=1))
    state = {k: v for k, v in balancer.state_tensors().items() if k != "agent/debts"}
    with pytest.raises(ValueError, match="agent/debts"):
        ExpertLoadBalancer("reinforcement", 2, 8, 2, seed=0).load_state_tensors(state)
