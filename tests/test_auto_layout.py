"""``parallelism.auto``: the planner chooses the layout, ``mcpar train`` runs it and reports the
prediction beside the measurement; keys set by hand stay; a budget nothing fits is one line
naming the key and the smallest layout's bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, run_mcpar

from mcpar.auto_layout import choose_layout, resolve_job
from mcpar.config import load_config, to_yaml
from mcpar.errors import UserError

AUTO = [*TINY, "parallelism.auto=true", "optimization.global_batch_size=8",
        "optimization.checkpoint.interval=0"]


def test_the_choice_is_the_fastest_predicted_layout_that_resolves() -> None:
    """The chosen layout fills the world, is predicted no slower than any runner-up, and the
    plan resolved from it runs its degrees."""
    cfg = load_config(None, AUTO)
    auto = choose_layout(cfg, 4)
    s = auto.chosen.settings
    assert s["parallelism.tensor"] * s["parallelism.pipeline"] * s["parallelism.data"] == 4
    assert auto.runners_up and all(auto.chosen.step_s <= c.step_s for c in auto.runners_up)
    assert auto.priced > len(auto.runners_up) + 1
    plan = resolve_job(cfg, 4)
    assert (plan.tp, plan.pp, plan.dp) == (s["parallelism.tensor"], s["parallelism.pipeline"],
                                           s["parallelism.data"])
    assert plan.config.controllers.memory.zero_stage == s["controllers.memory.zero_stage"]
    assert plan.to_json()["auto"]["chosen"]["settings"] == s


def test_keys_set_by_hand_stay_as_set() -> None:
    cfg = load_config(None, [*AUTO, "parallelism.tensor=2",
                             "controllers.communication.compression=bf16"])
    auto = choose_layout(cfg, 4)
    for choice in [auto.chosen, *auto.runners_up]:
        assert choice.settings["parallelism.tensor"] == 2
        assert choice.settings["controllers.communication.compression"] == "bf16"
    assert auto.fixed == ["controllers.communication.compression",
                          "optimization.global_batch_size", "parallelism.tensor"]
    # Without them the search is wider: the tensor degree varies.
    free = choose_layout(load_config(None, AUTO), 4)
    assert free.priced > auto.priced


def test_a_worker_resolving_the_run_config_gets_the_same_layout(tmp_path: Path) -> None:
    """Workers read config.yaml, where every key is set: the search is the choice alone, and
    it resolves to the same plan and prediction."""
    plan = resolve_job(load_config(None, AUTO), 4)
    saved = tmp_path / "config.yaml"
    saved.write_text(to_yaml(plan.config))
    again = resolve_job(load_config(saved), 4)
    assert again.auto is not None and plan.auto is not None
    assert again.auto.chosen.settings == plan.auto.chosen.settings
    assert again.auto.chosen.step_s == pytest.approx(plan.auto.chosen.step_s)
    assert again.to_json()["degrees"] == plan.to_json()["degrees"]


def test_a_budget_nothing_fits_names_the_key_and_the_smallest_layout() -> None:
    cfg = load_config(None, [*AUTO, "controllers.memory.memory_budget_gb=0.0001"])
    with pytest.raises(UserError) as err:
        choose_layout(cfg, 4)
    text = str(err.value)
    assert "controllers.memory.memory_budget_gb" in text and "the smallest" in text
    assert " B)" in text  # the smallest layout's exact bytes


def test_check_prints_the_ranking_and_a_tiny_budget_is_one_line(tmp_path: Path) -> None:
    config = tmp_path / "auto.yaml"
    config.write_text("{}\n")
    sets = [arg for s in AUTO for arg in ("--set", s)]
    out = run_mcpar("check", str(config), "--nproc", "4", *sets)
    assert out.returncode == 0, out.stderr
    assert "auto layout (parallelism.auto):" in out.stdout and "  1. " in out.stdout
    # `mcpar plan CONFIG --world N` prints the same choice.
    planned = run_mcpar("plan", str(config), "--world", "4", *sets)
    assert planned.returncode == 0, planned.stderr
    chosen = next(line for line in out.stdout.splitlines() if line.startswith("auto layout"))
    assert planned.stdout.splitlines()[0] == chosen
    bad = run_mcpar("check", str(config), "--nproc", "4", *sets,
                    "--set", "controllers.memory.memory_budget_gb=0.0001")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "controllers.memory.memory_budget_gb" in bad.stderr


def test_train_runs_the_choice_and_reports_predicted_against_measured(tmp_path: Path) -> None:
    """End to end, from a deliberately stale profile (a number edited by hand): it is detected
    and measured again before the planner prices the layouts."""
    from test_profilestore import PROFILE, _edit

    from mcpar.sim.profilestore import PROFILE_ENV, lookup_profile, save_profile

    profile = tmp_path / "profile.json"
    save_profile(PROFILE, profile)
    _edit(profile, flops_per_thread=9e12)
    run_dir = tmp_path / "run"
    sets = [arg for s in [*AUTO, "training.steps=6"] for arg in ("--set", s)]
    out = run_mcpar("train", "--nproc", "4", "--oversubscribe", "--run-dir", str(run_dir),
                    *sets, timeout=400, env={PROFILE_ENV: str(profile)})
    assert out.returncode == 0, out.stdout + out.stderr
    assert "edited after it was measured" in out.stderr
    assert "measuring this machine" in out.stderr
    remeasured = lookup_profile(profile)
    assert remeasured.status == "valid" and remeasured.profile != PROFILE
    ranking = json.loads((run_dir / "auto_layout.json").read_text())
    chosen = ranking["chosen"]["settings"]
    summary = json.loads((run_dir / "summary.json").read_text())
    layout = summary["layout"]
    assert (layout["tensor"], layout["pipeline"], layout["data"]) == (
        chosen["parallelism.tensor"], chosen["parallelism.pipeline"], chosen["parallelism.data"])
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["auto"]["chosen"]["settings"] == chosen
    prediction = summary["prediction"]
    assert prediction["predicted_step_s"] == pytest.approx(ranking["chosen"]["predicted_step_s"])
    assert prediction["measured_step_s"] > 0
    assert prediction["step_error"] == pytest.approx(
        prediction["measured_step_s"] / prediction["predicted_step_s"] - 1)
    # The memory estimate the plan ranked by is the one the run measures against.
    assert abs(prediction["peak_error"]) <= 0.10
    # A step off by more than the margin measures the machine again (a loaded CI machine).
    drifted = abs(prediction["step_error"]) > prediction["margin"]
    assert ("profile_remeasured" in prediction) == drifted
    assert ("the term off most is" in prediction["warning"]) == drifted
    # Every replica's step is logged with the slowest replica and how far apart they came.
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    if layout["data"] > 1:
        assert all(0 <= r["slowest_rank"] < 4 and r["grad_sync_spread_s"] >= 0
                   for r in records if "step" in r)
    assert prediction["terms"]["slowest replica's lateness"]["predicted"] == 0.0


CHOSEN = {"layout": "tensor 1 x pipeline 1 x data 4", "predicted_step_s": 1.0,
          "predicted_peak_bytes": 100 << 20, "predicted_dp_exposed_s": 0.1}


LATE = "slowest replica's lateness"
TERMS = {"compute", "exposed data-parallel communication", LATE}


@pytest.mark.parametrize(("steps", "exposed", "straggling", "peak", "named"), [
    ([9.0, 1.1, 1.1, 1.1], [0.0, 0.1, 0.1, 0.1], None, 100 << 20, None),  # within every margin
    ([9.0, 2.0, 2.0, 2.0], [0.0, 0.1, 0.1, 0.1], None, 100 << 20, "compute"),
    ([9.0, 2.0, 2.0, 2.0], [0.0, 1.1, 1.1, 1.1], None, 100 << 20,
     "exposed data-parallel communication"),
    # The same wait, but this rank waited 1.0 s of it for a replica that came 0.8 s after the
    # replicas' mean: the wire took 0.1 s, as predicted, and the straggler is named.
    ([9.0, 2.0, 2.0, 2.0], [0.0, 1.1, 1.1, 1.1], [(0.0, 0.0)] + [(1.0, 0.8)] * 3, 100 << 20,
     LATE),
    # This rank was the slowest itself (no wait of its own), 0.9 s behind the mean.
    ([9.0, 2.0, 2.0, 2.0], [0.0, 0.1, 0.1, 0.1], [(0.0, 0.0)] + [(0.0, 0.9)] * 3, 100 << 20,
     LATE),
    ([9.0, 1.0, 1.0, 1.0], [0.0, 0.1, 0.1, 0.1], None, 120 << 20, "memory"),
])
def test_a_drift_past_the_margin_names_the_term_that_is_off(
        steps: list[float], exposed: list[float], straggling: list[tuple[float, float]] | None,
        peak: int, named: str | None) -> None:
    from mcpar.auto_layout import predicted_against_measured

    out = predicted_against_measured(CHOSEN, steps, {"measured": {"total": peak}}, exposed,
                                     straggling)
    assert out["measured_step_s"] == steps[1]  # the first step pays the warm-up
    terms = out["terms"]
    own_wait, late = straggling[1] if straggling else (0.0, 0.0)
    wire = exposed[1] - own_wait
    assert terms["exposed data-parallel communication"]["measured"] == pytest.approx(wire)
    assert terms[LATE] == {"predicted": 0.0, "measured": late}
    # The three terms add up to the measured step.
    assert terms["compute"]["measured"] == pytest.approx(steps[1] - wire - late)
    assert terms["compute"]["predicted"] == pytest.approx(0.9)
    if named is None:
        assert out["warning"] == ""
    else:
        assert f"the term off {'most ' if named != 'memory' else ''}is {named}" in out["warning"]
        assert not any(f"is {o} (" in out["warning"] for o in TERMS - {named})


@pytest.mark.parametrize("slowest", [0, 1, 3])
def test_straggling_names_the_last_replica_whichever_rank_it_is(slowest: int) -> None:
    """Ranks 0-3 replicas of one another, ranks 4-7 of each other (another stage): the group's
    last rank is named wherever it is, each rank's own wait is its distance to it, and the
    other group's times change nothing."""
    from mcpar.step_agreement import straggling_of

    came = [0.50, 0.52, 0.54, 0.56, 9.0, 9.0, 9.0, 9.0]
    came[slowest] = 0.70
    group = [0, 1, 2, 3]
    mean = sum(came[:4]) / 4
    for rank in group:
        s = straggling_of(came, group, rank)
        assert s is not None and s.slowest_rank == slowest
        assert s.spread_s == pytest.approx(0.70 - min(came[:4]))
        assert s.behind_mean_s == pytest.approx(0.70 - mean)
        assert s.own_wait_s == pytest.approx(0.70 - came[rank])
    assert (straggling_of(came, [2], 2)) is None  # no replicas: nothing to wait for


def test_when_the_plan_refuses_every_layout_its_own_words_are_given() -> None:
    """1-bit Adam fixed by hand on a run shorter than its warm-up: the plan's rule is named."""
    cfg = load_config(None, [*AUTO, "controllers.communication.compression=1bit",
                             "training.steps=3"])
    with pytest.raises(UserError) as err:
        choose_layout(cfg, 4)
    assert "optimization.freeze_step" in str(err.value)
    assert "not below training.steps 3" in str(err.value)
