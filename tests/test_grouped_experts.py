"""The MoE experts as one grouped matmul equal the Python loop they replace (forward and
gradients, fp32), an expert without rows included; the grouped path takes its group sizes as a
device tensor (no host read); where the grouped kernel is not used (CPU), the loop runs and the
log line says so. On CUDA the same comparison runs inside bench/gpu_check.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from mcpar.config import ModelConfig
from mcpar.device import grouped_mm_unavailable
from mcpar.models.moe import MoELayer, describe_expert_kernel, expert_kernel, set_expert_kernel
from mcpar.models.moe import model as moe


@pytest.fixture
def kernel() -> Iterator[None]:
    yield
    set_expert_kernel("auto")


def _layer() -> MoELayer:
    cfg = ModelConfig(kind="moe", hidden_size=32, num_heads=2, num_experts=4, top_k=2)
    torch.manual_seed(0)
    layer = MoELayer(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    # Steer every token away from expert 2: the grouped kernel then has an empty group.
    layer.router.expert_bias[2] = -10.0
    return layer


def _run(layer: MoELayer, x: torch.Tensor, mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    set_expert_kernel(mode)
    layer.zero_grad()
    x = x.clone().requires_grad_(True)
    out = layer(x)
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    assert x.grad is not None
    return out.detach(), [x.grad] + [p.grad.clone() for p in layer.parameters()]


@pytest.mark.skipif("has no grouped matmul" in str(grouped_mm_unavailable("cpu", torch.float32)),
                    reason="this torch has no grouped matmul")
def test_grouped_matmul_equals_the_loop_forward_and_gradients(kernel: None) -> None:
    layer = _layer()
    x = torch.randn(2, 8, 32)
    counts = torch.bincount(layer.router(x.view(-1, 32))[1].reshape(-1), minlength=4)
    assert counts[2] == 0 and counts.sum() == 32  # one expert gets no rows
    out_loop, grads_loop = _run(layer, x, "loop")
    out_grouped, grads_grouped = _run(layer, x, "grouped")
    assert (out_grouped - out_loop).abs().max() <= 1e-5
    assert len(grads_grouped) == len(grads_loop) == 1 + len(list(layer.parameters()))
    for g, ref in zip(grads_grouped, grads_loop, strict=True):
        assert (g - ref).abs().max() <= 1e-5 * max(1.0, ref.abs().max().item())
    # The experts' weights did get gradients from the grouped kernel.
    assert layer.experts.fc.weight.grad.abs().sum() > 0


def test_grouped_path_never_reads_the_group_sizes_on_the_host(
        kernel: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host read (``tolist``) would wait for the device in every MoE layer."""
    set_expert_kernel("grouped")
    seen: list[object] = []
    monkeypatch.setattr(moe, "grouped_expert_mlps",
                        lambda rows, counts, fc, proj: seen.append(counts) or rows[:, :32] * 0)
    experts = _layer().experts
    experts(torch.randn(6, 32), torch.arange(6), torch.tensor([0, 1, 1, 3, 0, 1]))
    assert len(seen) == 1 and isinstance(seen[0], torch.Tensor)
    assert seen[0].tolist() == [2, 3, 0, 1]


def test_cpu_runs_the_loop_and_says_so(kernel: None) -> None:
    assert expert_kernel("cpu", torch.float32) == "loop"
    assert "Python loop" in describe_expert_kernel("cpu", torch.float32)
    assert "fallback" in describe_expert_kernel("cpu", torch.bfloat16)
    # Misaligned widths (not a multiple of 16 bytes) never take the grouped kernel.
    assert expert_kernel("cuda", torch.bfloat16, (32, 36)) == "loop"
