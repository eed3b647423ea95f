"""``mcpar train`` keeps the planner's calibration true: a missing, edited or broken local profile
is measured before ``parallelism.auto`` (or a profiled window) prices the job, a valid one is not,
and a run whose step was off the prediction by more than the margin measures it again and says
so in ``summary.json``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY
from test_profilestore import PROFILE, REMEASURED, _edit

from mcpar.auto_layout import PREDICTION_MARGIN
from mcpar.commands.calibration import calibrate_before_plan, remeasure_after_drift
from mcpar.config import load_config
from mcpar.sim import localprofile
from mcpar.sim.profilestore import PROFILE_ENV, lookup_profile, save_profile

AUTO = [*TINY, "parallelism.auto=true"]


@pytest.fixture
def measured(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The profile file in a temporary folder; ``measure`` counted instead of run (15 s)."""
    calls: list[int] = []
    monkeypatch.setenv(PROFILE_ENV, str(tmp_path / "profile.json"))

    def fake() -> object:
        calls.append(1)
        return REMEASURED

    monkeypatch.setattr(localprofile, "measure", fake)
    return calls


@pytest.mark.parametrize("state", ["missing", "edited", "broken"])
def test_a_profile_not_valid_here_is_measured_before_the_plan(
        tmp_path: Path, measured: list[int], capsys: pytest.CaptureFixture[str],
        state: str) -> None:
    path = tmp_path / "profile.json"
    if state == "edited":
        save_profile(PROFILE, path)
        _edit(path, flops_per_thread=9e12)  # a number changed by hand: the checksum tells
    elif state == "broken":
        path.write_text("[1, 2]")
    calibrate_before_plan(load_config(None, AUTO))
    assert measured == [1]
    found = lookup_profile(path)
    assert found.status == "valid" and found.profile == REMEASURED
    said = capsys.readouterr().err
    assert "measuring this machine" in said and str(path) in said


def test_a_valid_profile_or_a_job_that_prices_nothing_measures_nothing(
        tmp_path: Path, measured: list[int]) -> None:
    save_profile(PROFILE, tmp_path / "profile.json")
    calibrate_before_plan(load_config(None, AUTO))
    (tmp_path / "profile.json").unlink()
    calibrate_before_plan(load_config(None, TINY))  # no auto, no profiled window
    assert measured == []
    calibrate_before_plan(load_config(None, [*TINY, "training.profile.enabled=true"]))
    assert measured == [1]


@pytest.mark.parametrize("error", [PREDICTION_MARGIN + 0.05, -(PREDICTION_MARGIN + 0.05),
                                   PREDICTION_MARGIN - 0.05])
def test_a_run_off_its_prediction_measures_the_machine_again(
        tmp_path: Path, measured: list[int], capsys: pytest.CaptureFixture[str],
        error: float) -> None:
    save_profile(PROFILE, tmp_path / "profile.json")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "summary.json").write_text(json.dumps({"prediction": {"step_error": error}}))
    remeasure_after_drift(load_config(None, AUTO), run_dir)
    prediction = json.loads((run_dir / "summary.json").read_text())["prediction"]
    if abs(error) > PREDICTION_MARGIN:
        assert measured == [1]
        assert prediction["profile_remeasured"] == str(tmp_path / "profile.json")
        assert lookup_profile(tmp_path / "profile.json").profile == REMEASURED
        assert f"{error:+.0%} off the planner's prediction" in capsys.readouterr().out
    else:
        assert measured == [] and "profile_remeasured" not in prediction
    # Without parallelism.auto nothing was ranked on the profile: nothing to correct.
    remeasure_after_drift(load_config(None, TINY), run_dir)
    assert len(measured) == (1 if abs(error) > PREDICTION_MARGIN else 0)
