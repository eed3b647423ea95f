"""ComputeController decisions: cost-balanced partitioning and dynamic batch splitting."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import launch_in_process, sets

from mcpar.config import ModelConfig
from mcpar.controllers.compute.batch_split import choose_num_microbatches, modelled_step_time
from mcpar.controllers.compute.stage_cut import partition_layers, piece_costs
from mcpar.metrics import read_metrics


def test_equal_blocks_split_evenly_when_embedding_and_head_are_cheap() -> None:
    cfg = ModelConfig(num_layers=8, hidden_size=256, num_heads=4, vocab_size=256, seq_len=64)
    assert partition_layers(cfg, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]


def test_a_costly_head_takes_blocks_off_the_last_stage() -> None:
    # A 32k vocabulary makes the head cost several blocks: the last stage gets fewer blocks.
    cfg = ModelConfig(num_layers=8, hidden_size=64, num_heads=4, vocab_size=32768, seq_len=64)
    ranges = partition_layers(cfg, 2)
    assert ranges[0][0] == 0 and ranges[-1][1] == 8
    first, last = (b - a for a, b in ranges)
    assert last < first
    embed, blocks, head = piece_costs(cfg)
    costs = [sum(blocks[a:b]) + (embed if i == 0 else 0) + (head if i == 1 else 0)
             for i, (a, b) in enumerate(ranges)]
    # Layer counting (4 | 4) would be worse than what the partitioner found.
    naive = max(sum(blocks[:4]) + embed, sum(blocks[4:]) + head)
    assert max(costs) < naive


def test_more_stages_than_layers_is_refused() -> None:
    with pytest.raises(ValueError, match="3 layers cannot fill 4 stages"):
        partition_layers(ModelConfig(num_layers=3), 4)


def test_dynamic_split_trades_bubble_against_fixed_cost() -> None:
    def memory(m: int, b: int) -> float:
        return 100.0 * b  # activations grow with the micro-batch

    always = lambda m: True  # noqa: E731
    # Large fixed cost per micro-batch, no pipeline: one big micro-batch is best.
    choice = choose_num_microbatches(16, 0.1, 0.001, 1, 1, "1f1b", memory, 1e9, always)
    assert choice.num_microbatches == 1
    # Pipeline of 4 with a small fixed cost: more micro-batches shrink the bubble.
    choice = choose_num_microbatches(16, 0.0001, 0.01, 4, 1, "1f1b", memory, 1e9, always)
    assert choice.num_microbatches == 16
    assert choice.modelled_step_s == pytest.approx(modelled_step_time(16, 0.0101, 4, 1, "1f1b"))
    # A memory budget that only fits micro-batches of 2 sequences forces 8 of them.
    choice = choose_num_microbatches(16, 0.1, 0.001, 1, 1, "1f1b", memory, 250.0, always)
    assert (choice.num_microbatches, choice.micro_batch_size) == (8, 2)
    with pytest.raises(ValueError, match="memory budget"):
        choose_num_microbatches(16, 0.1, 0.001, 1, 1, "1f1b", memory, 50.0, always)


@pytest.mark.slow
def test_dynamic_batch_splitting_end_to_end(tmp_path, capfd) -> None:
    run = tmp_path / "run"
    capfd.readouterr()
    code = launch_in_process("train", *sets(
        "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
        "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
        "training.steps=3", "optimization.global_batch_size=8", "optimization.micro_batch_size=8",
        "parallelism.pipeline=2", "controllers.compute.batch_splitting=dynamic"),
        "--nproc", "2", "--run-dir", str(run))
    assert code == 0
    assert "dynamic batch splitting:" in capfd.readouterr().out
    # The choice is a new plan (plan.json); config.yaml keeps the config as resolved at start.
    batch = json.loads((run / "plan.json").read_text())["batch"]
    assert batch["batch_splitting"] == "dynamic"
    assert batch["micro_batch_size"] * batch["num_microbatches"] == 8
    summary = json.loads((run / "summary.json").read_text())
    assert summary["micro_batch_size"] == batch["micro_batch_size"]
    resolved = yaml.safe_load((run / "config.yaml").read_text())["optimization"]
    assert (resolved["micro_batch_size"], resolved["gradient_accumulation"]) == (8, 1)
    assert len(read_metrics(run)) == 3
