"""Llama (Llama 2/3) and its MoE form (Mixtral), one package: ``model.py`` (the module, both
forms, readable in one file), ``plans.py`` (where tensor and expert parallelism split them),
``hf.py`` (their Hugging Face names, ``LlamaForCausalLM`` and ``MixtralForCausalLM``) and
``family.py`` (their shapes, which count them, their rules and registry entries,
``model.kind: llama`` and ``llama_moe``)."""

from typing import TYPE_CHECKING

from mcpar.models.llama.family import LLAMA_FAMILY, LLAMA_MOE_FAMILY, llama_shape
from mcpar.models.llama.plans import (
    LLAMA_MOE_EXPERTS,
    LLAMA_MOE_TENSOR_PARALLEL,
    LLAMA_TENSOR_PARALLEL,
)
from mcpar.models.plan import lazy_attributes

if TYPE_CHECKING:
    from mcpar.models.llama.model import (
        GroupedQueryAttention,
        Llama,
        LlamaBlock,
        LlamaMoELayer,
        RMSNorm,
        SwiGLU,
        SwiGLUExperts,
        apply_rotary,
        build_llama,
        rotary_cos_sin,
        swiglu_experts,
    )

__all__ = ["LLAMA_FAMILY", "LLAMA_MOE_EXPERTS", "LLAMA_MOE_FAMILY", "LLAMA_MOE_TENSOR_PARALLEL",
           "LLAMA_TENSOR_PARALLEL", "GroupedQueryAttention", "Llama", "LlamaBlock",
           "LlamaMoELayer", "RMSNorm", "SwiGLU", "SwiGLUExperts", "apply_rotary", "build_llama",
           "llama_shape", "rotary_cos_sin", "swiglu_experts"]


# The modules' classes and functions import torch: they load on first use, so that the family's
# registry entry (family.py, which ``mcpar check`` reads) loads without torch.
__getattr__ = lazy_attributes(__name__, "mcpar.models.llama.model", (
    "GroupedQueryAttention", "Llama", "LlamaBlock", "LlamaMoELayer", "RMSNorm", "SwiGLU",
    "SwiGLUExperts", "apply_rotary", "build_llama", "rotary_cos_sin", "swiglu_experts",
))
