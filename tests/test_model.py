"""GPT model spec: exact parameter count, seeded init, FLOPs, and gradient buckets as views."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mcpar.config import ModelConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.models.spec import get_model_spec
from mcpar.topology import ParallelDims

CFG = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16, vocab_size=256)


def test_num_params_matches_the_built_model() -> None:
    spec = get_model_spec("gpt")
    for cfg in (CFG, ModelConfig(num_layers=3, hidden_size=48, num_heads=4, ffn_hidden_size=80,
                                 seq_len=8, vocab_size=300, tie_embeddings=True)):
        model = spec.build(cfg, 0)
        assert spec.num_params(cfg) == sum(p.numel() for p in model.parameters())


def test_init_is_deterministic_from_the_seed() -> None:
    spec = get_model_spec("gpt")
    a, b, c = spec.build(CFG, 7), spec.build(CFG, 7), spec.build(CFG, 8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(),
                                  strict=True):
        assert torch.equal(pa, pb), name
        if name.endswith("weight") and ".ln_" not in name:
            assert not torch.equal(pa, pc), name


def test_model_is_causal() -> None:
    model = get_model_spec("gpt").build(CFG, 0)
    tokens = torch.randint(0, 256, (1, 16))
    changed = tokens.clone()
    changed[0, 10] = (tokens[0, 10] + 1) % 256
    out_a, out_b = model(tokens), model(changed)
    assert torch.allclose(out_a[0, :10], out_b[0, :10])
    assert not torch.allclose(out_a[0, 10:], out_b[0, 10:])


def test_flops_per_token_matches_six_n_for_matmuls() -> None:
    cfg = ModelConfig(num_layers=4, hidden_size=64, num_heads=4, seq_len=2, vocab_size=256)
    spec = get_model_spec("gpt")
    flops = spec.flops_per_token(cfg)
    # Matmul weights: 12 h^2 per layer + tied head; attention adds 12 * L * s * h.
    matmul_weights = 4 * 12 * 64 * 64 + 256 * 64
    assert flops == 6 * matmul_weights + 12 * 4 * 2 * 64


def test_gradients_accumulate_into_bucket_views() -> None:
    model = get_model_spec("gpt").build(CFG, 0)
    comm = CommunicationController(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    # Tiny buckets, so the model spans several of them.
    sync = DataParallelGradSync(list(model.parameters()), comm, bucket_size_mb=0.01)
    assert len(sync.buckets) > 2
    reference = get_model_spec("gpt").build(CFG, 0)
    tokens = torch.randint(0, 256, (2, 16))
    for net in (model, reference):
        for _ in range(2):  # two accumulated backward passes
            logits = net(tokens)
            F.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    sync.finish()
    for bucket in sync.buckets:
        start, end = bucket.buffer.data_ptr(), bucket.buffer.data_ptr() + bucket.buffer.nbytes
        for p in bucket.params:
            assert start <= p.grad.data_ptr() < end  # still a view: no copy was made
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
    sync.zero_grad()
    assert all(float(b.buffer.abs().sum()) == 0.0 for b in sync.buckets)
