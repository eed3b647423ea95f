"""Llama's registry entries, ``llama`` and its MoE form ``llama_moe`` (one module, two forms
that differ in their blocks' MLP and in the plans): their counts without building the model,
their shape for the simulator and their rules (whole key/value heads per tensor rank, rotary
embeddings rotate pairs)."""

from __future__ import annotations

import math

from torch import nn

from mcpar.config import ModelConfig
from mcpar.errors import problem
from mcpar.models.llama.hf import LlamaNames
from mcpar.models.llama.model import Llama, build_llama
from mcpar.models.llama.plans import (
    LLAMA_MOE_EXPERTS,
    LLAMA_MOE_TENSOR_PARALLEL,
    LLAMA_TENSOR_PARALLEL,
)
from mcpar.models.moe.family import moe_layout_problems, routed_shape
from mcpar.models.plan import ModelPieces
from mcpar.models.spec import ModelSpec
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import ModelShape


# --- sizes, without building the model -------------------------------------------------------
def _attention_params(cfg: ModelConfig) -> int:
    h, kv_width = cfg.hidden_size, cfg.kv_heads * cfg.head_dim
    return h * (cfg.num_heads * cfg.head_dim + 2 * kv_width) + cfg.num_heads * cfg.head_dim * h


def _mlp_params(cfg: ModelConfig, moe: bool, tp: int = 1, ep: int = 1) -> int:
    """The feed-forward sublayer of one block on one rank: a SwiGLU, or the router, this
    rank's experts and the shared expert."""
    swiglu = 3 * cfg.hidden_size * cfg.ffn_size // tp
    if not moe:
        return swiglu
    experts = (cfg.num_experts // ep) * swiglu
    return cfg.hidden_size * cfg.num_experts + experts + (swiglu if cfg.shared_expert else 0)


def llama_stage_num_params(cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                           tp: int = 1, ep: int = 1, moe: bool = False) -> int:
    """Parameters one rank holds for a stage: matrices and the vocabulary split over tp, the
    experts over ep; norms and the router replicated."""
    h, v = cfg.hidden_size, cfg.vocab_size
    total = num_blocks * (_attention_params(cfg) // tp + _mlp_params(cfg, moe, tp, ep) + 2 * h)
    if first:
        total += v * h // tp
    if last:
        total += h + (0 if cfg.tie_embeddings and first else v * h // tp)
    return total


def llama_num_params(cfg: ModelConfig, moe: bool = False) -> int:
    return llama_stage_num_params(cfg, cfg.num_layers, True, True, moe=moe)


def llama_flops_per_token(cfg: ModelConfig, moe: bool = False) -> float:
    """Training FLOPs per token, 3 x forward: 2 per weight of every matmul a token goes through
    (the top_k experts' and the router's for MoE) plus 2 x 2 x seq x hidden per layer of scores
    and weighted values (over the full square, as the kernels compute it)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    mlp = 3 * h * f
    if moe:
        mlp = h * cfg.num_experts + cfg.top_k * mlp + (mlp if cfg.shared_expert else 0)
    matmul = cfg.num_layers * 2 * (_attention_params(cfg) + mlp) + 2 * h * cfg.vocab_size
    return 3.0 * (matmul + cfg.num_layers * 4 * cfg.seq_len * h)


def llama_shape(cfg: ModelConfig) -> ModelShape:
    """Llama as the simulator counts it: ``num_kv_heads`` key/value heads, a SwiGLU MLP, no
    biases, rotary positions (no table). The simulator counts one bias of hidden per norm,
    which an RMSNorm does not have."""
    return ModelShape(
        layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
        kv_heads=cfg.kv_heads, ffn=cfg.ffn_size, ffn_kind="swiglu", vocab=cfg.vocab_size,
        seq_len=cfg.seq_len, name="config", bias=False, learned_positions=False,
        tied_embeddings=cfg.tie_embeddings, dropout=cfg.dropout > 0)


class LlamaFamily(ModelSpec):
    """Llama (``moe`` False) or its Mixtral-style MoE form."""

    grouped_query_attention = True
    rotary_positions = True

    def __init__(self, moe: bool = False):
        self.moe = moe
        self.name = "llama_moe" if moe else "llama"
        self.summary = ("Llama's MoE form: Mixtral-style SwiGLU experts" if moe else
                        "Llama: RMSNorm, rotary positions, SwiGLU, grouped-query attention, "
                        "no biases")
        self.tensor_parallel = LLAMA_MOE_TENSOR_PARALLEL if moe else LLAMA_TENSOR_PARALLEL
        self.expert_parallel = LLAMA_MOE_EXPERTS if moe else None
        self.hf = LlamaNames(moe)

    def default_ffn_size(self, cfg: ModelConfig) -> int:
        # Llama's rule: a SwiGLU MLP of 2/3 of 4 x hidden (the same weights as a 4x GELU MLP
        # with two matrices), rounded up to a multiple that suits the kernels.
        inner = int(8 * cfg.hidden_size / 3)
        return cfg.ffn_multiple_of * math.ceil(inner / cfg.ffn_multiple_of)

    def problems(self, cfg: ModelConfig) -> list[str]:
        out = super().problems(cfg)
        if cfg.hidden_size % cfg.num_heads == 0 and cfg.head_dim % 2:
            out.append(problem("model.num_heads", f"head size hidden_size / num_heads = "
                               f"{cfg.head_dim} is odd; rotary embeddings rotate pairs"))
        return out

    def layout_problems(self, cfg: ModelConfig, tp: int, ep: int,
                        sequence_parallel: bool) -> list[str]:
        out = []
        if cfg.kv_heads % tp:
            out.append(problem(
                "model.num_kv_heads",
                f"{cfg.kv_heads} key/value heads are not divisible by parallelism.tensor {tp} "
                "(each tensor rank holds whole key/value heads); use more kv heads or a smaller "
                "tensor degree",
            ))
        if self.moe:
            out += moe_layout_problems(cfg, ep, sequence_parallel)
        return out

    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        return build_llama(cfg, seed, self.moe)

    def pieces(self, model: nn.Module) -> ModelPieces:
        assert isinstance(model, Llama), type(model)
        return model.pieces()

    def num_params(self, cfg: ModelConfig) -> int:
        return llama_num_params(cfg, self.moe)

    def stage_num_params(self, cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
        return llama_stage_num_params(cfg, num_blocks, first, last, tp, ep, self.moe)

    def flops_per_token(self, cfg: ModelConfig) -> float:
        return llama_flops_per_token(cfg, self.moe)

    def shape(self, cfg: ModelConfig) -> ModelShape:
        shape = llama_shape(cfg)
        return routed_shape(shape, cfg) if self.moe else shape


LLAMA_FAMILY = MODEL_FAMILIES.register(LlamaFamily())
LLAMA_MOE_FAMILY = MODEL_FAMILIES.register(LlamaFamily(moe=True))
