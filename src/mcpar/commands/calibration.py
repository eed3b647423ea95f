"""When ``mcpar train`` measures this machine's local profile: the calibration
``parallelism.auto`` ranks CPU layouts on must be this machine's, today's.

- Before the plan (``parallelism.auto``, or a profiled window, whose report sets the prediction
  beside the measurement): a missing, stale (another machine's, an edited file) or broken
  profile is measured first (about 15 s on 2 cores), so that the choice and the report's
  prediction are priced on the machine that runs them rather than on declared figures.
- After the run: a measured step off the planner's prediction by more than
  ``PREDICTION_MARGIN`` means the profile no longer describes the machine (a load, a changed
  clock, a new torch); it is measured again, so that the next plan is priced on what the run
  just saw, and ``summary.json``'s ``prediction`` says so.

CUDA jobs rank on the hardware table's row for the device; they measure nothing here.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcpar.auto_layout import PREDICTION_MARGIN
from mcpar.config import JobConfig
from mcpar.device_select import select_device
from mcpar.metrics import write_json_atomic


def _on_cpu(cfg: JobConfig) -> bool:
    return select_device(cfg.training.device).type == "cpu"


def calibrate_before_plan(cfg: JobConfig) -> None:
    """Measure the local profile now when ``parallelism.auto`` or the profile report would price
    the job on one that is not valid for this machine (``lookup_profile``); says why in one
    line."""
    if not (cfg.parallelism.auto or cfg.training.profile.enabled) or not _on_cpu(cfg):
        return
    from mcpar.sim.localprofile import load_local_cluster
    from mcpar.sim.profilestore import lookup_profile

    found = lookup_profile()
    if found.status != "valid":
        load_local_cluster(remeasure=found.status == "broken")


def remeasure_after_drift(cfg: JobConfig, run_dir: Path) -> None:
    """Measure the local profile again when the run's step was off the prediction by more than
    the margin; record it in ``summary.json``'s ``prediction`` (``profile_remeasured``)."""
    if not cfg.parallelism.auto or not _on_cpu(cfg):
        return
    path = run_dir / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # a run stopped before its summary: nothing measured to compare
    prediction = summary.get("prediction")
    if not isinstance(prediction, dict):
        return
    error = float(prediction.get("step_error", 0.0))
    if not abs(error) > PREDICTION_MARGIN:
        return
    from mcpar.sim.localprofile import load_local_cluster
    from mcpar.sim.profilestore import profile_path

    print(f"mcpar: the step was {error:+.0%} off the planner's prediction (margin "
          f"{PREDICTION_MARGIN:.0%}): measuring this machine again so that the next plan is "
          "priced on it", flush=True)
    load_local_cluster(remeasure=True)
    prediction["profile_remeasured"] = str(profile_path())
    write_json_atomic(path, summary)
