"""The MemoryController's placement to a memory budget (``controllers/memory/placement.py``):
three budgets from "every plan fits" to "only full recompute + offload fits", each trained for
one step at data 2: the chosen plan's measured peak fits the budget, and, enumerating the whole
searched space, every plan cheaper than the chosen one does not fit; ``mcpar check`` prints the
choice and why, and a budget nothing fits exits 2 naming the key and what the smallest plan needs.

On a CPU device nvme offload's two streaming buffers are host memory like the state they
replace: small buffers (``offload_buffer_mb``) make offload save memory here as it does on a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, run_cli_in_process, spawn_workers, train_in_turn

from mcpar.config import load_config
from mcpar.controllers.memory.placement import Plan, search
from mcpar.launch.env import find_free_port
from mcpar.plan import resolve_plan

WORLD = 2
BASE = [*TINY, "model.num_layers=4", "model.seq_len=64", "training.steps=1",
        "optimization.micro_batch_size=4", "optimization.global_batch_size=8",
        "optimization.checkpoint.interval=0", "controllers.memory.consistency_interval=0",
        "parallelism.data=2", "controllers.memory.offload_buffer_mb=0.01"]
BUDGET = "controllers.memory.memory_budget_gb"


def _space() -> list[Plan]:
    """Every plan the placement searches for BASE, cheapest first."""
    cfg = load_config(None, [*BASE, f"{BUDGET}=1"])
    plans, fixed = search(cfg, resolve_plan(cfg, WORLD).parallel_dims(), "cpu")
    assert not fixed and len(plans) == 4 * 2 * 15  # ZeRO 0-3 x offload x block counts of 4
    return plans


def _budgets(plans: list[Plan]) -> dict[str, float]:
    """Everything fits; half-way; only the smallest plan (full recompute + offload) fits."""
    peaks = sorted(p.peak_bytes for p in plans)
    return {"all": peaks[-1] * 1.05, "middle": (peaks[0] + peaks[-1]) / 2,
            "tightest": peaks[0] * 1.01}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Plan], dict[str, float], Path]:
    plans = _space()
    budgets = _budgets(plans)
    root = tmp_path_factory.mktemp("placement")
    settings = {name: [*BASE, f"{BUDGET}={budget / 2**30!r}"] for name, budget in budgets.items()}
    spawn_workers(train_in_turn, args=(find_free_port(), str(root), settings, WORLD),
                  nprocs=WORLD)
    return plans, budgets, root


@pytest.mark.parametrize("name", ["all", "middle", "tightest"])
def test_the_chosen_plan_fits_and_no_cheaper_plan_does(
        runs: tuple[list[Plan], dict[str, float], Path], name: str) -> None:
    plans, budgets, root = runs
    budget = budgets[name]
    chosen = json.loads((root / name / "plan.json").read_text())["memory_plan"]["chosen"]
    blocks = chosen["recompute_blocks"]
    key = (chosen["zero_stage"], chosen["offload"],
           (blocks["none"], blocks["selective"], blocks["full"]))
    plan = next(p for p in plans if (p.zero_stage, p.offload, p.blocks) == key)
    measured = json.loads((root / name / "summary.json").read_text())["memory"]["measured"]
    print(name, plan.describe(), f"budget {budget:,.0f} B, estimated {plan.peak_bytes:,.0f}, "
          f"measured {measured['total']:,} B")
    assert measured["total"] <= budget, (name, measured, budget)
    cheaper = [p for p in plans if p.step_s < plan.step_s]
    assert all(p.peak_bytes > budget for p in cheaper), (name, plan.describe())
    if name == "all":
        assert plan is plans[0]  # the cheapest of all
    else:
        assert cheaper  # the budget rejected something
    if name == "tightest":  # only full recompute of every block, with offload, fits
        fitting = [p for p in plans if p.peak_bytes <= budget]
        assert blocks["full"] == 4 and chosen["offload"] == "nvme"
        assert all(p.blocks == (0, 0, 4) and p.offload == "nvme" for p in fitting), fitting


def test_check_prints_the_choice_and_exits_2_when_nothing_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plans = _space()
    budgets = _budgets(plans)
    config = tmp_path / "job.yaml"
    config.write_text("model:\n  num_layers: 4\n  hidden_size: 32\n  num_heads: 2\n"
                      "  seq_len: 64\nparallelism:\n  data: 2\noptimization:\n"
                      "  micro_batch_size: 4\n  global_batch_size: 8\ncontrollers:\n"
                      "  memory:\n    offload_buffer_mb: 0.01\n")
    middle = run_cli_in_process(capsys, "check", str(config), "--set",
                                f"{BUDGET}={budgets['middle'] / 2**30!r}")
    assert middle.returncode == 0, middle.stderr
    assert "  chosen: ZeRO " in middle.stdout and "do not fit" in middle.stdout
    smallest = min(p.peak_bytes for p in plans)
    refused = run_cli_in_process(capsys, "check", str(config), "--set",
                                 f"{BUDGET}={smallest * 0.9 / 2**30!r}")
    assert refused.returncode == 2
    assert BUDGET in refused.stderr and f"{round(smallest):,} B" in refused.stderr
    assert "Traceback" not in refused.stderr


# A calibrated 2-thread CPU (this machine's kind): slow matmuls and a large fixed cost per
# block make recompute dear beside nvme offload, which an A100's figures price the other way.
CPU_PROFILE = {"flops_per_thread": 7.4e10, "attention_flops_per_thread": 2.2e10,
               "mem_bw_per_thread": 1.1e10, "mem_bw_total": 8.9e9, "op_overhead_s": 5e-5,
               "layer_overhead_s": 7.5e-4,
               "collectives": {"ar": [5.5e-3, 3.9e-10], "ag": [6.8e-3, 7.9e-10],
                               "rs": [3.3e-3, 2.8e-9], "p2p": [4.3e-3, 1.1e-9]},
               "notes": {"flops_all_cores": 4.2e10}}


def _save_cpu_profile(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      machine: dict | None = None) -> Path:
    """CPU_PROFILE saved as measured on this machine (or on ``machine``), in MCPAR_LOCAL_PROFILE."""
    from mcpar.sim.hardware import LocalProfile
    from mcpar.sim.profilestore import PROFILE_ENV, cores, save_profile

    path = tmp_path / "local_profile.json"
    save_profile(LocalProfile(cores=cores(), **CPU_PROFILE), path, machine)
    monkeypatch.setenv(PROFILE_ENV, str(path))
    return path


def test_a_cpu_job_is_ranked_on_this_machine_not_a_gpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from mcpar.controllers.memory.placement import place
    from mcpar.sim.hardware import load_accelerators, make_cluster

    profile = _save_cpu_profile(tmp_path, monkeypatch)
    cfg = load_config(None, [*BASE, "training.device=cpu", "controllers.memory.zero_stage=0",
                             f"{BUDGET}=1"])
    dims = resolve_plan(cfg, WORLD).parallel_dims()
    plans, _ = search(cfg, dims, "cpu")
    # The budget holds nvme offload without recompute, and recompute without offload.
    offload = next(p for p in plans if p.offload == "nvme" and p.blocks == (4, 0, 0))
    budget = offload.peak_bytes * 1.001
    placed = place(load_config(None, [*BASE, "training.device=cpu",
                                      "controllers.memory.zero_stage=0",
                                      f"{BUDGET}={budget / 2**30!r}"]), dims)
    assert placed is not None
    assert str(profile) in placed.machine and "A100" not in placed.machine
    assert any(str(profile) in line for line in placed.report_lines())
    assert (placed.chosen.offload, placed.chosen.blocks) == ("nvme", (4, 0, 0))
    # On the reference GPU's figures the same budget goes to recompute without offload.
    a100 = load_accelerators()["a100-80gb"]
    gpu = (make_cluster(a100, WORLD, WORLD, a100.typical_inter_gbps), "A100-80GB")
    on_gpu = [p for p in search(cfg, dims, "cpu", gpu)[0] if p.peak_bytes <= budget][0]
    assert on_gpu.offload == "none" and on_gpu.blocks != (4, 0, 0)


@pytest.mark.parametrize("stale", ["torch", "edited"])
def test_a_stale_local_profile_is_not_what_a_cpu_job_is_ranked_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stale: str) -> None:
    """A profile measured under another torch, or edited since: the placement ranks on the
    declared figures and its report says why, as the MFU's peak does (one rule)."""
    from mcpar.controllers.memory.placement import DECLARED_CPU, ranking_cluster
    from mcpar.sim.profilestore import cores, machine_key

    machine = {**machine_key(), "torch": "1.0.0"} if stale == "torch" else None
    path = _save_cpu_profile(tmp_path, monkeypatch, machine)
    if stale == "edited":
        doc = json.loads(path.read_text())
        path.write_text(json.dumps({**doc, "layer_overhead_s": 1e-9}))  # made cheap by hand
    cluster, what = ranking_cluster("cpu", WORLD)
    assert "declared figures" in what and str(path) in what
    assert ("torch '1.0.0' there" if stale == "torch" else "was edited") in what
    assert cluster.accel.peak_flops["fp32"] == DECLARED_CPU.flops_per_thread
    assert cluster.cores == cores()
