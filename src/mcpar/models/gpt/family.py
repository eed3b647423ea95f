"""GPT's registry entry: its counts without building it, its shape for the simulator, and the
entry itself (registered when this module is imported, by ``mcpar.controllers.registered``)."""

from __future__ import annotations

from torch import nn

from mcpar.config import ModelConfig
from mcpar.models.gpt.hf import GPT2Names
from mcpar.models.gpt.model import GPT
from mcpar.models.gpt.plans import GPT_TENSOR_PARALLEL
from mcpar.models.plan import ModelPieces
from mcpar.models.spec import ModelSpec
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import ModelShape


def gpt_num_params(cfg: ModelConfig) -> int:
    """Exact parameter count, without building the model (used by plans and estimates)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    per_layer = (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (2 * h) + (h * f + f) + (f * h + h)
    head = 2 * h + (0 if cfg.tie_embeddings else cfg.vocab_size * h)
    return cfg.vocab_size * h + cfg.seq_len * h + cfg.num_layers * per_layer + head


def gpt_stage_num_params(cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
    """Parameters one rank holds for a pipeline stage of `num_blocks` blocks (plus the embedding
    on the first stage, the head on the last) under tensor parallelism `tp`: matrices, column
    biases and the vocabulary are split; norms, position embedding and row-parallel output biases
    are replicated. (``ep`` is for the MoE spec's signature; a dense model has no experts.)"""
    h, f, v = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    sharded = (3 * h * h + 3 * h) + h * h + (h * f + f) + f * h
    replicated = 4 * h + 2 * h
    total = num_blocks * (sharded // tp + replicated)
    if first:
        total += v * h // tp + cfg.seq_len * h
    if last:
        total += 2 * h + (0 if cfg.tie_embeddings and first else v * h // tp)
    return total


def gpt_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 3 x forward (backward costs twice the forward).

    Forward per token: 2 FLOPs per weight of every matmul (QKV, attention output, two MLP
    matmuls, output head) plus attention scores and weighted values, 2 x 2 x seq x hidden per layer
    (counted over the full square, as the kernels compute it).
    """
    h, f, s = cfg.hidden_size, cfg.ffn_size, cfg.seq_len
    matmul = cfg.num_layers * 2 * (4 * h * h + 2 * h * f) + 2 * h * cfg.vocab_size
    attention = cfg.num_layers * 4 * s * h
    return 3.0 * (matmul + attention)


def gpt_shape(cfg: ModelConfig, ffn_kind: str = "gelu") -> ModelShape:
    """GPT as the simulator counts it: full multi-head attention, biases on its linears, a
    learned position table, an optionally tied head, dropout masks only when it drops."""
    return ModelShape(
        layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
        kv_heads=cfg.kv_heads, ffn=cfg.ffn_size, ffn_kind=ffn_kind, vocab=cfg.vocab_size,
        seq_len=cfg.seq_len, name="config", bias=True, learned_positions=True,
        tied_embeddings=cfg.tie_embeddings, dropout=cfg.dropout > 0)


class GPTFamily(ModelSpec):
    name = "gpt"
    summary = "dense GPT: learned positions, GELU MLP, LayerNorm, biases"
    tensor_parallel = GPT_TENSOR_PARALLEL
    hf = GPT2Names()

    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        model = GPT(cfg)
        model.init_weights(seed)
        return model

    def pieces(self, model: nn.Module) -> ModelPieces:
        assert isinstance(model, GPT), type(model)
        return model.pieces()

    def num_params(self, cfg: ModelConfig) -> int:
        return gpt_num_params(cfg)

    def stage_num_params(self, cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
        return gpt_stage_num_params(cfg, num_blocks, first, last, tp, ep)

    def flops_per_token(self, cfg: ModelConfig) -> float:
        return gpt_flops_per_token(cfg)

    def shape(self, cfg: ModelConfig) -> ModelShape:
        return gpt_shape(cfg)


GPT_FAMILY = MODEL_FAMILIES.register(GPTFamily())
