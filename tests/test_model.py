"""GPT model spec: exact parameter count, seeded init, FLOPs, gradient buckets as views, and what
the spec tells parallelizing (pieces, per-layer modules, tensor-parallel and expert plans)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from mcpar.config import ModelConfig
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.models.spec import get_model_spec
from mcpar.parallel.expert import apply_expert_parallel
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tensor import apply_tensor_parallel, resolve

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
    # Tiny buckets, so the model spans several of them.
    sync = DataParallelGradSync(list(model.parameters()), bucket_size_mb=0.01)
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


def test_spec_pieces_and_plans_describe_the_built_model() -> None:
    moe_cfg = CFG.model_copy(update={"kind": "moe", "num_experts": 2, "top_k": 1,
                                     "shared_expert": True})
    for kind, cfg in (("gpt", CFG), ("moe", moe_cfg)):
        spec = get_model_spec(kind)
        model = spec.build(cfg, 0)
        embedding, blocks, head, names = spec.pieces(model)
        assert [getattr(model, n) for n in (names[0], names[2])] == [embedding, head]
        assert spec.blocks(model) == blocks == list(getattr(model, names[1]))
        assert len(blocks) == cfg.num_layers
        # A stage keeps the model's names: its parameters are named as in the model.
        stage = cut_model(model, [(0, cfg.num_layers)], 0, spec.pieces)
        assert [n for n, _ in stage.named_parameters()] == [
            n for n, _ in model.named_parameters()]
        # Every path of the plans leads to a module of the model.
        plan = spec.tensor_parallel
        assert isinstance(resolve(embedding, plan.embedding.vocab), torch.nn.Embedding)
        assert isinstance(resolve(head, plan.output.projection), torch.nn.Linear)
        for block in blocks:
            for path in (*(c.path for c in plan.block.column), *plan.block.row):
                assert isinstance(resolve(block, path), torch.nn.Linear), path
            assert all(isinstance(resolve(block, p), int) for p in plan.block.heads)
        experts = spec.expert_parallel
        if kind == "gpt":
            assert experts is None
            continue
        for block in blocks:
            (layer,) = experts.layers(block)
            routed = resolve(layer, experts.routed)
            assert [resolve(routed, w.path).shape[0] for w in experts.weights] == [2, 2]
            for path in (*(c.path for c in experts.dense.column), *experts.dense.row):
                assert isinstance(resolve(layer, path), torch.nn.Linear), path


def _family_configs() -> list[ModelConfig]:
    """Every built-in family, with and without its options that change the count."""
    moe = {"num_experts": 4, "top_k": 2}
    llama = {"num_heads": 4, "num_kv_heads": 2}
    return [CFG.model_copy(update={"num_layers": 3, **extra}) for extra in (
        {"kind": "gpt"}, {"kind": "gpt", "tie_embeddings": True},
        {"kind": "moe", **moe}, {"kind": "moe", **moe, "shared_expert": True},
        {"kind": "llama", **llama}, {"kind": "llama", **llama, "tie_embeddings": True},
        {"kind": "llama_moe", **llama, **moe},
        {"kind": "llama_moe", **llama, **moe, "top_k": 1, "shared_expert": True})]


def _forward_matmul_weights(model: torch.nn.Module, cfg: ModelConfig) -> float:
    """Matrix weights one token goes through in the forward, read off the built module: every
    2-D weight of the blocks (attention, dense MLP or shared expert, router), top_k of the
    experts' stacked 3-D weights, and the head (the embedding's matrix when tied)."""
    total = float(cfg.vocab_size * cfg.hidden_size)  # the head
    for block in get_model_spec(cfg.kind).blocks(model):
        for p in block.parameters():
            if p.dim() == 2:
                total += p.numel()
            elif p.dim() == 3:  # (experts, ...) stacked expert weights
                total += p.numel() // p.shape[0] * cfg.top_k
    return total


def test_each_family_is_counted_by_its_shape_exactly() -> None:
    """A family's counts are its entry's ``shape``'s (the simulator prices the same shape), and
    the shape is exact for every built-in family: the parameters of the built module, and the
    FLOPs of the matrices a token goes through (the shared expert's too) plus attention's
    scores and values."""
    from mcpar.registry.model_family import MODEL_FAMILIES

    assert {"gpt", "moe", "llama", "llama_moe"} <= set(MODEL_FAMILIES.names())
    for cfg in _family_configs():
        family = get_model_spec(cfg.kind)
        assert family is MODEL_FAMILIES.get(cfg.kind) and family.moe == cfg.kind.endswith("moe")
        model = family.build(cfg, 0)
        built = sum(p.numel() for p in model.parameters())
        shape = family.shape(cfg)
        assert (shape.experts > 0) == family.moe
        assert family.num_params(cfg) == shape.num_params() == built, cfg
        flops = 3.0 * (2 * _forward_matmul_weights(model, cfg)
                       + cfg.num_layers * 4 * cfg.seq_len * cfg.hidden_size)
        assert family.flops_per_token(cfg) == shape.flops_per_token() == flops, cfg


@pytest.mark.parametrize(("cut", "tp", "ep"), [
    ([(0, 3)], 1, 1), ([(0, 3)], 2, 1), ([(0, 3)], 2, 2), ([(0, 1), (1, 3)], 1, 2),
    ([(0, 2), (2, 3)], 2, 1), ([(0, 1), (1, 2), (2, 3)], 2, 2)])
def test_stage_counts_are_what_each_parallelized_stage_holds(
        cut: list[tuple[int, int]], tp: int, ep: int) -> None:
    """``stage_num_params`` (the shape's per-stage count) is what one rank of each pipeline
    stage holds after tensor and expert parallelism split it (the shards are built without a
    process group), for every family."""
    for cfg in _family_configs():
        spec = get_model_spec(cfg.kind)
        for stage_index, (start, end) in enumerate(cut):
            stage = cut_model(spec.build(cfg, 0), cut, stage_index, spec.pieces)
            if tp > 1:
                apply_tensor_parallel(stage, spec.tensor_parallel, None,  # type: ignore[arg-type]
                                      0, tp, sequence_parallel=False)
            if spec.expert_parallel is not None:
                apply_expert_parallel(stage, spec.expert_parallel,
                                      None, 0, ep, 0, tp)  # type: ignore[arg-type]
            held = sum(p.numel() for p in stage.parameters())
            want = spec.stage_num_params(cfg, end - start, stage_index == 0,
                                         stage_index == len(cut) - 1, tp,
                                         ep if spec.expert_parallel else 1)
            assert held == want, (cfg.kind, cfg, stage_index, tp, ep)
