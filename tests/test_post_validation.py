"""Post-validation (``optimization.post_validation``): the optimizer step taken before the mesh
agrees on it and checked a step later gives the synchronized path's results, bit for bit,
whether the assumption held or not (clipped steps, non-finite steps, dropout, an evaluation
between); ZBV's orders for overlapping steps lose no fill at equal costs; the config refuses
what the update cannot follow yet."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import read_metrics, run_mcpar, sets, train_metrics
from torch import nn

import mcpar.controllers.registered  # noqa: F401  (the schedules)
from mcpar.comm.communicator import Communicator
from mcpar.config.loading import load_config
from mcpar.controllers.compute.plan import post_validation_problems
from mcpar.controllers.compute.schedules import build_schedule
from mcpar.parallel.grad_norm import clip_grad_norm, stage_sum_of_squares
from mcpar.post_validation import PostValidatedUpdate
from mcpar.registry.schedule import SCHEDULES, schedule_as_run
from mcpar.registry.schedule_replay import critical_path, order_graph, steady_period
from mcpar.sim.costmodel import simulate
from mcpar.sim.hardware import load_accelerators, make_cluster
from mcpar.sim.workload import MODEL_PRESETS, Layout
from mcpar.step_agreement import StepFigures
from mcpar.topology import ParallelDims

# --- one process: the update against the synchronized one -------------------------------------


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def _grads(model: nn.Module, step: int, poison: bool) -> float:
    """The gradients of ``step``'s loss on fixed data (scaled by the step so that some norms
    pass the clip and some do not; ``poison``: a non-finite loss); returns the loss."""
    model.zero_grad(set_to_none=True)
    gen = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 8, generator=gen), torch.randn(32, 4, generator=gen)
    loss = nn.functional.mse_loss(model(x), y) * (0.2 + step % 3)
    if poison:
        loss = loss * float("nan")
    loss.backward()
    return float(loss)


NONFINITE_STEP = 4


def _synchronized(steps: int, max_norm: float) -> tuple[list[torch.Tensor], list[float]]:
    """The parameters after ``steps`` synchronized steps, and each step's norm."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    comm = Communicator(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    norms = []
    for step in range(steps):
        _grads(model, step, step == NONFINITE_STEP)
        norms.append(clip_grad_norm(list(model.parameters()), max_norm, comm))
        if norms[-1] == norms[-1]:  # finite: the synchronized path steps; NaN skips
            opt.step()
    return [p.detach().clone() for p in model.parameters()], norms


def _post_validated(steps: int, max_norm: float) -> tuple[list[torch.Tensor], int]:
    """The trainer's use of the update: each step's previous verdict first, the step run
    again where that verdict redid the update, then this step's update taken early."""
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    comm = Communicator(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    update = PostValidatedUpdate(params, opt, comm, max_norm, [0], 0)
    for step in range(steps):
        loss = _grads(model, step, step == NONFINITE_STEP)
        verdict = update.settle()
        if verdict is not None and verdict.redo:
            loss = _grads(model, step, step == NONFINITE_STEP)  # on the redone weights
        norm_sq = float(stage_sum_of_squares(params, comm))
        nonfinite = not (norm_sq == norm_sq and loss == loss)
        figures = StepFigures(loss, 0.0, nonfinite, 0, 0, False, 0.0)
        update.update(step, figures, norm_sq, settle=step == steps - 1)
    return [p.detach().clone() for p in params], update.redone_steps


@pytest.mark.parametrize("max_norm", [0.0, 0.5, 100.0])
def test_the_update_taken_early_ends_where_the_synchronized_one_does(max_norm: float) -> None:
    """Bit for bit, with every step clipped (0.5), none (100, 0 = no clip), and a NaN step
    skipped in each case."""
    reference, norms = _synchronized(9, max_norm)
    got, redone = _post_validated(9, max_norm)
    assert all(torch.equal(a, b) for a, b in zip(got, reference, strict=True))
    # Each clipped step taken early (all but the last, which waits) is redone; the NaN step is
    # not taken at all: the one rank saw the NaN itself.
    clipped = [n for n in norms[:-1] if n == n and 0 < max_norm < n]
    assert redone == len(clipped)
    assert (len(clipped) >= 3) == (max_norm == 0.5)


def test_a_redone_first_step_leaves_the_optimizer_as_it_found_it() -> None:
    """The first step's copy holds no optimizer state: putting it back clears what the early
    step created, so the redone step starts Adam from step 0 again."""
    model = _model()
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-2)
    comm = Communicator(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    update = PostValidatedUpdate(params, opt, comm, 1e-3, [0], 0)  # every step clips
    before = [p.detach().clone() for p in params]
    loss = _grads(model, 0, False)
    update.update(0, StepFigures(loss, 0.0, False, 0, 0, False, 0.0),
                  float(stage_sum_of_squares(params, comm)), settle=False)
    assert all(float(opt.state[p]["step"]) == 1 for p in params)
    verdict = update.settle()
    assert verdict is not None and verdict.redo and verdict.result.grad_norm > 1e-3
    assert all(float(opt.state[p]["step"]) == 1 for p in params)  # once, not twice
    reference = _model()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    _grads(reference, 0, False)
    clip_grad_norm(list(reference.parameters()), 1e-3, comm)  # the synchronized path
    ref_opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, reference.parameters(), strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(params, before, strict=True))


# --- the orders -------------------------------------------------------------------------------


def _unit(schedule: str, pp: int, m: int, v: int, overlapped: bool) -> tuple[float, float]:
    """(one synchronized step, the overlapped steady period) of the schedule's orders at
    F = B = W = one unit, messages free."""
    entry = SCHEDULES.get(schedule)
    orders = [build_schedule(schedule, r, pp, m, v, overlapped=overlapped) for r in range(pp)]

    def stage(chunk: int, r: int) -> int:
        return entry.stage_of(chunk, r, pp, v)

    def cost(_r: int, _kind: str) -> float:
        return 1.0 / v

    span = critical_path(order_graph(orders, stage, pp, pp * v - 1, schedule), cost)
    return span, steady_period(orders, stage, pp, pp * v - 1, m, cost)


@pytest.mark.parametrize(("pp", "m"), [(2, 4), (4, 8), (4, 12)])
def test_zbv_for_overlapping_steps_loses_no_fill(pp: int, m: int) -> None:
    work = 3 * m
    span, period = _unit("zbv", pp, m, 2, overlapped=True)
    assert period == pytest.approx(work)  # zero bubble in the steady state
    assert span == pytest.approx(work + (pp - 1) / 2)  # the fill, paid once
    # 1F1B's ranks end a step together: overlap gives it nothing.
    span_1f1b, period_1f1b = _unit("1f1b", pp, m, 1, overlapped=True)
    assert period_1f1b == pytest.approx(span_1f1b)


def test_the_overlapped_orders_are_chosen_only_for_overlapping_steps() -> None:
    """At the bench's message latency the synchronized step keeps its own (shorter) order."""
    sync = [build_schedule("zbv", r, 4, 8, 2) for r in range(4)]
    overlapped = [build_schedule("zbv", r, 4, 8, 2, overlapped=True) for r in range(4)]
    assert sync != overlapped
    assert SCHEDULES.get("1f1b").for_overlapped_steps() is SCHEDULES.get("1f1b")


# --- the cost model and the memory estimate ---------------------------------------------------


@pytest.mark.parametrize(("name", "v", "pp", "m", "fill"), [
    ("zb_h2", 1, 4, 8, 1.0), ("zbv", 2, 4, 8, 0.5), ("zbv", 2, 2, 64, 1 / 6),
    ("1f1b", 1, 4, 8, 3.0), ("zb_h1", 1, 4, 8, 1.0),
])
def test_overlapping_steps_are_priced_by_their_steady_period(name: str, v: int, pp: int, m: int,
                                                             fill: float) -> None:
    """At equal stage costs (1 s per micro-batch, forward a third) a step that overlaps costs
    m seconds where the schedule's ranks end a step as far apart as they start it (ZB-H2, ZBV),
    and its synchronized span where they end together (1F1B, ZB-H1); past the replayed
    micro-batches the period is extrapolated as the span is."""
    sync, overlapped = schedule_as_run(name, None, False), schedule_as_run(name, None, True)
    work = [1.0] * pp
    span = sync.span(m, 1.0, float(pp), work, v, 1 / 3)
    assert span == pytest.approx(m + fill)
    ends_apart = name in ("zb_h2", "zbv")
    assert overlapped.period(m, work, v, 1 / 3) == pytest.approx(m if ends_apart else span)
    assert overlapped.period(1000, work, v, 1 / 3) == pytest.approx(
        1000 if ends_apart else 1000 + fill)


def test_the_cost_model_prices_the_overlap_and_the_copy_post_validation_keeps() -> None:
    """GPT-3 175B on 1024 A100s at pipeline 8: ZB-H2's step under post-validation loses its
    fill (the synchronized bubble less the imbalance that remains), 1F1B's does not change, and
    the busiest rank's optimizer-state row gains its weights, gradients and optimizer state
    (the copy kept to redo a step)."""
    model = MODEL_PRESETS["gpt3-175b"].shape
    cluster = make_cluster(load_accelerators()["a100-80gb"], 1024, 8, 200)
    base = Layout(tp=8, pp=8, dp=16, global_batch=256, micro_batch=1, recompute="selective",
                  seq_parallel=True, precision="bf16")
    for name, gains in (("zb_h2", True), ("1f1b", False)):
        sync = simulate(model, base.with_(schedule=name), cluster)
        early = simulate(model, base.with_(schedule=name, post_validation=True), cluster)
        if gains:
            assert early.step_s < 0.95 * sync.step_s, (sync.step_s, early.step_s)
        else:
            assert early.step_s == pytest.approx(sync.step_s)
        assert early.bubble_s <= sync.bubble_s + 1e-9
        s, e = sync.memory, early.memory
        assert (e.weights, e.gradients, e.activations) == (s.weights, s.gradients, s.activations)
        assert e.optimizer == pytest.approx(2 * s.optimizer + s.weights + s.gradients)


# --- the config -------------------------------------------------------------------------------


@pytest.mark.parametrize(("settings", "named"), [
    ([], "parallelism.pipeline > 1"),
    (["parallelism.pipeline=2", "optimization.optimizer=onebit_adam"], "optimizer adamw"),
    (["parallelism.pipeline=2", "controllers.memory.zero_stage=1"], "zero_stage 0"),
    (["parallelism.pipeline=2", "controllers.communication.compression=bf16"],
     "compression none"),
    (["parallelism.pipeline=2", "training.profile.enabled=true"], "training.profile.enabled"),
])
def test_what_the_update_cannot_follow_is_refused_naming_the_key(settings: list[str],
                                                                 named: str) -> None:
    cfg = load_config(None, ["optimization.post_validation=true", *settings])
    problems = post_validation_problems(cfg)
    assert len(problems) == 1 and "optimization.post_validation" in problems[0]
    assert named in problems[0]


def test_check_exits_2_on_a_refused_post_validation(tmp_path: Path) -> None:
    proc = run_mcpar("train", *sets("optimization.post_validation=true"), "--run-dir",
                     str(tmp_path / "run"))
    assert proc.returncode == 2
    assert "optimization.post_validation" in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


# --- real workers -----------------------------------------------------------------------------

STEPS = 8
MODEL = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=3", "training.eval_batches=1",
    "optimization.warmup_steps=2", f"training.steps={STEPS}", "optimization.global_batch_size=8",
    # Dropout: a step run again draws its masks as the first run did.
    "model.dropout=0.1",
]
LAYOUTS = {
    # Norms 1.3-3.3 over the run: at clip 2 some steps are clipped (redone), some are not.
    "zbv_pipeline2": (2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2",
                          "parallelism.schedule=zbv", "parallelism.virtual_stages=2",
                          "optimization.grad_clip=2.0"]),
    "zb_h2_pipeline4": (4, ["model.num_layers=8", "parallelism.pipeline=4",
                            "optimization.micro_batch_size=1", "parallelism.schedule=zb_h2"]),
    "data2_pipeline2": (4, ["parallelism.pipeline=2", "optimization.micro_batch_size=1",
                            "parallelism.schedule=zbv", "parallelism.virtual_stages=2"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_post_validated_runs_train_the_synchronized_losses(name: str, tmp_path: Path) -> None:
    nproc, settings = LAYOUTS[name]
    reference = train_metrics(tmp_path / "sync", nproc, [*MODEL, *settings])
    records = train_metrics(tmp_path / "pv", nproc,
                            [*MODEL, *settings, "optimization.post_validation=true"])
    assert [r["loss"] for r in records] == [r["loss"] for r in reference]
    # The norm adds the stages' sums in pipeline order, the synchronized all-reduce in its ring
    # order: at pipeline 4 a last-bit float64 difference (measured: 4e-16 relative), which
    # left every loss equal.
    assert [r["grad_norm"] for r in records] == pytest.approx(
        [r["grad_norm"] for r in reference], rel=1e-12)
    assert [r.get("val_loss") for r in records] == [r.get("val_loss") for r in reference]
    summary = json.loads((tmp_path / "pv" / "summary.json").read_text())
    clipped = [r for r in reference[:-1] if r["grad_norm"] > (2.0 if "zbv_" in name else 1.0)]
    # Every clipped step taken early (the evaluated and the last ones wait instead) is redone.
    early = [r for r in clipped if r["step"] % 3]
    assert summary["post_validation"]["redone_steps"] == len(early)
    # The copy kept to redo a step (weights, gradients, optimizer state): measured, and
    # estimated, on top of the synchronized run's rows.
    memory = json.loads((tmp_path / "pv" / "summary.json").read_text())["memory"]
    synchronized = json.loads((tmp_path / "sync" / "summary.json").read_text())["memory"]
    for side in ("measured", "estimate"):
        rows, sync_rows = memory[side], synchronized[side]
        assert rows["optimizer state"] == (2 * sync_rows["optimizer state"]
                                           + sync_rows["parameters"] + sync_rows["gradients"])


@pytest.mark.slow
def test_a_nonfinite_step_is_skipped_as_the_synchronized_run_skips_it(tmp_path: Path) -> None:
    """Rank 0's loss is NaN at step 4: every rank's early update is undone and the step
    skipped, as without post-validation, and the runs agree on every loss after it."""
    settings = [*MODEL, *LAYOUTS["zbv_pipeline2"][1]]
    env = {"MCPAR_FAULT_NONFINITE_STEPS": "4"}
    runs, outputs = {}, {}
    for label, extra in (("sync", []), ("pv", ["optimization.post_validation=true"])):
        proc = run_mcpar("train", *sets(*settings, *extra), "--nproc", "2", "--run-dir",
                         str(tmp_path / label), env=env)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[label] = read_metrics(tmp_path / label)
        outputs[label] = proc.stdout + proc.stderr
    assert [r["skipped"] for r in runs["pv"]] == [r["skipped"] for r in runs["sync"]]
    assert runs["sync"][3]["skipped"]
    finite = [r["loss"] for r in runs["pv"] if not r["skipped"]]
    assert finite == [r["loss"] for r in runs["sync"] if not r["skipped"]]
    # More than a tenth of the steps redone (the NaN step, the clipped ones): the run says so.
    redone = json.loads((tmp_path / "pv" / "summary.json").read_text())["post_validation"]
    assert redone["redone_steps"] > STEPS // 10
    assert f"{redone['redone_steps']} of {STEPS} steps were redone" in outputs["pv"]
    assert "were redone" not in outputs["sync"]
