"""Llama (Llama 2/3) and its MoE form (Mixtral), one package: ``model.py`` (the module, both
forms, readable in one file), ``plans.py`` (where tensor and expert parallelism split them),
``hf.py`` (their Hugging Face names, ``LlamaForCausalLM`` and ``MixtralForCausalLM``) and
``family.py`` (their shapes, which count them, their rules and registry entries,
``model.kind: llama`` and ``llama_moe``)."""

from mcpar.models.llama.family import (
    LLAMA_FAMILY,
    LLAMA_MOE_FAMILY,
    llama_shape,
)
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
from mcpar.models.llama.plans import (
    LLAMA_MOE_EXPERTS,
    LLAMA_MOE_TENSOR_PARALLEL,
    LLAMA_TENSOR_PARALLEL,
)

__all__ = ["LLAMA_FAMILY", "LLAMA_MOE_EXPERTS", "LLAMA_MOE_FAMILY", "LLAMA_MOE_TENSOR_PARALLEL",
           "LLAMA_TENSOR_PARALLEL", "GroupedQueryAttention", "Llama", "LlamaBlock",
           "LlamaMoELayer", "RMSNorm", "SwiGLU", "SwiGLUExperts", "apply_rotary", "build_llama",
           "llama_shape", "rotary_cos_sin", "swiglu_experts"]
