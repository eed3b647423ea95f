"""GPT: a pre-norm decoder-only transformer (GPT-2's), one package: ``model.py`` (the module,
readable in one file), ``plans.py`` (where tensor parallelism splits it), ``hf.py`` (its
Hugging Face names, ``GPT2LMHeadModel``) and ``family.py`` (its shape, which counts it, and its
registry entry, ``model.kind: gpt``)."""

import importlib
from typing import TYPE_CHECKING, Any

from mcpar.models.gpt.family import GPT_FAMILY, gpt_shape
from mcpar.models.gpt.plans import ATTENTION_TENSOR_PARALLEL, GPT_TENSOR_PARALLEL

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
_LAZY = {
    "GPT": "mcpar.models.gpt.model",
    "MLP": "mcpar.models.gpt.model",
    "AttentionCore": "mcpar.models.gpt.model",
    "Block": "mcpar.models.gpt.model",
    "CausalSelfAttention": "mcpar.models.gpt.model",
    "OutputHead": "mcpar.models.gpt.model",
    "TokenEmbedding": "mcpar.models.gpt.model",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
