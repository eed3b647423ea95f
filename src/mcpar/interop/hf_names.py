"""mcpar <-> Hugging Face: key names, weight transforms and config.json, through each model
family's name map (its registry entry's ``hf``, ``mcpar.models.hf.HFNames``: the built-ins'
are ``models/gpt/hf.py`` for ``GPT2LMHeadModel`` and ``models/llama/hf.py`` for
``LlamaForCausalLM`` and ``MixtralForCausalLM``). A family without one (``moe``) is refused.

What is common to every family lives here: the config.json fields every architecture has, the
output head (``lm_head.weight``, absent when tied) and the lookup of a family by architecture.
"""

from __future__ import annotations

from typing import Any

from mcpar.config import ModelConfig
from mcpar.errors import problem
from mcpar.models.hf import HFNames, Tensors
from mcpar.models.spec import get_model_spec
from mcpar.registry.model_family import MODEL_FAMILIES


def architectures() -> dict[str, HFNames]:
    """Every registered family's Hugging Face name map, by architecture."""
    out = {}
    for family in MODEL_FAMILIES:
        names = getattr(family, "hf", None)
        if names is not None:
            out[names.architecture] = names
    return out


def _names(cfg: ModelConfig) -> HFNames | None:
    return get_model_spec(cfg.kind).hf


def export_problems(cfg: ModelConfig, expert_bias: Tensors) -> list[str]:
    """Why this model cannot be written as its Hugging Face counterpart (empty: it can).
    ``expert_bias``: the routers' selection-bias buffers, by mcpar name."""
    names = _names(cfg)
    if names is None:
        kinds = sorted(f.name for f in MODEL_FAMILIES if getattr(f, "hf", None) is not None)
        return [problem("model.kind", f"'{cfg.kind}' has no Hugging Face counterpart; "
                        f"export supports {kinds}")]
    return names.export_problems(cfg, expert_bias)


# --- config.json ------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of ``cfg``'s Hugging Face counterpart (fp32 weights)."""
    names = _names(cfg)
    assert names is not None, export_problems(cfg, {})
    common = {"architectures": [names.architecture], "vocab_size": cfg.vocab_size,
              "torch_dtype": "float32", "tie_word_embeddings": cfg.tie_embeddings,
              "use_cache": True}
    return {**common, **names.config_json(cfg)}


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The mcpar ``model`` keys of a Hugging Face config.json (one of ``architectures()``)."""
    return architectures()[hf["architectures"][0]].model_keys(hf)


def hf_notes(hf: dict[str, Any]) -> list[str]:
    """What mcpar computes a little differently from a config.json it still accepts."""
    names = architectures().get((hf.get("architectures") or [""])[0])
    return names.notes(hf) if names is not None else []


def hf_problems(hf: dict[str, Any]) -> list[str]:
    """What of a supported config.json mcpar's model does not compute (keys it would ignore)."""
    out = []
    if hf.get("hidden_act", "silu") != "silu":
        out.append(f"hidden_act {hf['hidden_act']!r} (mcpar's SwiGLU uses silu)")
    if hf.get("activation_function", "gelu") not in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        out.append(f"activation_function {hf['activation_function']!r}")
    rope_type = (hf.get("rope_parameters") or hf.get("rope_scaling") or {}).get(
        "rope_type", "default")
    if rope_type != "default":
        out.append(f"rope_type {rope_type!r} (mcpar has plain rotary embeddings)")
    for key in ("attention_bias", "mlp_bias"):
        if hf.get(key):
            out.append(f"{key} true (mcpar's Llama has no biases)")
    head_dim = hf.get("head_dim")
    if head_dim and "hidden_size" in hf and head_dim * hf["num_attention_heads"] != \
            hf["hidden_size"]:
        out.append(f"head_dim {head_dim} != hidden_size / num_attention_heads")
    return out


# --- weights ----------------------------------------------------------------------------------
def to_hf(cfg: ModelConfig, params: Tensors) -> Tensors:
    """Hugging Face tensors from mcpar's full parameters (names as ``named_parameters`` of the
    built model lists them: a tied head appears once, as the embedding)."""
    names = _names(cfg)
    assert names is not None, export_problems(cfg, {})
    out = names.to_hf(cfg, params)
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["head.out.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: ModelConfig, hf: Tensors) -> Tensors:
    """mcpar's full parameters (``named_parameters`` names) from Hugging Face tensors; raises
    KeyError naming the first Hugging Face key that is missing."""
    names = _names(cfg)
    assert names is not None, export_problems(cfg, {})
    hf = names.tensor_names(hf)
    out = names.from_hf(cfg, hf)
    if not cfg.tie_embeddings:
        out["head.out.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}
