"""Activation recompute (``controllers/memory/recompute.py``): the same losses and gradients as
keeping every activation, with dropout on, and fewer bytes saved for the backward pass."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, read_metrics, run_cli_in_process, run_mcpar, sets

from mcpar.config import JobConfig
from mcpar.controllers.memory.recompute import apply_recompute
from mcpar.models.spec import get_model_spec
from mcpar.parallel.stage import cut_model

MODES = ("none", "selective", "full")


def _step(kind: str, mode: str) -> tuple[float, list[torch.Tensor], int]:
    """One forward and backward of a 2-block model with dropout 0.1: the loss, the gradients
    and the bytes of activations saved for the backward pass (parameters excluded)."""
    cfg = JobConfig.model_validate({"model": {"kind": kind, "num_layers": 2, "hidden_size": 64,
                                              "num_heads": 4, "seq_len": 128, "dropout": 0.1}})
    spec = get_model_spec(kind)
    chunk = cut_model(spec.build(cfg.model, 0), [(0, 2)], 0, spec.pieces)
    assert apply_recompute(chunk.pieces()[1], mode) == {"none": 0, "selective": 2,
                                                        "full": 2}[mode]
    params = {p.untyped_storage().data_ptr() for p in chunk.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    tokens = torch.randint(0, 256, (4, 128), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)  # the dropout masks
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = chunk(tokens[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grads = [p.grad.clone() for p in chunk.parameters()]
    return loss.item(), grads, sum(v for k, v in saved.items() if k not in params)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_recompute_gives_equal_gradients_and_saves_activations(kind: str) -> None:
    """Dropout replays its masks: loss and every gradient are equal (==) in all three modes.
    Selective drops the attention core's saved probabilities (over 40% of the bytes at this
    shape with dropout); full keeps only each block's input (under 20%)."""
    results = {mode: _step(kind, mode) for mode in MODES}
    loss, grads, _ = results["none"]
    for mode in ("selective", "full"):
        assert results[mode][0] == loss, mode
        assert all(torch.equal(a, b) for a, b in zip(grads, results[mode][1], strict=True)), mode
    saved = {mode: results[mode][2] for mode in MODES}
    assert saved["selective"] < 0.6 * saved["none"], saved
    assert saved["full"] < 0.2 * saved["none"], saved


def test_training_losses_are_equal_with_recompute(tmp_path: Path) -> None:
    """A whole run with dropout: per-step losses and gradient norms of full recompute equal
    those of none, bit for bit."""
    settings = [*TINY, "training.steps=4", "model.dropout=0.1", "training.log_interval=1"]
    runs = {}
    for mode in ("none", "full"):
        proc = run_mcpar("train", *sets(*settings,
                                        f"controllers.memory.activation_checkpointing={mode}"),
                         "--nproc", "1", "--run-dir", str(tmp_path / mode))
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[mode] = [(r["loss"], r["grad_norm"]) for r in read_metrics(tmp_path / mode)]
    assert runs["full"] == runs["none"] and len(runs["none"]) == 4


def test_full_recompute_of_moe_layers_is_refused(capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, "model.kind=moe",
                                                     "model.num_experts=2",
                                                     "controllers.memory.activation_checkpointing"
                                                     "=full"),
                              "--nproc", "1", "--run-dir", str(tmp_path / "never"))
    assert proc.returncode == 2
    assert "controllers.memory.activation_checkpointing: 'full' would replay" in proc.stderr
