"""GPT: a pre-norm decoder-only transformer (GPT-2's), one package: ``model.py`` (the module,
readable in one file), ``plans.py`` (where tensor parallelism splits it), ``hf.py`` (its
Hugging Face names, ``GPT2LMHeadModel``) and ``family.py`` (its shape, which counts it, and its
registry entry, ``model.kind: gpt``)."""

from mcpar.models.gpt.family import GPT_FAMILY, gpt_shape
from mcpar.models.gpt.model import (
    GPT,
    MLP,
    AttentionCore,
    Block,
    CausalSelfAttention,
    OutputHead,
    TokenEmbedding,
)
from mcpar.models.gpt.plans import ATTENTION_TENSOR_PARALLEL, GPT_TENSOR_PARALLEL

__all__ = ["ATTENTION_TENSOR_PARALLEL", "GPT", "GPT_FAMILY", "GPT_TENSOR_PARALLEL", "MLP",
           "AttentionCore", "Block", "CausalSelfAttention", "OutputHead", "TokenEmbedding",
           "gpt_shape"]
