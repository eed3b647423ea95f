"""GPT: a pre-norm decoder-only transformer (GPT-2's), one package: ``model.py`` (the module,
readable in one file), ``plans.py`` (where tensor parallelism splits it), ``hf.py`` (its
Hugging Face names, ``GPT2LMHeadModel``) and ``family.py`` (its shape, which counts it, and its
registry entry, ``model.kind: gpt``)."""

from typing import TYPE_CHECKING

from mcpar.models.gpt.family import GPT_FAMILY, gpt_shape
from mcpar.models.gpt.plans import ATTENTION_TENSOR_PARALLEL, GPT_TENSOR_PARALLEL
from mcpar.models.plan import lazy_attributes

if TYPE_CHECKING:
    from mcpar.models.gpt.model import (
        GPT,
        MLP,
        AttentionCore,
        Block,
        CausalSelfAttention,
        OutputHead,
        TokenEmbedding,
    )

__all__ = ["ATTENTION_TENSOR_PARALLEL", "GPT", "GPT_FAMILY", "GPT_TENSOR_PARALLEL", "MLP",
           "AttentionCore", "Block", "CausalSelfAttention", "OutputHead", "TokenEmbedding",
           "gpt_shape"]


# The modules' classes and functions import torch: they load on first use, so that the family's
# registry entry (family.py, which ``mcpar check`` reads) loads without torch.
__getattr__ = lazy_attributes(__name__, "mcpar.models.gpt.model", (
    "GPT", "MLP", "AttentionCore", "Block", "CausalSelfAttention", "OutputHead", "TokenEmbedding",
))
