"""The Llama family (model.kind llama / llama_moe): its parts in process, and loss parity of every
parallelism against the single-process run (DESIGN.md §5; issue 20, must-show 1 and 5).

The parity runs train a 4-layer Llama with grouped-query attention (4 heads, 2 key/value heads)
on the same global batch of 8 sequences for 20 steps; each layout's per-step loss must match the
single-process run's within 1e-4 over the first 10 steps and 1e-3 through 20.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import run_cli_in_process, train_metrics

from mcpar.checkpoint.reshard import reshard, shard_maps
from mcpar.config import ModelConfig, load_config
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.models.llama import GroupedQueryAttention, apply_rotary, rotary_cos_sin
from mcpar.models.spec import get_model_spec
from mcpar.parallel.pipeline import global_stage
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tensor import apply_tensor_parallel
from mcpar.sim.fromconfig import config_model
from mcpar.sim.workload import MODEL_PRESETS

STEPS = 20
MODEL = [
    "model.kind=llama", "model.num_layers=4", "model.hidden_size=32", "model.num_heads=4",
    "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5", f"training.steps={STEPS}", "optimization.global_batch_size=8",
]
MOE = ["model.kind=llama_moe", "model.num_experts=2", "model.top_k=2", "model.num_layers=2"]

# name -> (workers, settings); the MoE layouts compare with the MoE reference.
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "data2": (2, ["parallelism.data=2", "optimization.micro_batch_size=4"]),
    "tensor2": (2, ["parallelism.tensor=2", "optimization.micro_batch_size=8"]),
    "tensor2_sp": (2, ["parallelism.tensor=2", "parallelism.sequence_parallel=true",
                       "optimization.micro_batch_size=8"]),
    "pipeline2_1f1b": (2, ["parallelism.pipeline=2", "optimization.micro_batch_size=2"]),
    "pipeline2_interleaved": (2, ["parallelism.pipeline=2", "parallelism.virtual_stages=2",
                                  "parallelism.schedule=interleaved_1f1b",
                                  "optimization.micro_batch_size=2"]),
    "data2_tensor2_pipeline2": (8, ["parallelism.data=2", "parallelism.tensor=2",
                                    "parallelism.pipeline=2", "optimization.micro_batch_size=2"]),
    "moe_experts2": (2, [*MOE, "parallelism.data=2", "parallelism.experts=2",
                         "optimization.micro_batch_size=4"]),
    "moe_experts2_tensor2": (4, [*MOE, "parallelism.data=2", "parallelism.experts=2",
                                 "parallelism.tensor=2", "optimization.micro_batch_size=4"]),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    """Single-process runs, one per model form, shared by every layout."""
    out = {}
    for form, extra in (("dense", []), ("moe", MOE)):
        run = tmp_path_factory.mktemp(f"ref_{form}") / "run"
        out[form] = train_metrics(run, 1, [*MODEL, *extra, "optimization.micro_batch_size=8"])
    return out


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_parity(references: dict[str, list[dict]], name: str, tmp_path: Path) -> None:
    nproc, settings = LAYOUTS[name]
    records = train_metrics(tmp_path / name, nproc, [*MODEL, *settings])
    reference = references["moe" if name.startswith("moe") else "dense"]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(reference, records, strict=True)]
    print(f"{name}: max |dloss| {max(diffs):.2e} over {STEPS} steps")
    assert max(diffs[:10]) <= 1e-4, f"{name}: per-step |dloss| {diffs}"
    assert max(diffs) <= 1e-3, f"{name}: per-step |dloss| {diffs}"  # fp32 order drifts slowly
    assert records[-1]["loss"] < records[0]["loss"]  # it trained


# --- in process ------------------------------------------------------------------------------

def test_rotary_scores_depend_only_on_relative_position() -> None:
    head_dim, seq = 16, 12
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, head_dim, generator=gen)
    cos, sin = rotary_cos_sin(seq, head_dim, 10000.0, torch.device("cpu"))
    # The same vector at every position, rotated by its position's angles.
    q_rot = apply_rotary(q.expand(1, 1, seq, head_dim), cos, sin)[0, 0]
    k_rot = apply_rotary(k.expand(1, 1, seq, head_dim), cos, sin)[0, 0]
    scores = q_rot @ k_rot.T  # [query position, key position]
    for offset in range(-3, 4):
        diagonal = torch.diagonal(scores, offset)
        assert torch.allclose(diagonal, diagonal[0].expand_as(diagonal), atol=1e-5)
    assert torch.allclose(q_rot.norm(dim=-1), q.norm().expand(seq), atol=1e-5)  # a rotation
    assert torch.allclose(q_rot[0], q)  # position 0 is not rotated
    # The base sets the frequencies: another base rotates position 1 differently.
    cos2, sin2 = rotary_cos_sin(seq, head_dim, 500000.0, torch.device("cpu"))
    assert not torch.allclose(apply_rotary(q.expand(1, 1, seq, head_dim), cos2, sin2)[0, 0, 1],
                              q_rot[1])


def _attention(heads: int, kv_heads: int) -> GroupedQueryAttention:
    cfg = ModelConfig(kind="llama", hidden_size=32, num_heads=heads, num_kv_heads=kv_heads,
                      seq_len=8)
    return GroupedQueryAttention(cfg)


def _naive_attention(x: torch.Tensor, q_w: torch.Tensor, k_w: torch.Tensor, v_w: torch.Tensor,
                     o_w: torch.Tensor, heads: int) -> torch.Tensor:
    """Multi-head causal attention with rotary embeddings, written out step by step."""
    batch, seq, hidden = x.shape
    d = hidden // heads
    q, k, v = ((x @ w.T).view(batch, seq, heads, d).transpose(1, 2) for w in (q_w, k_w, v_w))
    cos, sin = rotary_cos_sin(seq, d, 10000.0, x.device)
    q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    scores = q @ k.transpose(-1, -2) / d ** 0.5
    scores = scores.masked_fill(torch.ones(seq, seq).triu(1).bool(), float("-inf"))
    y = scores.softmax(-1) @ v
    return y.transpose(1, 2).reshape(batch, seq, hidden) @ o_w.T


def test_grouped_query_attention_is_multi_head_attention_with_shared_key_values() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 8, 32)
    heads, d = 4, 8
    # kv heads = heads: plain multi-head attention (rows per head: q, k, v).
    mha = _attention(heads, heads)
    rows = mha.qkv.weight.detach().view(heads, 3, d, 32)
    q_w, k_w, v_w = (rows[:, i].reshape(heads * d, 32) for i in range(3))
    expected = _naive_attention(x, q_w, k_w, v_w, mha.proj.weight.detach(), heads)
    assert torch.allclose(mha(x), expected, atol=1e-5)
    # kv heads 2: each group's k, v serve its 2 query heads, which is the multi-head attention
    # whose k, v rows are those of the group, repeated.
    gqa = _attention(heads, 2)
    rows = gqa.qkv.weight.detach().view(2, 4, d, 32)  # per group: q, q, k, v
    q_w = rows[:, :2].reshape(heads * d, 32)
    k_w, v_w = (rows[:, i].repeat_interleave(2, dim=0).reshape(heads * d, 32) for i in (2, 3))
    expected = _naive_attention(x, q_w, k_w, v_w, gqa.proj.weight.detach(), heads)
    assert torch.allclose(gqa(x), expected, atol=1e-5)


@pytest.mark.parametrize("extra", [
    {}, {"num_kv_heads": 1, "tie_embeddings": True},
    {"kind": "llama_moe", "num_experts": 4, "top_k": 2},
    {"kind": "llama_moe", "num_experts": 4, "top_k": 1, "shared_expert": True},
])
def test_parameter_count_matches_the_spec(extra: dict) -> None:
    cfg = ModelConfig(**{"kind": "llama", "num_layers": 2, "hidden_size": 32, "num_heads": 4,
                         "num_kv_heads": 2, "seq_len": 16, **extra})
    spec = get_model_spec(cfg.kind)
    model = spec.build(cfg, 0)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params(cfg)
    # No biases anywhere; positions are rotary (no table).
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model(torch.randint(0, 256, (2, 16))).shape == (2, 16, 256)
    # The cost model's mapping of the config: kv heads, SwiGLU, no biases (RMSNorm's neither),
    # no position table; it counts the built model's parameters exactly.
    shape = config_model(load_config(None, [f"model.{k}={v}" for k, v in
                                            {**cfg.model_dump(exclude_none=True)}.items()]))
    assert (shape.kv_heads, shape.ffn_kind, shape.bias, shape.norm_bias,
            shape.learned_positions) == (cfg.kv_heads, "swiglu", False, False, False)
    assert shape.num_params() == sum(p.numel() for p in model.parameters())


def test_ffn_rounding_and_presets_shared_with_the_cost_model() -> None:
    # Llama 2 7B: 8/3 x 4096 rounded up to a multiple of 256 is its published 11008.
    assert ModelConfig(kind="llama", hidden_size=4096, num_heads=32).ffn_size == 11008
    cfg = load_config(None, ["model.preset=llama3-8b", "model.num_layers=2"]).model
    assert (cfg.kind, cfg.num_layers, cfg.hidden_size, cfg.kv_heads, cfg.ffn_size,
            cfg.vocab_size, cfg.rope_base) == ("llama", 2, 4096, 8, 14336, 128256, 500000.0)
    mixtral = load_config(None, ["model.preset=mixtral-8x7b"]).model
    shape = config_model(load_config(None, ["model.preset=mixtral-8x7b"]))
    preset = MODEL_PRESETS["mixtral-8x7b"].shape
    assert (mixtral.kind, mixtral.num_experts, mixtral.top_k) == ("llama_moe", 8, 2)
    for field in ("layers", "hidden", "heads", "kv_heads", "ffn", "ffn_kind", "vocab",
                  "seq_len", "experts", "top_k"):
        assert getattr(shape, field) == getattr(preset, field), field
    # The parameter counts published for the released models (e.g. 8.03B for Llama 3 8B).
    for name, total in (("llama2-7b", 6_738_415_616), ("llama3-8b", 8_030_261_248),
                        ("llama3-70b", 70_553_706_496), ("mixtral-8x7b", 46_702_792_704)):
        published = load_config(None, [f"model.preset={name}"]).model
        assert get_model_spec(published.kind).num_params(published) == total, name


@pytest.mark.parametrize(("setting", "nproc", "needle"), [
    ("model.num_kv_heads=3", 1, "3 key/value heads do not divide num_heads 8"),
    ("parallelism.tensor=4", 4, "2 key/value heads are not divisible by parallelism.tensor 4"),
    ("model.kind=gpt", 1, "grouped-query attention needs kind llama"),
    ("model.preset=llama9-1t", 1, "model.preset"),
])
def test_key_value_head_errors_exit_2(capsys: pytest.CaptureFixture[str], setting: str,
                                      nproc: int, needle: str) -> None:
    proc = run_cli_in_process(capsys, "check", "configs/llama.yaml", "--set", setting,
                              "--nproc", str(nproc))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    assert needle in proc.stderr, proc.stderr
    if "key/value" in needle:
        assert "model.num_kv_heads" in proc.stderr


def test_check_prints_the_llama_plan(capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "check", "configs/llama.yaml", "--set",
                              "parallelism.tensor=2", "--nproc", "2")
    assert proc.returncode == 0, proc.stderr
    assert "llama, 4 layers, hidden 128, 8 heads (2 key/value)" in proc.stdout


def _shards(cfg: ModelConfig, pp: int, pp_rank: int, tp: int, tp_rank: int
            ) -> dict[str, torch.Tensor]:
    """The parameters parallelize gives one (pipeline, tensor) coordinate, named as a
    checkpoint stores them (``<chunk>.<name>``)."""
    spec = get_model_spec("llama")
    stage = cut_model(spec.build(cfg, 3), partition_layers(cfg, pp), global_stage(0, pp_rank, pp),
                      spec.pieces)
    if tp > 1:
        apply_tensor_parallel(stage, spec.tensor_parallel, None,  # type: ignore[arg-type]
                              tp_rank, tp, False)
    return {f"0.{n}": p.detach().clone() for n, p in stage.named_parameters()}


@pytest.mark.parametrize(("old", "new"), [((1, 2), (2, 1)), ((2, 2), (1, 1)), ((2, 1), (1, 2))])
def test_checkpoint_reshards_between_layouts(old: tuple[int, int], new: tuple[int, int]) -> None:
    # The fused q|k|v rows (whole key/value groups) and the stacked gate|up must be reassembled
    # exactly from any (pipeline, tensor) layout and cut again for another.
    cfg = ModelConfig(kind="llama", num_layers=2, hidden_size=32, num_heads=4, num_kv_heads=2,
                      ffn_hidden_size=64, seq_len=16, vocab_size=64)
    saved = {(p, t): _shards(cfg, old[0], p, old[1], t)
             for p in range(old[0]) for t in range(old[1])}
    for p in range(new[0]):
        for t in range(new[1]):
            got = reshard(cfg, "llama", {"pipeline": old[0], "tensor": old[1], "virtual_stages": 1},
                          lambda a, b: saved[(a, b)], shard_maps(cfg, "llama", new[0], 1, p,
                                                                 new[1], t))
            want = _shards(cfg, new[0], p, new[1], t)
            assert got.keys() == want.keys()
            assert all(torch.equal(got[n], want[n]) for n in want)


def test_onebit_adam_trains_the_llama_model(references: dict[str, list[dict]],
                                            tmp_path: Path) -> None:
    """1-bit Adam at data 2 (its own Adam: weight decay in the gradient, no AdamW parity): past
    its warm-up (freeze step 10) the momentum is exchanged in 1 bit (the bytes per step drop)
    and the model trains as far as the uncompressed AdamW run (final loss within 5%)."""
    records = train_metrics(tmp_path / "onebit", 2, [
        *MODEL, "parallelism.data=2", "optimization.micro_batch_size=4",
        "controllers.communication.compression=1bit", "optimization.freeze_step=10"])
    reference = references["dense"]
    assert abs(records[-1]["loss"] - reference[-1]["loss"]) <= 0.05 * reference[-1]["loss"], \
        ([r["loss"] for r in records], [r["loss"] for r in reference])
    assert records[-1]["comm_bytes"] < records[4]["comm_bytes"] / 8  # compressed past warm-up
    assert records[-1]["loss"] < records[0]["loss"] - 0.5
