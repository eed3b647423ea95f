"""The MemoryController's estimate against what a step really holds (``controllers/memory/
measure.py``): the peak per rank within 10% on layouts mixing data, tensor and pipeline
parallelism, ZeRO stages, recompute, offload and precision, all trained in one launch of four
workers; and recompute's measured savings at least what the estimate predicts, on three model
shapes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import TINY, spawn_workers, train_in_turn

from mcpar.config import load_config
from mcpar.launch.env import find_free_port
from mcpar.plan import resolve_plan
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.memory import rank_activations
from mcpar.trainer import Trainer

WORLD = 4
BASE = [*TINY, "model.num_layers=4", "model.seq_len=64", "training.steps=1",
        "optimization.micro_batch_size=2", "optimization.global_batch_size=8",
        "optimization.checkpoint.interval=0", "controllers.memory.consistency_interval=0"]
MEM = "controllers.memory."
# name -> settings: every parallelism, every ZeRO stage, every recompute mode, both dtypes.
LAYOUTS = {
    "data4-zero1": ["parallelism.data=4", f"{MEM}zero_stage=1"],
    "data2-tensor2-selective": ["parallelism.tensor=2", f"{MEM}activation_checkpointing="
                                "selective"],
    "data2-pipeline2-full": ["parallelism.pipeline=2", f"{MEM}activation_checkpointing=full"],
    "tensor2-pipeline2-bf16": ["parallelism.tensor=2", "parallelism.pipeline=2",
                               "training.dtype=bfloat16"],
    "data4-zero3-full": ["parallelism.data=4", f"{MEM}zero_stage=3",
                         f"{MEM}activation_checkpointing=full"],
    # One block per gather, and two (0.07 MiB; a block is 0.05): the default groups this
    # model's small blocks 4 at a time, the whole chunk.
    "data4-zero3-full-per-block": ["parallelism.data=4", f"{MEM}zero_stage=3",
                                   f"{MEM}activation_checkpointing=full", f"{MEM}gather_mb=0"],
    "data4-zero3-full-pairs": ["parallelism.data=4", f"{MEM}zero_stage=3",
                               f"{MEM}activation_checkpointing=full", f"{MEM}gather_mb=0.07"],
    "data2-pipeline2-zero2-bf16": ["parallelism.pipeline=2", f"{MEM}zero_stage=2",
                                   "training.dtype=bfloat16"],
    # Offload: the state leaves the device, two small streaming buffers stay (host = device).
    "data4-zero1-nvme": ["parallelism.data=4", f"{MEM}zero_stage=1", f"{MEM}offload=nvme",
                         f"{MEM}offload_buffer_mb=0.01"],
    "data4-nvme-bf16-selective": [
        "parallelism.data=4", f"{MEM}offload=nvme", f"{MEM}offload_buffer_mb=0.01",
        "training.dtype=bfloat16", f"{MEM}activation_checkpointing=selective"],
    # Dropout on CPU: attention falls back to the math kernel (fp32 scores), masks at full width.
    "data2-tensor2-dropout": ["parallelism.tensor=2", "model.dropout=0.1"],
    # Split backwards: what W's store keeps is counted until W (ZB-H1, and the V of ZBV with
    # the first and last stages on rank 0).
    "data2-pipeline2-zb_h1": ["parallelism.pipeline=2", "parallelism.schedule=zb_h1"],
    "data2-pipeline2-zbv": ["parallelism.pipeline=2", "parallelism.schedule=zbv",
                            "parallelism.virtual_stages=2"],
    "data2-pipeline2-dropout-selective-bf16": [
        "parallelism.pipeline=2", "model.dropout=0.1", "training.dtype=bfloat16",
        f"{MEM}activation_checkpointing=selective"],
}


@pytest.fixture(scope="module")
def memory(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict[str, int]]]:
    root = tmp_path_factory.mktemp("memory")
    runs = {name: [*BASE, *settings] for name, settings in LAYOUTS.items()}
    spawn_workers(train_in_turn, args=(find_free_port(), str(root), runs, WORLD), nprocs=WORLD)
    return {name: json.loads((root / name / "summary.json").read_text())["memory"]
            for name in LAYOUTS}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_estimate_is_within_10_percent_of_the_measured_peak(
        memory: dict[str, dict[str, dict[str, int]]], name: str) -> None:
    """``summary.json`` sets the estimate beside the measurement of the rank holding the most;
    their totals agree within 10%, and so do the model states (counted from the tensors)."""
    estimate, measured = memory[name]["estimate"], memory[name]["measured"]
    print(name, {k: (estimate[k], measured.get(k)) for k in estimate})
    assert abs(estimate["total"] - measured["total"]) <= 0.10 * measured["total"], (
        name, estimate, measured)
    assert measured["activations"] > 0
    offloaded = "nvme" in name
    assert ("optimizer state off device" in estimate) == offloaded
    if offloaded:  # nothing of the state on the device but the streaming buffers
        assert estimate["optimizer state"] == measured["optimizer state"] == 0
        assert 0 < measured["communication buffers"] <= 2 * 0.01 * 2**20
    for row in ("parameters", "gradients", "optimizer state", "activations"):
        assert abs(estimate[row] - measured[row]) <= 0.10 * measured["total"], (name, row)
    if "pipeline2" in name and "zero" not in name:
        # Nothing else on the wire but the receives a rank keeps posted ahead: on CPU two, from
        # its one peer at pipeline 2, each a micro-batch's residual stream.
        assert estimate["communication buffers"] == measured["communication buffers"] > 0, name


def test_zero3_gathers_what_the_estimate_says(
        memory: dict[str, dict[str, dict[str, int]]]) -> None:
    """ZeRO-3's gathered working set (the largest sum of the parameters' storages while the
    step saves tensors) is the estimate's: the root parameters, the block computing and the
    group prefetched behind it, at most the chunk's blocks. Gathering small blocks in groups
    (``gather_mb``) holds more at once: 2, 3 and 4 of the 4 blocks, grouped by 1, 2 and 4."""
    row = "gathered working set"
    rows = {name: (memory[name]["estimate"][row], memory[name]["measured"][row])
            for name in ("data4-zero3-full-per-block", "data4-zero3-full-pairs",
                         "data4-zero3-full")}
    for name, (estimate, measured) in rows.items():
        assert abs(estimate - measured) <= 0.05 * estimate, (name, rows)
    one, two, four = (measured for _, measured in rows.values())
    block = (four - one) / 2  # the root is in all three
    assert two - one == pytest.approx(block, rel=0.05), rows


# Three shapes (layers, width, heads, sequence, kind) for recompute's savings.
SHAPES = {
    "gpt-narrow": ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
                   "model.seq_len=64"],
    "gpt-wide": ["model.num_layers=3", "model.hidden_size=64", "model.num_heads=4",
                 "model.seq_len=32"],
    "llama-gqa": ["model.kind=llama", "model.num_layers=2", "model.hidden_size=32",
                  "model.num_heads=4", "model.num_kv_heads=2", "model.seq_len=64"],
    # Under dropout CPU attention keeps its s^2 scores, which selective recompute drops.
    "gpt-dropout": ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
                    "model.seq_len=256", "model.dropout=0.1"],
    "llama-dropout-bf16": ["model.kind=llama", "model.num_layers=2", "model.hidden_size=32",
                           "model.num_heads=4", "model.num_kv_heads=2", "model.seq_len=128",
                           "model.dropout=0.1", "training.dtype=bfloat16"],
}
RECOMPUTE = ("none", "selective", "full")


def _single_process_memory(root: Path, settings: list[str]) -> tuple[dict[str, int], float]:
    """One step trained in this process: the measured rows and the estimated activations."""
    cfg = load_config(None, [*TINY, "training.steps=1", "optimization.micro_batch_size=4",
                             "optimization.global_batch_size=4",
                             "optimization.checkpoint.interval=0", *settings])
    run_dir = root / "-".join(s.split("=")[-1] for s in settings)
    run_dir.mkdir()
    plan = resolve_plan(cfg, 1)
    summary = Trainer(plan, run_dir, None).train()
    estimate = max(rank_activations(config_model(plan.config), config_layout(plan.config, 1)))
    return summary["memory"]["measured"], estimate


@pytest.mark.parametrize("shape", list(SHAPES))
def test_recompute_saves_at_least_what_the_estimate_predicts(shape: str, tmp_path: Path) -> None:
    """Selective and full recompute: the measured activation bytes drop by at least the
    fraction the estimate predicts (to within 10% of that fraction). Full recompute drops most
    of them; selective, with the flash kernel, drops only the log-sum-exp and adds the
    re-forward's output, a small rise the measurement sees as well."""
    measured, estimated = {}, {}
    for mode in RECOMPUTE:
        rows, estimated[mode] = _single_process_memory(
            tmp_path, [*SHAPES[shape], f"{MEM}activation_checkpointing={mode}"])
        measured[mode] = rows["activations"]
    for mode in ("selective", "full"):
        predicted = 1 - estimated[mode] / estimated["none"]
        seen = 1 - measured[mode] / measured["none"]
        print(shape, mode, f"predicted drop {predicted:+.4f}, measured {seen:+.4f}",
              measured[mode], measured["none"])
        assert seen >= predicted - 0.1 * abs(predicted), (shape, mode, predicted, seen)
        assert abs(seen - predicted) <= 0.1 * abs(predicted), (shape, mode, predicted, seen)
    assert 1 - estimated["full"] / estimated["none"] > 0.2  # the loss and one layer stay


def test_cpu_attention_under_dropout_keeps_what_the_memory_model_prices() -> None:
    """``device_kernels.py``'s facts, read off autograd's saved tensors: on CPU,
    ``scaled_dot_product_attention`` with dropout keeps three fp32 s x s tensors and fp32
    copies of Q, K, V (bfloat16 inputs too), and without dropout only its inputs, output and
    log-sum-exp; so a torch whose kernels change fails here, not silently in the estimate."""
    import torch
    import torch.nn.functional as F

    from mcpar.device_kernels import (
        MATH_ATTENTION_BYTES,
        MATH_ATTENTION_SCORE_TENSORS,
        attention_kernel,
    )

    batch, heads, seq, dim = 2, 4, 64, 16
    for dtype in (torch.float32, torch.bfloat16):
        q, k, v = (torch.randn(batch, heads, seq, dim, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        for dropout in (0.0, 0.1):
            storages: dict[int, int] = {}

            def pack(t: torch.Tensor, into: dict[int, int] = storages) -> torch.Tensor:
                into[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                return t

            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout)
            elements = batch * heads * seq * dim
            scores = batch * heads * seq * seq
            if attention_kernel("cpu", dropout > 0) == "math":
                expected = MATH_ATTENTION_BYTES * (MATH_ATTENTION_SCORE_TENSORS * scores
                                                   + 3 * elements)
            else:  # Q, K, V, the output (its dtype) and the fp32 log-sum-exp
                expected = 4 * elements * q.element_size() + 4 * batch * heads * seq
            assert sum(storages.values()) == expected, (dtype, dropout, storages)


def test_a_cpu_layout_under_dropout_prices_the_math_attention() -> None:
    """The config's layout resolves the kernel once: math on CPU under dropout, flash without
    dropout or on CUDA; the estimate then counts the scores (about 3x the activations here)."""
    from mcpar.sim.memory import rank_activations

    def layout(*settings: str) -> tuple[str, float]:
        cfg = load_config(None, [*TINY, "model.seq_len=256", *settings])
        lay = config_layout(cfg, 1)
        return lay.attention_kind, max(rank_activations(config_model(cfg), lay))

    (off, without), (on, with_dropout) = (
        layout("training.device=cpu"), layout("training.device=cpu", "model.dropout=0.1"))
    assert (off, on) == ("flash", "math")
    assert with_dropout > 2.5 * without
    cuda_kind, _ = layout("training.device=cuda", "model.dropout=0.1")
    assert cuda_kind == "flash"
