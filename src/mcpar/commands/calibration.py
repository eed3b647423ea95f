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

On CUDA the same holds for the device's profile (``sim.deviceprofile``: its matrix-multiply,
attention and memory rates, and NCCL between two of the host's devices), measured by the launcher
before the workers take the devices.
"""

from __future__ import annotations

import json
from pathlib import Path

from mcpar.auto_layout import PREDICTION_MARGIN
from mcpar.config import JobConfig
from mcpar.device_select import select_device
from mcpar.metrics import write_json_atomic


def _device_type(cfg: JobConfig) -> str:
    return select_device(cfg.training.device).type


def _measure(device_type: str, remeasure: bool) -> None:
    """Measure this machine's profile of ``device_type`` and save it (why: one line)."""
    if device_type == "cuda":
        from mcpar.sim.deviceprofile import load_device_profile

        load_device_profile(remeasure=remeasure)
    else:
        from mcpar.sim.localprofile import load_local_cluster

        load_local_cluster(remeasure=remeasure)


def calibrate_before_plan(cfg: JobConfig) -> None:
    """Measure the profile of the job's device now when ``parallelism.auto`` or the profile
    report would price the job on one that is not valid for this machine (``lookup_profile``);
    says why in one line."""
    if not (cfg.parallelism.auto or cfg.training.profile.enabled):
        return
    from mcpar.sim.profilestore import lookup_profile

    device_type = _device_type(cfg)
    found = lookup_profile(device_type=device_type)
    if found.status != "valid":
        _measure(device_type, remeasure=found.status == "broken")


def remeasure_after_drift(cfg: JobConfig, run_dir: Path) -> None:
    """Measure the local profile again when the run's step was off the prediction by more than
    the margin; record it in ``summary.json``'s ``prediction`` (``profile_remeasured``)."""
    if not cfg.parallelism.auto:
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
    from mcpar.sim.profilestore import profile_path

    print(f"mcpar: the step was {error:+.0%} off the planner's prediction (margin "
          f"{PREDICTION_MARGIN:.0%}): measuring this machine again so that the next plan is "
          "priced on it", flush=True)
    device_type = _device_type(cfg)
    _measure(device_type, remeasure=True)
    prediction["profile_remeasured"] = str(profile_path(device_type))
    write_json_atomic(path, summary)
