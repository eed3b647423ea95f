"""Zero-bubble schedules: the backward split into B and W, the schedules' orders and costs, and
loss parity of every split schedule with 1F1B on real worker processes (DESIGN.md §5)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import run_mcpar, sets, train_metrics
from torch import nn

import mcpar.controllers.registered  # noqa: F401  (registers the schedules)
from mcpar.controllers.compute import zero_bubble, zero_bubble_v
from mcpar.controllers.compute.schedules import step_tasks
from mcpar.metrics import read_metrics
from mcpar.parallel.tasks import TaskKind
from mcpar.parallel.weight_grad import WeightGradStore, split_weight_grads
from mcpar.registry.schedule import SCHEDULES, Action, ActionCosts
from mcpar.registry.schedule_replay import critical_path, order_graph, replay

SPLIT = [s.name for s in SCHEDULES if s.splits_backward]
# What a schedule needs beside its name (the reference, 1F1B, runs one stage per rank).
NEEDS = {"zbv": ["parallelism.virtual_stages=2"]}


def test_the_split_schedules_are_registered() -> None:
    assert {"zb_h1", "zb_h2", "zbv"} <= set(SPLIT)


# --- the orders --------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["zb_h1", "zb_h2"])
@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 4), (4, 2), (4, 8), (8, 16)])
def test_every_rank_runs_each_task_once_with_w_after_its_b(name: str, pp: int, m: int) -> None:
    schedule = SCHEDULES.get(name)
    for rank in range(pp):
        actions = schedule.actions(rank, pp, m, 1)
        for kind in "FBW":
            assert sorted(a.micro for a in actions if a.kind == kind) == list(range(m))
        order = {(a.kind, a.micro): i for i, a in enumerate(actions)}
        for k in range(m):
            assert order[("F", k)] < order[("B", k)] < order[("W", k)]
    # The replay of every rank together completes (it raises on a deadlock).
    assert replay(schedule, [3.0] * pp, m, 1, 1 / 3) > 0


def test_zb_h1_reaches_its_theory_and_keeps_1f1b_first_rank_memory() -> None:
    """F = B = W (1 each): ZB-H1's step is 3m + p - 1, a bubble of (p-1)/(3m+p-1), against
    1F1B's (m + p - 1) * 3; its peak in flight on every rank is 1F1B's first rank's."""
    h1, one = SCHEDULES.get("zb_h1"), SCHEDULES.get("1f1b")
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        assert replay(h1, [3.0] * pp, m, 1, 1 / 3) == pytest.approx(3 * m + pp - 1)
        assert replay(one, [3.0] * pp, m, 1, 1 / 3) == pytest.approx(3 * (m + pp - 1))
        assert max(h1.in_flight(pp, r, m, 1) for r in range(pp)) == \
            max(one.in_flight(pp, r, m, 1) for r in range(pp)) == min(pp, m)


def test_messages_on_the_critical_path_of_each_split_schedule() -> None:
    """What a message's cost adds to a step at F = B = W: ZB-H1's critical path crosses
    4(p - 1) messages (at 1F1B's memory the first rank waits for its first B's round trip, and
    the last rank for the forward that lets the first rank start), ZB-H2's p - 1, ZBV's
    3(p - 1), whatever m."""
    x = 1e-3  # a message, in forwards
    for name, hops in (("zb_h1", 4), ("zb_h2", 1), ("zbv", 3)):
        schedule = SCHEDULES.get(name)
        v = 2 if name == "zbv" else 1
        for pp, m in [(4, 8), (4, 16), (8, 16)]:
            orders = [schedule.actions(r, pp, m, v) for r in range(pp)]
            graph = order_graph(orders, lambda c, r, s=schedule, p=pp, v=v: s.stage_of(c, r, p, v),
                                pp, pp * v - 1, name)
            free, priced = (critical_path(graph, lambda r, kind: 1.0, lat) for lat in (0.0, x))
            assert (priced - free) / x == pytest.approx(hops * (pp - 1)), (name, pp, m)


def test_zbv_ends_a_synchronized_step_at_its_floor() -> None:
    """Every chunk action one unit: the rank of the V's turn receives its first input only after
    p - 1 chunk forwards, and every rank runs 6m actions, so no V order ends a step that every
    rank reaches together before 6m + p - 1 units (5.9% idle at p = 4, m = 8); mcpar's does."""
    for pp, m in [(2, 4), (4, 8), (4, 16), (8, 16)]:
        units = zero_bubble_v.v_step_units(zero_bubble_v.v_orders(pp, m), pp, 0.0)
        assert units == 6 * m + pp - 1, (pp, m)


def test_zb_h2_fills_the_waits_a_costlier_b_opens() -> None:
    """B = 1.4 F, W = 0.6 F: ZB-H2 stays within 3% of the bound (p-1) F + m (F + B + W), where
    ZB-H1 loses 8% or more; at F = B = W both are at the bound. H2 holds at most 2p - 1."""
    h1, h2 = SCHEDULES.get("zb_h1"), SCHEDULES.get("zb_h2")
    for pp, m in [(4, 8), (8, 16)]:
        bound = (pp - 1) + 3 * m
        assert replay(h2, [3.0] * pp, m, 1, 1 / 3, weight_grad_share=0.3) <= 1.03 * bound
        assert replay(h1, [3.0] * pp, m, 1, 1 / 3, weight_grad_share=0.3) >= 1.08 * bound
        assert replay(h2, [3.0] * pp, m, 1, 1 / 3) == pytest.approx(bound)
        assert max(h2.in_flight(pp, r, m, 1) for r in range(pp)) == 2 * pp - 1


def assert_complete_v(orders: tuple[tuple[Action, ...], ...], pp: int, m: int) -> None:
    """Each task once, F and B in micro-batch order, a W after its B, at most 2p chunk
    activations held (counted until W)."""
    for rank, order in enumerate(orders):
        for chunk in (0, 1):
            for kind in "FBW":
                micro = [a.micro for a in order if a.kind == kind and a.chunk == chunk]
                assert sorted(micro) == list(range(m)), (rank, chunk, kind)
                if kind != "W":
                    assert micro == list(range(m))
        at = {(a.kind, a.chunk, a.micro): i for i, a in enumerate(order)}
        assert all(at[("F", c, k)] < at[("B", c, k)] < at[("W", c, k)]
                   for c in (0, 1) for k in range(m))
    assert max(zero_bubble.held_peaks(orders)) <= 2 * pp


def v_stage_of(pp: int):  # noqa: ANN201
    return lambda chunk, rank: zero_bubble_v.v_stage(chunk, rank, pp)


# Measured costs where W is cheaper than F and B dearer (one chunk's actions; 0.1 F a message).
UNEVEN = (1.0, 1.2, 0.5, 0.1)


@pytest.mark.parametrize(("pp", "m"), [(2, 1), (2, 4), (3, 5), (4, 2), (4, 8), (5, 17), (8, 16)])
def test_every_zbv_order_is_complete_and_the_shortest_at_its_costs_is_kept(pp: int,
                                                                         m: int) -> None:
    """The phased and the greedy V orders, and the orders at unit and at uneven costs: each
    complete, no deadlock (the replay raises), at most 2p chunk activations held; the kept one
    replays no longer at its costs than the phased or the greedy one."""
    unit = ActionCosts.uniform(pp, 1.0, 1.0, 1.0, zero_bubble_v.MESSAGE_LATENCY)
    uneven = ActionCosts.uniform(pp, *UNEVEN)
    phased, greedy = zero_bubble_v.v_phased_orders(pp, m), zero_bubble_v.v_greedy_orders(pp, m)
    for orders in (phased, greedy, zero_bubble_v.v_orders(pp, m),
                   zero_bubble_v.costed_v_orders(pp, m, uneven)):
        assert_complete_v(orders, pp, m)
    for costs, kept in ((unit, zero_bubble_v.v_orders(pp, m)),
                        (uneven, zero_bubble_v.costed_v_orders(pp, m, uneven))):
        span = zero_bubble.costed_span(kept, pp, v_stage_of(pp), costs)
        assert span <= min(zero_bubble.costed_span(o, pp, v_stage_of(pp), costs)
                           for o in (phased, greedy)) + 1e-9


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (3, 5), (4, 8), (5, 17), (8, 16)])
def test_held_limits_keep_the_orders_complete_and_within_them(pp: int, m: int) -> None:
    """The MemoryController's bound (``held_limits``) on the rank with the head: ZB-H1's last
    rank one micro-batch under 1F1B's first (its last W's run a backward sooner), ZBV's first
    rank one chunk activation under 2p. Each bounded order is complete, holds within its
    limits, and replays no deadlock; at F = B = W ZB-H1 pays one unit (3m + p), and the V
    stays within 6% of its unbounded order at unit costs with latency."""
    h1 = SCHEDULES.get("zb_h1")
    limits = (pp,) * (pp - 1) + (pp - 1,)
    bounded = h1.held_within(limits)
    orders = tuple(tuple(bounded.actions(r, pp, m, 1)) for r in range(pp))
    assert zero_bubble.held_peaks(orders) <= list(limits)
    assert all(sorted(a.micro for a in o if a.kind == kind) == list(range(m))
               for o in orders for kind in "FBW")
    assert replay(bounded, [3.0] * pp, m, 1, 1 / 3) == pytest.approx(3 * m + pp)
    assert replay(h1, [3.0] * pp, m, 1, 1 / 3) == pytest.approx(3 * m + pp - 1)
    v = SCHEDULES.get("zbv")
    unit = ActionCosts.uniform(pp, 1.0, 1.0, 1.0, zero_bubble_v.MESSAGE_LATENCY)
    free = zero_bubble.costed_span(zero_bubble_v.v_orders(pp, m), pp, v_stage_of(pp), unit)
    caps = (2 * pp - 1,) + (2 * pp,) * (pp - 1)
    orders = tuple(tuple(v.held_within(caps).actions(r, pp, m, 2)) for r in range(pp))
    assert_complete_v(orders, pp, m)
    assert zero_bubble.held_peaks(orders) <= list(caps)
    span = zero_bubble.costed_span(orders, pp, v_stage_of(pp), unit)
    assert free <= span <= 1.06 * free, (span, free)


def test_a_limit_no_v_order_keeps_runs_the_unbounded_order() -> None:
    """A cap below what a V needs to turn (its first chunk's forward on rank 0 and the second
    chunk's) leaves no order within it: the schedule runs unbounded, and the memory estimate,
    counted from the orders, prices what that holds."""
    v = SCHEDULES.get("zbv")
    capped = tuple(tuple(v.held_within((1, 8, 8, 8)).actions(r, 4, 8, 2)) for r in range(4))
    assert capped == zero_bubble_v.v_orders(4, 8)


def test_the_phased_v_leaves_a_message_slack_the_greedy_does_not() -> None:
    """p = 4, m = 8: without latency both reach the V's bound, 6m + p - 1 = 51 chunk
    actions; at 0.1 units per message the greedy order loses 2.4 units and the phased one 1.3;
    the phased one's forwards and B's with its W's placed where that latency makes a rank
    wait lose 0.9 (51.9 units: kept), and still reach the bound without latency."""
    phased, greedy = zero_bubble_v.v_phased_orders(4, 8), zero_bubble_v.v_greedy_orders(4, 8)
    assert zero_bubble_v.v_step_units(phased, 4, 0.0) == zero_bubble_v.v_step_units(greedy, 4,
                                                                                0.0) == 51
    assert zero_bubble_v.v_step_units(phased, 4, 0.1) == pytest.approx(52.3)
    assert zero_bubble_v.v_step_units(greedy, 4, 0.1) == pytest.approx(53.4)
    kept = zero_bubble_v.v_orders(4, 8)
    assert zero_bubble_v.v_step_units(kept, 4, 0.1) == pytest.approx(51.9)
    assert zero_bubble_v.v_step_units(kept, 4, 0.0) == 51


def test_orders_at_measured_costs_replay_shorter_than_the_unit_cost_ones() -> None:
    """B = 1.2 F, W = 0.5 F, 0.1 F a message (p = 4, m = 8 and p = 8, m = 16): ZBV's order
    built at these costs replays shorter at them than its unit-cost order; ZB-H2's keeps its
    unit-cost order (its W's already sit where the fill puts them: its forwards and B's, fixed
    by its warm-up, are what it waits on), and is no longer; every rank holds no more than at
    unit costs."""
    f, b, w, latency = UNEVEN
    h2 = SCHEDULES.get("zb_h2")
    for pp, m in ((4, 8), (8, 16)):
        v = ActionCosts.uniform(pp, f / 2, b / 2, w / 2, latency)  # a V's chunk: half the work
        unit_v, costed_v = zero_bubble_v.v_orders(pp, m), zero_bubble_v.costed_v_orders(pp, m, v)
        stage = v_stage_of(pp)
        assert zero_bubble.costed_span(costed_v, pp, stage, v) < 0.99 * zero_bubble.costed_span(
            unit_v, pp, stage, v)
        assert zero_bubble.held_peaks(costed_v) == zero_bubble.held_peaks(unit_v)
        one = ActionCosts.uniform(pp, f, b, w, latency)
        unit_h2 = tuple(tuple(h2.actions(r, pp, m, 1)) for r in range(pp))
        costed_h2 = tuple(tuple(h2.checked_actions(r, pp, m, 1, one)) for r in range(pp))
        assert zero_bubble.costed_span(costed_h2, pp, lambda c, r: r, one) <= \
            zero_bubble.costed_span(unit_h2, pp, lambda c, r: r, one)
        assert zero_bubble.held_peaks(costed_h2) == zero_bubble.held_peaks(unit_h2)


def test_a_list_of_costs_for_another_pipeline_is_refused() -> None:
    with pytest.raises(ValueError, match="measured costs of 2 ranks for a pipeline of 4"):
        SCHEDULES.get("zbv").checked_actions(0, 4, 8, 2, ActionCosts.uniform(2, 1, 1, 1))


@pytest.mark.parametrize("name", ["zb_h1", "zb_h2"])
def test_step_tasks_arm_b_params_before_the_last_b_and_w_params_before_the_last_w(
        name: str) -> None:
    tasks = step_tasks(name, 1, 4, 8)
    kinds = [t.kind for t in tasks]
    assert kinds.count(TaskKind.WEIGHT_GRAD) == 8
    assert kinds.count(TaskKind.SYNC_GRADS) == kinds.count(TaskKind.SYNC_WEIGHT_GRADS) == 1
    sync_b, sync_w = kinds.index(TaskKind.SYNC_GRADS), kinds.index(TaskKind.SYNC_WEIGHT_GRADS)
    assert kinds[sync_b + 1] is TaskKind.BACKWARD and tasks[sync_b + 1].micro == 7
    assert kinds[sync_w + 1] is TaskKind.WEIGHT_GRAD
    assert TaskKind.BACKWARD not in kinds[sync_b + 2:]  # that was the last B
    assert TaskKind.WEIGHT_GRAD not in kinds[sync_w + 2:]
    assert kinds[-3:] == [TaskKind.WAIT_SENDS, TaskKind.WAIT_GRADS, TaskKind.OPTIMIZER_STEP]
    with pytest.raises(ValueError, match="ZeRO stage 2"):
        step_tasks(name, 1, 4, 8, reduce_every_backward=True)


# --- the split backward ------------------------------------------------------------------------

def _block() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.GELU(), nn.Linear(16, 8),
                         nn.Linear(8, 4, bias=False))


def test_b_defers_exactly_the_linear_weights_and_w_gives_autograd_s_gradients() -> None:
    x = torch.randn(3, 5, 8)
    plain = _block()
    plain(x).square().sum().backward()

    split, store = _block(), WeightGradStore()
    deferred = split_weight_grads(split, store)
    linears = [m for m in split.modules() if isinstance(m, nn.Linear)]
    assert {id(p) for p in deferred} == {id(p) for m in linears for p in m.parameters()}
    fired: list[str] = []
    names = {id(p): n for n, p in split.named_parameters()}
    for p in split.parameters():
        p.register_post_accumulate_grad_hook(lambda q: fired.append(names[id(q)]))
    x_in = x.clone().requires_grad_()
    out = split(x_in)
    store.capturing = (0, 0)
    out.square().sum().backward()
    store.capturing = None
    # B: the input's and the norm's gradients, no linear weight's.
    assert sorted(fired) == ["1.bias", "1.weight"]
    assert all(p.grad is None for p in deferred)
    assert store.pending() == 3
    store.run((0, 0))
    assert store.pending() == 0
    assert sorted(fired) == sorted(names.values())
    for (name, a), b in zip(plain.named_parameters(), split.parameters(), strict=True):
        assert torch.allclose(a.grad, b.grad, rtol=0, atol=1e-6), name


def test_a_split_layer_backward_outside_a_b_task_is_an_error() -> None:
    block, store = _block(), WeightGradStore()
    split_weight_grads(block, store)
    with pytest.raises(RuntimeError, match="outside a B task"):
        block(torch.randn(2, 8)).sum().backward()


def test_a_split_layer_under_no_grad_is_the_plain_layer() -> None:
    block, store = _block(), WeightGradStore()
    split_weight_grads(block, store)
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(block(x), _block()(x))


# --- parity on real workers --------------------------------------------------------------------

STEPS = 6
MODEL = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=2", f"training.steps={STEPS}", "optimization.global_batch_size=8",
]
MOE = ["model.kind=moe", "model.num_experts=4", "model.top_k=2"]
LLAMA = ["model.kind=llama", "model.num_kv_heads=2", "model.ffn_hidden_size=64"]
# name -> (workers, settings, the split schedules compared with 1F1B)
LAYOUTS: dict[str, tuple[int, list[str], list[str]]] = {
    "pipeline2": (2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2"], SPLIT),
    "pipeline4": (4, ["model.num_layers=8", "parallelism.pipeline=4",
                      "optimization.micro_batch_size=1"], SPLIT),
    "data2_pipeline2": (4, ["parallelism.pipeline=2", "optimization.micro_batch_size=1"],
                        ["zb_h1", "zbv"]),
    "tensor2_pipeline2_sp": (4, ["parallelism.tensor=2", "parallelism.pipeline=2",
                                 "parallelism.sequence_parallel=true",
                                 "optimization.micro_batch_size=2"], ["zb_h2", "zbv"]),
    "experts2_pipeline2": (4, [*MOE, "parallelism.experts=2", "parallelism.pipeline=2",
                               "optimization.micro_batch_size=2"], ["zb_h1", "zbv"]),
    "llama_pipeline2": (2, [*LLAMA, "parallelism.pipeline=2", "optimization.micro_batch_size=2"],
                        ["zb_h2", "zbv"]),
    "pipeline2_recompute_full": (2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2",
                                     "controllers.memory.activation_checkpointing=full"],
                                 ["zb_h1", "zbv"]),
    "pipeline2_recompute_selective": (
        2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2",
            "controllers.memory.activation_checkpointing=selective"], ["zb_h1", "zbv"]),
    # ZeRO-3 at data 2 x pipeline 2: each stage's blocks gathered per use from shards over its
    # data ranks, the weights freed after every B (a W reads only what B kept); ZeRO-2 too.
    "zero3_data2_pipeline2": (4, ["parallelism.pipeline=2", "optimization.micro_batch_size=1",
                                  "controllers.memory.zero_stage=3"], SPLIT),
    "zero2_data2_pipeline2": (4, ["parallelism.pipeline=2", "optimization.micro_batch_size=1",
                                  "controllers.memory.zero_stage=2"], ["zb_h1"]),
    # Without gradient clipping the V's losses are 1F1B's bit for bit (see below).
    "pipeline2_no_clip": (2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2",
                              "optimization.grad_clip=0"], ["zbv"]),
}
# The V places other stages together on a rank than 1F1B does, so the gradient norm's fp32
# per-rank partial sums group the parameters otherwise and the clipping factor rounds apart:
# losses within 1e-6 (measured: 1e-7), equal without clipping (the no-clip layout).
TOLERANCE = {"zbv": 1e-6}
# Under ZeRO 2 and 3, 1F1B reduce-scatters each micro-batch's gradients and sums the averaged
# shards, where a split schedule keeps the gradients whole and reduces their sum once per step
# (the stage entry's ``reduces_every_backward``): the same terms, added in another order, so
# the losses agree to rounding (measured: 1.2e-7).
LAYOUT_TOLERANCE = {"zero3_data2_pipeline2": 1e-6, "zero2_data2_pipeline2": 1e-6}


def _losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run)]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_schedules_train_the_losses_of_1f1b(name: str, tmp_path: Path,
                                                 capfd: pytest.CaptureFixture[str]) -> None:
    """Per-step losses equal (==): the input gradients are autograd's own, and each weight
    gradient the same product by the same kernel, accumulated in the same micro-batch order
    (ZBV: within ``TOLERANCE``, for the reason given there)."""
    nproc, settings, schedules = LAYOUTS[name]
    reference = _losses_of(tmp_path / "1f1b", nproc, [*settings, "parallelism.schedule=1f1b"])
    assert len(reference) == STEPS
    assert "splits the backward" not in capfd.readouterr().out
    for schedule in schedules:
        run = tmp_path / schedule
        losses = _losses_of(run, nproc, [*settings, f"parallelism.schedule={schedule}",
                                         *NEEDS.get(schedule, [])])
        bound = 0.0 if "grad_clip=0" in " ".join(settings) else max(
            TOLERANCE.get(schedule, 0.0), LAYOUT_TOLERANCE.get(name, 0.0))
        assert len(losses) == STEPS and all(
            abs(a - b) <= bound for a, b in zip(losses, reference, strict=True)), \
            (name, schedule, losses, reference)
        # The split really ran: the first rank's linear weights waited for W tasks.
        assert f"schedule {schedule} splits the backward" in capfd.readouterr().out
        summary = json.loads((run / "summary.json").read_text())
        assert summary["layout"]["world_size"] == nproc


def _losses_of(run: Path, nproc: int, settings: list[str]) -> list[float]:
    train_metrics(run, nproc, [*MODEL, *settings])
    return _losses(run)


def test_compile_is_refused_under_a_split_schedule(tmp_path: Path) -> None:
    base = [*MODEL, "parallelism.pipeline=2", "parallelism.data=2",
            "optimization.micro_batch_size=1", "parallelism.schedule=zb_h1"]
    key = "training.compile"
    proc = run_mcpar("train", *sets(*base, "training.compile=true"), "--nproc", "4",
                     "--run-dir", str(tmp_path / key))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert key in proc.stderr and "splits the backward" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / key / "metrics.jsonl").exists()


def test_zero_stages_reduce_once_per_step_under_a_split_schedule_or_several_chunks() -> None:
    """The stage entry's rule, which the runtime, the memory estimate and the cost model ask."""
    from mcpar.registry.zero import ZeroFacts, zero_stage

    for stage, expected in ((0, False), (1, False), (2, True), (3, True)):
        entry = zero_stage(stage)
        assert entry.reduces_every_backward(ZeroFacts(dp=2, pp=2)) is expected
        assert entry.reduces_every_backward(ZeroFacts(dp=2, pp=2, splits_backward=True)) is False
        assert entry.reduces_every_backward(ZeroFacts(dp=2, pp=2, vp=2)) is False


def test_the_profiler_counts_w_as_compute_and_prices_the_split_bubble() -> None:
    from mcpar.profiler.timeline import split_schedule_bubble, split_step

    assert split_schedule_bubble("zb_h1", 4, 8, 1) == pytest.approx(3 / 27)
    tasks = [{"name": "forward", "start": 0.0, "end": 1.0},
             {"name": "backward", "start": 1.0, "end": 2.0},
             {"name": "sync_weight_grads", "start": 2.0, "end": 2.5},
             {"name": "weight_grad", "start": 2.5, "end": 3.5}]
    out = split_step(tasks, [], 0.0, 3.5)
    assert out["compute"] == pytest.approx(3.0) and out["exposed_comm"] == pytest.approx(0.5)


def test_many_micro_batches_are_priced_without_listing_them() -> None:
    """Past ``replayed_microbatches`` the span is extrapolated (within 2% of the full replay
    on unequal stages) and the peak in flight counted on the first ones (equal)."""
    import random

    from mcpar.registry.schedule import _peak_in_flight

    rng = random.Random(5)
    for name, v in (("zb_h1", 1), ("zb_h2", 1), ("zbv", 2)):
        schedule = SCHEDULES.get(name)
        for pp, m in ((2, 150), (4, 120), (8, 300)):
            work = [1 + 0.3 * rng.random() for _ in range(pp)]
            full = replay(schedule, work, m, v, 1 / 3)
            assert schedule.span(m, max(work), sum(work), work, v, 1 / 3) == \
                pytest.approx(full, rel=0.02)
            assert schedule.in_flight(pp, 0, m, v) == _peak_in_flight(schedule, pp, 0, m, v)
        assert schedule.span(2**40, 1.0, 4.0, [1.0] * 4, v, 1 / 3) > 2**40


# --- orders built at measured costs, on real workers -------------------------------------------

COSTED_M = 8


def _costed_case(rank: int, pp: int, schedule: str, v: int, costs: ActionCosts | None) -> dict:
    """One step of a tiny GPT through the executor under ``schedule`` (its order built at
    ``costs`` when given): each micro-batch's loss where it is computed, every parameter's
    gradient by name."""
    import torch.nn.functional as F

    from mcpar.config import ModelConfig
    from mcpar.controllers.communication.controller import CommunicationController
    from mcpar.controllers.compute.plan import ComputePlan
    from mcpar.models.spec import get_model_spec
    from mcpar.parallel.pipeline import PipelineExecutor
    from mcpar.parallel.stage import cut_model
    from mcpar.topology import ParallelDims

    cfg = ModelConfig(num_layers=2 * pp, hidden_size=32, num_heads=2, seq_len=16,
                      vocab_size=64)
    gen = torch.Generator().manual_seed(7)
    draw = [torch.randint(0, cfg.vocab_size, (2, cfg.seq_len), generator=gen)
            for _ in range(2 * COSTED_M)]
    model = get_model_spec("gpt").build(cfg, 7)
    plan = ComputePlan(pp=pp, virtual_stages=v, schedule=schedule, sequence_parallel=False,
                       micro_batch_size=2, num_microbatches=COSTED_M,
                       global_batch_size=2 * COSTED_M, stage_cut=(), batch_splitting="fixed",
                       balance=None, action_costs=costs)  # type: ignore[arg-type]
    per_stage = cfg.num_layers // (pp * v)
    ranges = [(s * per_stage, (s + 1) * per_stage) for s in range(pp * v)]
    chunks = [cut_model(model, ranges, s) for s in plan.stages_of(rank)]
    store = WeightGradStore() if plan.splits_backward else None
    for chunk in chunks if store is not None else []:
        split_weight_grads(chunk, store, keep_whole=chunk.pieces()[2])
    dims = ParallelDims(dp=1, tp=1, pp=pp, ep=1, world_size=pp)
    dims.build_mesh("cpu")

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    executor = PipelineExecutor(chunks, rank, pp, CommunicationController(dims), COSTED_M,
                                (2, cfg.seq_len, cfg.hidden_size), loss_fn, torch.device("cpu"),
                                weight_grads=store, stages=plan.stages_of(rank),
                                stage_ranks=plan.stage_ranks(), send_order=plan.send_order(rank))
    held = {id(p) for c in chunks for p in c.parameters()}
    first, last = 0 in plan.stages_of(rank), pp * v - 1 in plan.stages_of(rank)
    losses = executor.run(draw[:COSTED_M] if first else None,
                          draw[COSTED_M:] if last else None, plan.step_tasks(rank, False))
    return {"losses": losses,
            "grads": {n: p.grad.tolist() for n, p in model.named_parameters()
                      if id(p) in held and p.grad is not None}}


def _costed_worker(rank: int, pp: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=pp)
    try:
        f, b, w, latency = UNEVEN
        cases = {"1f1b": _costed_case(rank, pp, "1f1b", 1, None),
                 "zb_h2": _costed_case(rank, pp, "zb_h2", 1,
                                       ActionCosts.uniform(pp, f, b, w, latency)),
                 "zbv": _costed_case(rank, pp, "zbv", 2,
                                     ActionCosts.uniform(pp, f / 2, b / 2, w / 2, latency))}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(cases))


@pytest.mark.parametrize("pp", [2, 4])
def test_orders_built_at_measured_costs_train_the_losses_of_1f1b(pp: int,
                                                                tmp_path: Path) -> None:
    """ZB-H2's and ZBV's orders built at B = 1.2 F, W = 0.5 F (ZBV's differs from its unit-cost
    order at pp 4) run to the end on gloo workers; the per-micro-batch losses equal 1F1B's
    (==: the forwards are the same ops) and every gradient is within 1e-6 of 1F1B's (the W's
    accumulate the micro-batches' weight gradients in another order)."""
    from conftest import spawn_workers

    from mcpar.launch.env import find_free_port

    f, b, w, latency = UNEVEN
    costed = ActionCosts.uniform(pp, f / 2, b / 2, w / 2, latency)
    differs = zero_bubble_v.costed_v_orders(pp, COSTED_M, costed) != zero_bubble_v.v_orders(
        pp, COSTED_M)
    assert differs == (pp == 4)
    spawn_workers(_costed_worker, args=(pp, find_free_port(), str(tmp_path)), nprocs=pp)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(pp)]
    reference = [loss for r in ranks for loss in r["1f1b"]["losses"]]
    assert len(reference) == COSTED_M
    for name in ("zb_h2", "zbv"):
        assert [loss for r in ranks for loss in r[name]["losses"]] == reference, name
        grads = {n: g for r in ranks for n, g in r[name]["grads"].items()}
        want = {n: g for r in ranks for n, g in r["1f1b"]["grads"].items()}
        assert grads.keys() == want.keys() and len(want) > 0
        worst = max((torch.tensor(grads[n]) - torch.tensor(want[n])).abs().max().item()
                    for n in want)
        assert worst <= 1e-6, (name, worst)
