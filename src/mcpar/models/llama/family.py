"""Llama's registry entries, ``llama`` and its MoE form ``llama_moe`` (one module, two forms
that differ in their blocks' MLP and in the plans): their shape (which the simulator prices
and from which the entries' parameter and FLOP counts are read) and their rules (whole
key/value heads per tensor rank, rotary embeddings rotate pairs)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from mcpar.config import ModelConfig
from mcpar.errors import problem
from mcpar.models.llama.hf import LlamaNames
from mcpar.models.llama.plans import (
    LLAMA_CONTEXT_PARALLEL,
    LLAMA_MOE_CONTEXT_PARALLEL,
    LLAMA_MOE_EXPERTS,
    LLAMA_MOE_TENSOR_PARALLEL,
    LLAMA_TENSOR_PARALLEL,
)
from mcpar.models.moe.family import moe_layout_problems, routed_shape
from mcpar.models.plan import ModelPieces
from mcpar.models.spec import ModelSpec
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import ModelShape

if TYPE_CHECKING:  # the entries are read without torch (`mcpar check`); build and pieces import it
    from torch import nn


def llama_shape(cfg: ModelConfig) -> ModelShape:
    """Llama as it is built: ``num_kv_heads`` key/value heads, a SwiGLU MLP, no biases,
    RMSNorms (a weight, no bias), rotary positions (no table)."""
    return ModelShape(
        layers=cfg.num_layers, hidden=cfg.hidden_size, heads=cfg.num_heads,
        kv_heads=cfg.kv_heads, ffn=cfg.ffn_size, ffn_kind="swiglu", vocab=cfg.vocab_size,
        seq_len=cfg.seq_len, name="config", bias=False, learned_positions=False,
        tied_embeddings=cfg.tie_embeddings, dropout=cfg.dropout > 0, norm_bias=False)


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
        self.context_parallel = LLAMA_MOE_CONTEXT_PARALLEL if moe else LLAMA_CONTEXT_PARALLEL
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
        from mcpar.models.llama.model import build_llama

        return build_llama(cfg, seed, self.moe)

    def pieces(self, model: nn.Module) -> ModelPieces:
        from mcpar.models.llama.model import Llama

        assert isinstance(model, Llama), type(model)
        return model.pieces()

    def shape(self, cfg: ModelConfig) -> ModelShape:
        shape = llama_shape(cfg)
        return routed_shape(shape, cfg) if self.moe else shape


LLAMA_FAMILY = MODEL_FAMILIES.register(LlamaFamily())
LLAMA_MOE_FAMILY = MODEL_FAMILIES.register(LlamaFamily(moe=True))
