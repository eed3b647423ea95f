"""A CUDA job is planned and predicted at the rates measured on its device: the measurement runs
(here on the CPU, with small sizes: the same code, the device explicit), its profile is keyed to
the accelerator and refused on another one, and the cluster built from it carries the measured
rates, which move the cost model's step."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mcpar.sim import deviceprofile, profilestore
from mcpar.sim.costmodel import simulate
from mcpar.sim.deviceprofile import device_cluster, measure_device, table_row
from mcpar.sim.hardware import LocalProfile, load_accelerators
from mcpar.sim.profilestore import (
    DEVICE_PROFILE_ENV,
    field_problems,
    lookup_profile,
    machine_key,
    save_profile,
)
from mcpar.sim.runs import packaged_runs

H100 = "NVIDIA H100 80GB HBM3"
MEASURED = LocalProfile(
    cores=1, flops_per_thread=6e14, attention_flops_per_thread=3e14, mem_bw_per_thread=2.8e12,
    mem_bw_total=2.8e12, op_overhead_s=8e-6, layer_overhead_s=2e-5, mask_rate_per_thread=0.0,
    collectives={"ar": [2e-5, 2.5e-12], "p2p": [1e-5, 3e-12]},
    notes={"bf16_flops": 6e14, "fp32_flops": 3.5e14})


def test_the_measurement_runs_on_an_explicit_device_and_gives_rates() -> None:
    small = {"gemm": 128, "attention": (1, 2, 64, 16), "stream": 1 << 16}
    profile = measure_device(torch.device("cpu"), "fp32", small, seconds=0.02)
    for rate in (profile.flops_per_thread, profile.attention_flops_per_thread,
                 profile.mem_bw_total, profile.notes["fp32_flops"]):
        assert math.isfinite(rate) and rate > 0
    assert profile.op_overhead_s > 0 and profile.layer_overhead_s >= 0
    assert profile.collectives == {}  # no second CUDA device to time a collective with
    # One device has no peer: a profile without collectives is sound on CUDA, not on the CPU.
    assert field_problems(profile, Path("p.json"), "fix", needs_collectives=False) == []
    assert any("collectives.ar" in line for line in field_problems(profile, Path("p.json"), "fix"))


def test_the_cluster_carries_the_measured_rates() -> None:
    accel, words = table_row(H100)
    assert accel.name.startswith("H100") and H100 in words
    cluster = device_cluster(MEASURED, accel, 8)
    assert cluster.accel.peak("bf16") == 6e14 and cluster.accel.peak("fp32") == 3.5e14
    assert cluster.accel.hbm_bw == 2.8e12 and cluster.accel.attention_share == 1.0
    assert cluster.efficiency is not None
    assert cluster.efficiency.gemm == 1.0 and cluster.efficiency.attention == pytest.approx(0.5)
    assert cluster.op_costs["ar"] == (2e-5, 2.5e-12)
    # Measured between two devices of one host: not the price of a group across nodes.
    assert device_cluster(MEASURED, accel, 16).op_costs == {}
    # A device without a row is priced as the reference GPU, and says so.
    ref, words = table_row("Some Future GPU")
    assert ref.name == load_accelerators()[deviceprofile.REFERENCE_GPU].name
    assert "has no row" in words


def test_the_measured_rates_move_the_prediction() -> None:
    run = next(r for r in packaged_runs(load_accelerators())
               if r.cluster.accel.name.startswith("H100") and r.layout.precision == "bf16")
    accel, world = table_row(H100)[0], run.cluster.num_gpus
    fast = simulate(run.model, run.layout, device_cluster(MEASURED, accel, world))
    half = LocalProfile(**{**MEASURED.__dict__, "flops_per_thread": 3e14,
                           "notes": {"bf16_flops": 3e14, "fp32_flops": 1.75e14}})
    slow = simulate(run.model, run.layout, device_cluster(half, accel, world))
    assert slow.step_s > 1.3 * fast.step_s


def test_a_device_profile_is_keyed_to_the_accelerator(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cuda_profile.json"
    monkeypatch.setattr(profilestore, "accelerators", lambda: (H100, 8))
    key = machine_key("cuda", "nccl")
    assert key["accelerator"] == H100 and key["accelerators"] == 8 and key["backend"] == "nccl"
    save_profile(MEASURED, path, key)
    assert lookup_profile(path, "cuda").profile == MEASURED
    # Another card, or as many cards but read as the CPU's profile: stale, naming what differs.
    monkeypatch.setattr(profilestore, "accelerators", lambda: ("NVIDIA A100-SXM4-80GB", 8))
    found = lookup_profile(path, "cuda")
    assert found.status == "stale" and "accelerator" in found.why and "A100" in found.why
    monkeypatch.setattr(profilestore, "accelerators", lambda: (H100, 8))
    assert lookup_profile(path).status == "stale"
    # A single device's profile (no collectives) is sound on CUDA.
    single = LocalProfile(**{**MEASURED.__dict__, "collectives": {}})
    save_profile(single, path, key)
    assert lookup_profile(path, "cuda").status == "valid"


def test_a_cuda_job_is_planned_on_its_measured_profile(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "cuda_profile.json"
    monkeypatch.setenv(DEVICE_PROFILE_ENV, str(path))
    monkeypatch.setattr(profilestore, "accelerators", lambda: (H100, 1))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: H100)
    from mcpar.controllers.memory.placement import ranking_cluster

    cluster, words = ranking_cluster("cuda", 8)
    assert "python -m mcpar.sim.deviceprofile" in words  # none saved yet: the table's row
    assert cluster.accel.peak("bf16") == table_row(H100)[0].peak("bf16")
    save_profile(MEASURED, path, machine_key("cuda", "nccl"))
    cluster, words = ranking_cluster("cuda", 8)
    assert "rates measured on it" in words and str(path) in words
    assert cluster.accel.peak("bf16") == 6e14


def test_a_cuda_job_measures_its_device_before_the_plan(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The launcher measures the CUDA device (in a process of its own, here replaced) when its
    profile is missing, and saves it keyed to the accelerator; a valid one is not measured."""
    from conftest import TINY

    from mcpar.commands import calibration
    from mcpar.config import load_config

    path = tmp_path / "cuda_profile.json"
    calls: list[str] = []
    monkeypatch.setenv(DEVICE_PROFILE_ENV, str(path))
    monkeypatch.setattr(profilestore, "accelerators", lambda: (H100, 2))
    monkeypatch.setattr(calibration, "_device_type", lambda cfg: "cuda")
    monkeypatch.setattr(deviceprofile, "_measured_apart",
                        lambda precision: calls.append(precision) or MEASURED)
    cfg = load_config(None, [*TINY, "parallelism.auto=true"])
    calibration.calibrate_before_plan(cfg)
    assert calls == ["bf16"]
    assert lookup_profile(path, "cuda").profile == MEASURED
    calibration.calibrate_before_plan(cfg)
    assert calls == ["bf16"]  # valid now: not measured again
