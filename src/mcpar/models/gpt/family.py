"""GPT's registry entry: its shape (which the simulator prices and from which the entry's
parameter and FLOP counts are read), and the entry itself (registered when this module is
imported, by ``mcpar.controllers.registered``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mcpar.config import ModelConfig
from mcpar.models.gpt.hf import GPT2Names
from mcpar.models.gpt.plans import GPT_CONTEXT_PARALLEL, GPT_TENSOR_PARALLEL
from mcpar.models.plan import ModelPieces
from mcpar.models.spec import ModelSpec
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import ModelShape

if TYPE_CHECKING:  # the entry is read without torch (`mcpar check`); build and pieces import it
    from torch import nn


def gpt_shape(cfg: ModelConfig, ffn_kind: str = "gelu") -> ModelShape:
    """GPT as it is built: full multi-head attention, biases on its linears, LayerNorms, a
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
    context_parallel = GPT_CONTEXT_PARALLEL
    hf = GPT2Names()

    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        from mcpar.models.gpt.model import GPT

        model = GPT(cfg)
        model.init_weights(seed)
        return model

    def pieces(self, model: nn.Module) -> ModelPieces:
        from mcpar.models.gpt.model import GPT

        assert isinstance(model, GPT), type(model)
        return model.pieces()

    def shape(self, cfg: ModelConfig) -> ModelShape:
        return gpt_shape(cfg)


GPT_FAMILY = MODEL_FAMILIES.register(GPTFamily())
