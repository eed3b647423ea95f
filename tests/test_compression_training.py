"""Compressed data parallelism inside `mcpar train`: 1-bit Adam (flat and hierarchical),
PowerSGD and bf16 on the wire, with real workers on gloo.

Checked here: the bytes each codec really sends, that data-parallel replicas stay bit-identical
(every rank applies the same averaged update), and that training still trains. Bitwise equality
with a single-process simulation of 1-bit Adam is in test_onebit_adam.py; bitwise resume of both
codecs in test_checkpoint.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TINY, train_metrics

from mcpar.checkpoint.manager import load_tensors
from mcpar.config import apply_overrides, parse_config
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.metrics import read_metrics
from mcpar.models.spec import get_model_spec

STEPS = 20
FREEZE = 6
OVERLAP_BUCKET_MB = 0.04
BASE = [*TINY, f"training.steps={STEPS}", "optimization.global_batch_size=8",
        "optimization.micro_batch_size=2",
        "optimization.checkpoint.interval=20", "optimization.checkpoint.strategy=full"]
RUNS = {
    "adamw": (2, []),
    "onebit": (2, ["controllers.communication.compression=1bit",
                   f"optimization.freeze_step={FREEZE}"]),
    # Exchanged bucket by bucket from the backward pass (no clipping, several small buckets).
    "onebit_overlap": (2, ["controllers.communication.compression=1bit",
                           f"optimization.freeze_step={FREEZE}", "optimization.grad_clip=0",
                           f"controllers.communication.bucket_size_mb={OVERLAP_BUCKET_MB}"]),
    "onebit_hierarchical": (4, ["controllers.communication.compression=1bit",
                                f"optimization.freeze_step={FREEZE}",
                                "controllers.communication.topology=hierarchical",
                                "cluster.ranks_per_node=2"]),
    "powersgd": (2, ["controllers.communication.compression=powersgd",
                     "controllers.communication.powersgd_start_step=5",
                     "controllers.communication.powersgd_rank=2"]),
    "bf16": (2, ["controllers.communication.compression=bf16"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compression")
    out = {}
    for name, (nproc, settings) in RUNS.items():
        train_metrics(root / name, nproc, [*BASE, *settings])
        out[name] = root / name
    return out


def grad_bytes() -> float:
    return 4.0 * get_model_spec("gpt").num_params(parse_config(apply_overrides({}, TINY)).model)


def replicas_identical(run: Path, nproc: int) -> None:
    model = load_tensors(run / "checkpoints" / f"step-{STEPS}", "model/")
    by_replica: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in model.items():
        coord, name = key.split("/")[1], key.split("/", 2)[2]
        replica = coord.split("-dp")[1]
        by_replica.setdefault(replica, {})[name] = value
    assert len(by_replica) == nproc
    first = by_replica["0"]
    for other in by_replica.values():
        assert other.keys() == first.keys()
        assert all(torch.equal(other[k], first[k]) for k in first)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_replicas_stay_identical_and_training_trains(runs: dict[str, Path], name: str) -> None:
    replicas_identical(runs[name], RUNS[name][0])
    losses = [r["loss"] for r in read_metrics(runs[name])]
    assert losses[-1] < losses[0] - 0.5, losses


@pytest.mark.slow
def test_onebit_sends_under_a_25th_of_the_fp32_all_reduce(runs: dict[str, Path]) -> None:
    records = read_metrics(runs["onebit"])
    fp32 = 2 * (2 - 1) / 2 * grad_bytes()
    for record in records[:FREEZE]:  # warm-up: the plain all-reduce (+ the 16-byte stats)
        assert abs(record["comm_bytes"] / fp32 - 1) < 0.01
    for record in records[FREEZE:]:
        assert record["comm_bytes"] <= fp32 / 25, record
        # signs of (n-1)/n of the padded momentum out and in, 1 bit each: about 1/32
        assert record["comm_bytes"] >= fp32 / 40, record


@pytest.mark.slow
def test_onebit_overlap_exchanges_each_bucket(runs: dict[str, Path]) -> None:
    cfg = parse_config(apply_overrides({}, TINY)).model
    model = get_model_spec("gpt").build(cfg, 0)
    num_buckets = len(DataParallelGradSync(list(model.parameters()),
                                           bucket_size_mb=OVERLAP_BUCKET_MB).buckets)
    assert num_buckets >= 3
    summary = json.loads((runs["onebit_overlap"] / "summary.json").read_text())
    rows = {(r["op"], r["axis"], r["codec"]): r for r in summary["comm"]}
    assert rows[("all_to_all", "dp", "1bit")]["calls"] == 2 * num_buckets * (STEPS - FREEZE)
    fp32 = 2 * (2 - 1) / 2 * grad_bytes()
    for record in read_metrics(runs["onebit_overlap"])[FREEZE:]:
        assert record["comm_bytes"] <= fp32 / 25, record


@pytest.mark.slow
def test_onebit_hierarchical_compresses_only_across_nodes(runs: dict[str, Path]) -> None:
    summary = json.loads((runs["onebit_hierarchical"] / "summary.json").read_text())
    rows = {(r["op"], r["axis"], r["codec"]): r for r in summary["comm"]}
    # Inside the node: fp32 reduce-scatter and all-gather; across nodes: 1-bit exchange.
    # Two all-to-alls per compressed step: the workers' signs, then the servers'.
    assert rows[("all_to_all", "dp_inter", "1bit")]["calls"] == 2 * (STEPS - FREEZE)
    assert ("reduce_scatter", "dp_intra", "none") in rows
    assert not any(axis == "dp" and codec == "1bit" for _, axis, codec in rows)
    inter_bytes = sum(r["bytes"] for (op, axis, codec), r in rows.items()
                      if axis == "dp_inter" and codec == "1bit")
    # Per compressed step, each rank's 1/2 shard crosses nodes at about 1 bit per element.
    assert inter_bytes / (STEPS - FREEZE) < grad_bytes() / 2 / 25


@pytest.mark.slow
def test_powersgd_sends_the_low_rank_factors(runs: dict[str, Path]) -> None:
    records = read_metrics(runs["powersgd"])
    fp32 = grad_bytes()
    assert abs(records[0]["comm_bytes"] / fp32 - 1) < 0.01  # before start: plain all-reduce
    for record in records[5:]:
        assert record["comm_bytes"] < fp32 / 3, record


@pytest.mark.slow
def test_bf16_on_the_wire_halves_bytes_and_keeps_the_losses(runs: dict[str, Path]) -> None:
    reference = read_metrics(runs["adamw"])
    records = read_metrics(runs["bf16"])
    for ref, rec in zip(reference, records, strict=True):
        assert abs(rec["comm_bytes"] / ref["comm_bytes"] - 0.5) < 0.01
        assert abs(rec["loss"] - ref["loss"]) < 0.02 * ref["loss"]
