"""The GPU path's checks that run on a CPU: bench/gpu_check.py at CI size (``--dry-run``), so
the prepared device check cannot rot, and the training step's device synchronizations, counted
(on CUDA each one stalls the host until the device drains: only the step timing's may remain)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, TINY, run_cli_in_process, sets

import mcpar.device
import mcpar.trainer  # noqa: F401  (the training path's modules, to patch)


@pytest.mark.slow
def test_gpu_check_dry_run_writes_every_section(tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_check.py"), "--dry-run",
                           "--out", str(tmp_path)], capture_output=True, text=True, env=env,
                          timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "gpu_check: done" in (tmp_path / "gpu_check.log").read_text()
    assert report["dry_run"] is True
    for kind in ("gpt", "llama", "moe"):
        assert report["parity"][kind]["max_abs_delta"] == 0.0  # the CPU against itself
        assert len(report["parity"][kind]["cpu"]) == 2
    grouped = report["grouped_experts"]["float32"]
    assert max(grouped["max_abs_diff"].values()) <= 1e-5 and grouped["equal_within_1e-5"]
    assert "fallback" in grouped["auto_kernel"]  # the CPU runs the loop and says so
    assert report["onebit"]["roundtrip_exact"] is True
    rates = report["device_profile"]["profile"]
    assert rates["flops_per_thread"] > 0 and rates["mem_bw_total"] > 0
    assert set(report["device_profile"]["measured_over_fitted"]) == {"gemm", "attention", "stream"}
    assert report["multi_rank"]["data2"]["ok"], report["multi_rank"]
    eager = report["throughput"]["eager"]
    assert eager["tokens_per_s"] > 0 and 0.5 < eager["measured_over_estimate"] < 2.0


def test_a_training_step_synchronizes_the_device_only_to_time_it(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
        tmp_path: Path) -> None:
    """Every module's reference to ``device.synchronize`` is counted, a MoE model trained 3
    steps: 2 per step (before and after the timed step), nothing in the forward, backward,
    gradient exchange or update."""
    calls: list[object] = []
    original = mcpar.device.synchronize

    def counting(device: object) -> None:
        calls.append(device)
        original(device)  # type: ignore[arg-type]

    for module in list(sys.modules.values()):
        if (module is not None and module.__name__.startswith("mcpar")
                and getattr(module, "synchronize", None) is original):
            monkeypatch.setattr(module, "synchronize", counting)
    steps = 3
    proc = run_cli_in_process(
        capsys, "train", *sets(*TINY, "model.kind=moe", "model.num_experts=4",
                               f"training.steps={steps}"),
        "--nproc", "1", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len(calls) == 2 * steps
