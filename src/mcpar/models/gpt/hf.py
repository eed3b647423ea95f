"""GPT <-> Hugging Face ``GPT2LMHeadModel``.

GPT-2's Conv1D stores weights [in, out] (transposed here); mcpar's MLP uses the exact (erf)
GELU, so ``activation_function`` is ``gelu``, not GPT-2's ``gelu_new``; LayerNorm epsilon is
torch's default 1e-5. Checked against ``transformers``' own modeling code by the logits test
(tests/test_hf_interop.py).
"""

from __future__ import annotations

from typing import Any

from mcpar.config import ModelConfig
from mcpar.models.hf import HFNames, Tensors

GPT2_LN_EPS = 1e-5  # torch.nn.LayerNorm's default, what model.py builds

# GPT-2's name of each of mcpar's block parameters, and whether it is stored transposed
# (GPT-2's Conv1D keeps [in, out]; nn.Linear, [out, in]).
GPT_BLOCK_NAMES = [(f"{ours}.{kind}", f"{theirs}.{kind}", False)
                   for ours, theirs in (("ln_attn", "ln_1"), ("ln_mlp", "ln_2"))
                   for kind in ("weight", "bias")] + [
    (f"{ours}.{kind}", f"{theirs}.{kind}", kind == "weight")
    for ours, theirs in (("attn.qkv", "attn.c_attn"), ("attn.proj", "attn.c_proj"),
                         ("mlp.fc", "mlp.c_fc"), ("mlp.proj", "mlp.c_proj"))
    for kind in ("weight", "bias")]


def _gpt_names(cfg: ModelConfig) -> list[tuple[str, str, bool]]:
    """(mcpar's name, GPT-2's, transposed) of every GPT parameter but a separate head."""
    pre = "transformer."
    names = [("embed.tok.weight", pre + "wte.weight", False),
             ("embed.pos.weight", pre + "wpe.weight", False)]
    for i in range(cfg.num_layers):
        names += [(f"blocks.{i}.{ours}", f"{pre}h.{i}.{theirs}", transposed)
                  for ours, theirs, transposed in GPT_BLOCK_NAMES]
    return names + [(f"head.ln_final.{kind}", f"{pre}ln_f.{kind}", False)
                    for kind in ("weight", "bias")]


class GPT2Names(HFNames):
    architecture = "GPT2LMHeadModel"
    embedding = "transformer.wte.weight"

    def config_json(self, cfg: ModelConfig) -> dict[str, Any]:
        return {"model_type": "gpt2", "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_size,
                "n_positions": cfg.seq_len, "activation_function": "gelu",
                "layer_norm_epsilon": GPT2_LN_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}

    def model_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
        hidden = hf["n_embd"]
        return {"kind": "gpt", "num_layers": hf["n_layer"], "hidden_size": hidden,
                "num_heads": hf["n_head"], "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
                "seq_len": hf["n_positions"], "vocab_size": hf["vocab_size"],
                "tie_embeddings": bool(hf.get("tie_word_embeddings", True))}

    def notes(self, hf: dict[str, Any]) -> list[str]:
        act = hf.get("activation_function", "gelu")
        if act != "gelu":
            return [f"activation_function {act!r} is GELU's tanh approximation; mcpar computes "
                    "the exact GELU, so outputs differ slightly from the original model's "
                    "(about 1e-3)"]
        return []

    def tensor_names(self, hf: Tensors) -> Tensors:
        # A GPT2Model saved without its head has bare names.
        return {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
                for k, v in hf.items()}

    def to_hf(self, cfg: ModelConfig, params: Tensors) -> Tensors:
        return {theirs: params[ours].t() if transposed else params[ours]
                for ours, theirs, transposed in _gpt_names(cfg)}

    def from_hf(self, cfg: ModelConfig, hf: Tensors) -> Tensors:
        return {ours: hf[theirs].t() if transposed else hf[theirs]
                for ours, theirs, transposed in _gpt_names(cfg)}
