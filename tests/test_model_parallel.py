"""Tensor, sequence and pipeline parallelism: loss parity with the single-process run.

Every layout trains the same model on the same global batch (8 sequences) for 20 steps with real
worker processes on gloo; its per-step losses must match the single-process run (DESIGN.md §5).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import assert_loss_parity, run_cli_in_process, sets, train_metrics

from mcpar.config import apply_overrides, parse_config
from mcpar.metrics import read_metrics
from mcpar.models.spec import get_model_spec

STEPS = 20
MODEL = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5", f"training.steps={STEPS}", "optimization.global_batch_size=8",
]

# name -> (workers, settings)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "tensor2": (2, ["parallelism.tensor=2", "optimization.micro_batch_size=8"]),
    "tensor2_sp": (2, ["parallelism.tensor=2", "parallelism.sequence_parallel=true",
                       "optimization.micro_batch_size=8"]),
    "tensor4_sp": (4, ["parallelism.tensor=4", "parallelism.sequence_parallel=true",
                       "optimization.micro_batch_size=4"]),
    "pipeline2_1f1b": (2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2"]),
    "pipeline2_gpipe": (2, ["parallelism.pipeline=2", "parallelism.schedule=gpipe",
                            "optimization.micro_batch_size=2"]),
    "pipeline4_1f1b": (4, ["parallelism.pipeline=4", "optimization.micro_batch_size=1"]),
    "pipeline2_interleaved": (2, ["parallelism.pipeline=2", "parallelism.virtual_stages=2",
                                  "parallelism.schedule=interleaved_1f1b",
                                  "optimization.micro_batch_size=2"]),
    "data2_tensor2": (4, ["parallelism.tensor=2", "optimization.micro_batch_size=4"]),
    "data2_pipeline2": (4, ["parallelism.pipeline=2", "optimization.micro_batch_size=1"]),
    "tensor2_pipeline2_sp": (4, ["parallelism.tensor=2", "parallelism.pipeline=2",
                                 "parallelism.sequence_parallel=true",
                                 "optimization.micro_batch_size=2"]),
    "data2_tensor2_pipeline2": (8, ["parallelism.tensor=2", "parallelism.pipeline=2",
                                    "optimization.micro_batch_size=1"]),
}


def train(run_dir: Path, nproc: int, settings: list[str]) -> list[dict]:
    return train_metrics(run_dir, nproc, [*MODEL, *settings])


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    return train(tmp_path_factory.mktemp("ref") / "run", 1, ["optimization.micro_batch_size=8"])


@pytest.fixture(scope="module")
def layout_run(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The run directory of a layout, trained on first use and shared by the tests below."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            run = tmp_path_factory.mktemp(name) / "run"
            train(run, *LAYOUTS[name])
            done[name] = run
        return done[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_parity(reference: list[dict], name: str,
                     layout_run: Callable[[str], Path]) -> None:
    nproc, _ = LAYOUTS[name]
    run = layout_run(name)
    records = read_metrics(run)
    assert len(records) == STEPS
    assert_loss_parity(reference, records, name)
    assert abs(reference[-1]["val_loss"] - records[-1]["val_loss"]) <= 1e-3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["layout"]["world_size"] == nproc
    # The replicas' straggling is logged where there are replicas, and only there (tensor and
    # pipeline ranks are not each other's replicas).
    replicated = summary["layout"]["data"] > 1
    assert all(("slowest_rank" in r) == replicated for r in records), name
    assert all(0 <= r["slowest_rank"] < nproc and r["grad_sync_spread_s"] >= 0
               for r in records if replicated)


@pytest.mark.slow
def test_tensor2_halves_parameters_except_replicated_ones(
        tmp_path: Path, layout_run: Callable[[str], Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    h, layers, seq, vocab = 32, 4, 32, 256
    full = get_model_spec("gpt").num_params(parse_config(apply_overrides({}, MODEL)).model)
    # Replicated under tensor parallelism: 2 LayerNorms + 2 row-parallel biases per block,
    # the position embedding and the final LayerNorm.
    replicated = layers * 6 * h + seq * h + 2 * h
    expected = (full - replicated) // 2 + replicated
    assert vocab % 2 == 0 and expected < 0.52 * full

    config = tmp_path / "tp2.yaml"
    config.write_text("parallelism: {tensor: 2, data: 1}\n")
    check = run_cli_in_process(capsys, "check", str(config),
                               *sets(*MODEL, "optimization.micro_batch_size=8"))
    assert check.returncode == 0, check.stderr
    assert f"parameters per rank by pipeline position: {expected:,} " in check.stdout

    # What the workers of the tensor-2 run (the parity test's) really held.
    summary = json.loads((layout_run("tensor2") / "summary.json").read_text())
    assert summary["max_params_per_rank"] == expected
    assert summary["num_params"] == full
