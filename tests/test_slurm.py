"""examples/slurm/train.sbatch submitted to a real Slurm: the built-in default job trains under
srun + torchrun, one worker per process, and lands in runs/torchrun-<job id> of the directory it
was submitted from.

It needs a Slurm that answers (``.ci/slurm-setup`` starts a single-node one); without one it is
skipped with the reason. Under CI (CI=true) on a machine that script set up, it must run: a
Slurm that stopped answering there is a failure, not a skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mcpar.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
# Written by .ci/slurm-setup once its node is up.
CI_READY = Path("/run/slurm/mcpar-ci-ready")
STEPS = 20


def _slurm_unavailable() -> str | None:
    """Why no Slurm job can run here, or None when the controller answers with a usable node."""
    missing = [tool for tool in ("sbatch", "sinfo", "scontrol") if shutil.which(tool) is None]
    if missing:
        return f"Slurm is not installed ({', '.join(missing)} not on PATH)"
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True,
                              timeout=20)
    except subprocess.TimeoutExpired:
        return "slurmctld does not answer (sinfo timed out)"
    if proc.returncode != 0:
        return f"slurmctld does not answer: {proc.stderr.strip() or proc.returncode}"
    states = proc.stdout.split()
    if not any(s.rstrip("*~#").startswith(("idle", "mixed", "allocated")) for s in states):
        return f"no Slurm node is up (states: {' '.join(states) or 'none'})"
    return None


def _require_slurm() -> None:
    reason = _slurm_unavailable()
    if reason is None:
        return
    if os.environ.get("CI") == "true" and CI_READY.exists():
        pytest.fail(f".ci/slurm-setup ran on this machine but {reason}")
    pytest.skip(f"{reason}; `bash .ci/slurm-setup` (root, Debian) starts a single-node one")


def _job_env() -> dict[str, str]:
    """This test's Python for the job (sbatch passes the environment on): its bin first on
    PATH, this tree's sources first on PYTHONPATH; no launcher variables of an outer job."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "TORCHELASTIC_"))
           and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                         "MASTER_PORT", "GROUP_RANK", "MCPAR_NODE", "MCPAR_LAUNCHED")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO / "src")] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env["MCPAR_NPROC_PER_NODE"] = "2"  # CPU workers: the CI node has no GPU
    return env


@pytest.mark.slow
def test_sbatch_script_trains_the_default_job(tmp_path: Path) -> None:
    _require_slurm()
    # --nodes=1 on the command line overrides the script's #SBATCH --nodes: the one node here.
    # --time: Slurm itself ends a job that hangs (e.g. a rendezvous nobody joins).
    cmd = ["sbatch", "--parsable", "--wait", "--nodes=1", "--time=10", str(SCRIPT),
           "--steps", str(STEPS), "--set", "training.progress=false"]
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=_job_env(), capture_output=True, text=True,
                              timeout=900)
    except subprocess.TimeoutExpired as err:
        job = (err.stdout or b"").decode().strip().split(";")[0] if err.stdout else ""
        if job:
            subprocess.run(["scancel", job], timeout=20)
        raise
    job_id = proc.stdout.strip().split(";")[0]
    logs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("slurm-*.out"))
    assert proc.returncode == 0, f"sbatch: {proc.stderr[-2000:]}\njob output:\n{logs[-4000:]}"
    assert job_id.isdigit(), proc.stdout

    # Every worker named the run after SLURM_JOB_ID, in the directory sbatch was run from.
    run_dir = tmp_path / "runs" / f"torchrun-{job_id}"
    assert run_dir.is_dir(), f"no {run_dir}; job output:\n{logs[-4000:]}"
    assert (run_dir / "config.yaml").is_file()
    records = read_metrics(run_dir)
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
    # Two workers of one data-parallel job (one process each), not two single-process runs.
    assert records[0]["comm_bytes"] > 0
    assert "tensor 1 x pipeline 1 x data 2" in logs, logs[-4000:]
    assert f"job {job_id}, 1 nodes x 2 workers" in logs
