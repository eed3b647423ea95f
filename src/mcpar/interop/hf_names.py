"""mcpar <-> Hugging Face: key names, weight transforms and config.json, per model family.

Three families have an exact Hugging Face counterpart, checked against ``transformers``' own
modeling code by the logits test (tests/test_hf_interop.py):

- ``llama`` <-> ``LlamaForCausalLM``. Both rotate halves of each head (no q/k permutation),
  both take RMSNorm's mean of squares in fp32 and multiply the weight after casting back, and
  a query head j reads key/value head j // (heads / kv_heads) in both. mcpar's fused ``qkv``
  rows are grouped by key/value head (the queries of a group, its key, its value: see
  models/llama.py), so q/k/v are regrouped here; ``gate_up`` is gate stacked over up.
- ``llama_moe`` <-> ``MixtralForCausalLM``: Mixtral's router is a softmax over every expert,
  top-k, renormalised, and drops no token. mcpar computes exactly that only with
  ``router_score: softmax``, ``capacity_factor: null``, no shared expert, ``top_k`` >= 2 (with
  one expert per token Mixtral's weight is 1, mcpar's the probability) and a zero selection
  bias (``router_bias_update_rate`` moves it): ``mixtral_problems`` names the key otherwise.
  Experts are written in Mixtral's per-expert layout (``w1`` gate, ``w3`` up, ``w2`` down),
  which every ``transformers`` version loads; both that and the fused layout
  (``gate_up_proj`` / ``down_proj``) are read.
- ``gpt`` <-> ``GPT2LMHeadModel``: GPT-2's Conv1D stores weights [in, out] (transposed here);
  mcpar's MLP uses the exact (erf) GELU, so ``activation_function`` is ``gelu``, not GPT-2's
  ``gelu_new``; LayerNorm epsilon is torch's default 1e-5.

``moe`` (GPT with MoE blocks) has no Hugging Face counterpart and is refused.
"""

from __future__ import annotations

from typing import Any

import torch

from mcpar.config import ModelConfig
from mcpar.errors import problem

ARCHITECTURES = {"llama": "LlamaForCausalLM", "llama_moe": "MixtralForCausalLM",
                 "gpt": "GPT2LMHeadModel"}
KIND_OF_ARCHITECTURE = {arch: kind for kind, arch in ARCHITECTURES.items()}
GPT2_LN_EPS = 1e-5  # torch.nn.LayerNorm's default, what models/gpt.py builds

Tensors = dict[str, torch.Tensor]


def export_problems(cfg: ModelConfig, expert_bias: Tensors) -> list[str]:
    """Why this model cannot be written as its Hugging Face counterpart (empty: it can).
    ``expert_bias``: the routers' selection-bias buffers, by mcpar name."""
    if cfg.kind not in ARCHITECTURES:
        return [problem("model.kind", f"'{cfg.kind}' has no Hugging Face counterpart; "
                        f"export supports {sorted(ARCHITECTURES)}")]
    return mixtral_problems(cfg, expert_bias) if cfg.kind == "llama_moe" else []


def mixtral_problems(cfg: ModelConfig, expert_bias: Tensors) -> list[str]:
    why = "Mixtral has no equivalent"
    out = []
    if cfg.router_score != "softmax":
        out.append(problem("model.router_score", f"'{cfg.router_score}': {why} (Mixtral's "
                           "router is a softmax over the experts)"))
    if cfg.capacity_factor is not None:
        out.append(problem("model.capacity_factor", f"{cfg.capacity_factor}: {why} (Mixtral "
                           "drops no token); train with capacity_factor: null"))
    if cfg.shared_expert:
        out.append(problem("model.shared_expert", f"true: {why} (no shared expert)"))
    if cfg.top_k < 2:
        out.append(problem("model.top_k", f"{cfg.top_k}: {why} (Mixtral renormalises the "
                           "chosen weights, so one expert per token gets weight 1)"))
    biased = [name for name, b in expert_bias.items() if bool(b.ne(0).any())]
    if biased:
        out.append(problem("model.router_bias_update_rate", f"{cfg.router_bias_update_rate}: "
                           f"the selection bias ({biased[0]}) is not zero and {why}; train "
                           "with router_bias_update_rate: 0"))
    return out


# --- config.json ------------------------------------------------------------------------------
def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The config.json of ``cfg``'s Hugging Face counterpart (fp32 weights)."""
    common = {"architectures": [ARCHITECTURES[cfg.kind]], "vocab_size": cfg.vocab_size,
              "torch_dtype": "float32", "tie_word_embeddings": cfg.tie_embeddings,
              "use_cache": True}
    if cfg.kind == "gpt":
        return {**common, "model_type": "gpt2", "n_embd": cfg.hidden_size,
                "n_layer": cfg.num_layers, "n_head": cfg.num_heads, "n_inner": cfg.ffn_size,
                "n_positions": cfg.seq_len, "activation_function": "gelu",
                "layer_norm_epsilon": GPT2_LN_EPS, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    out = {**common, "model_type": "llama", "hidden_size": cfg.hidden_size,
           "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
           "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
           "head_dim": cfg.head_dim, "hidden_act": "silu",
           "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
           # Both spellings: older releases read rope_theta, newer ones rope_parameters.
           "rope_theta": cfg.rope_base,
           "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
           "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False}
    if cfg.kind == "llama_moe":
        out.update(model_type="mixtral", num_local_experts=cfg.num_experts,
                   num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
                   output_router_logits=False, router_aux_loss_coef=cfg.aux_loss_coef,
                   sliding_window=None)
    return out


def model_keys(hf: dict[str, Any]) -> dict[str, Any]:
    """The mcpar ``model`` keys of a Hugging Face config.json (one of ``ARCHITECTURES``)."""
    kind = KIND_OF_ARCHITECTURE[hf["architectures"][0]]
    tie = bool(hf.get("tie_word_embeddings", kind == "gpt"))
    if kind == "gpt":
        hidden = hf["n_embd"]
        return {"kind": kind, "num_layers": hf["n_layer"], "hidden_size": hidden,
                "num_heads": hf["n_head"], "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
                "seq_len": hf["n_positions"], "vocab_size": hf["vocab_size"],
                "tie_embeddings": tie}
    rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
    keys = {"kind": kind, "num_layers": hf["num_hidden_layers"],
            "hidden_size": hf["hidden_size"], "num_heads": hf["num_attention_heads"],
            "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
            "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
            "rope_base": float(rope), "norm_eps": hf.get("rms_norm_eps", 1e-6),
            "tie_embeddings": tie}
    if kind == "llama_moe":
        # What makes mcpar's MoE compute Mixtral's (see mixtral_problems).
        keys.update(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                    router_score="softmax", capacity_factor=None, shared_expert=False,
                    router_bias_update_rate=0.0)
    return keys


def hf_notes(hf: dict[str, Any]) -> list[str]:
    """What mcpar computes a little differently from a config.json it still accepts."""
    act = hf.get("activation_function", "gelu")
    if hf.get("model_type") == "gpt2" and act != "gelu":
        return [f"activation_function {act!r} is GELU's tanh approximation; mcpar computes the "
                "exact GELU, so outputs differ slightly from the original model's (about 1e-3)"]
    return []


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
def _split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """mcpar's kv-grouped qkv rows -> (q, k, v) in head order."""
    groups = qkv.view(cfg.kv_heads, cfg.num_heads // cfg.kv_heads + 2, cfg.head_dim, -1)
    return (groups[:, :-2].reshape(cfg.num_heads * cfg.head_dim, -1),
            groups[:, -2].reshape(cfg.kv_heads * cfg.head_dim, -1),
            groups[:, -1].reshape(cfg.kv_heads * cfg.head_dim, -1))


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cfg: ModelConfig) -> torch.Tensor:
    d, kv = cfg.head_dim, cfg.kv_heads
    groups = torch.cat([q.reshape(kv, -1, d, q.shape[-1]), k.reshape(kv, 1, d, k.shape[-1]),
                        v.reshape(kv, 1, d, v.shape[-1])], dim=1)
    return groups.reshape(-1, q.shape[-1])


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


def to_hf(cfg: ModelConfig, params: Tensors) -> Tensors:
    """Hugging Face tensors from mcpar's full parameters (names as ``named_parameters`` of the
    built model lists them: a tied head appears once, as the embedding)."""
    out: Tensors = {}
    if cfg.kind == "gpt":
        for ours, theirs, transposed in _gpt_names(cfg):
            out[theirs] = params[ours].t() if transposed else params[ours]
    else:
        out["model.embed_tokens.weight"] = params["embed.tok.weight"]
        for i in range(cfg.num_layers):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = params[b + "attn_norm.weight"]
            out[h + "post_attention_layernorm.weight"] = params[b + "mlp_norm.weight"]
            q, k, v = _split_qkv(params[b + "attn.qkv.weight"], cfg)
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
            out[h + "self_attn.o_proj.weight"] = params[b + "attn.proj.weight"]
            if cfg.kind == "llama":
                gate, up = params[b + "mlp.gate_up.weight"].chunk(2, dim=0)
                out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
                out[h + "mlp.down_proj.weight"] = params[b + "mlp.down.weight"]
                continue
            moe = h + "block_sparse_moe."
            out[moe + "gate.weight"] = params[b + "mlp.router.gate.weight"]
            for e in range(cfg.num_experts):
                # mcpar's experts multiply rows by [in, out]; nn.Linear stores [out, in].
                for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
                    out[f"{moe}experts.{e}.{theirs}.weight"] = \
                        params[f"{b}mlp.experts.{ours}.weight"][e].t()
        out["model.norm.weight"] = params["head.norm.weight"]
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = params["head.out.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def from_hf(cfg: ModelConfig, hf: Tensors) -> Tensors:
    """mcpar's full parameters (``named_parameters`` names) from Hugging Face tensors; raises
    KeyError naming the first Hugging Face key that is missing."""
    if cfg.kind == "gpt":
        hf = {k if k.startswith(("transformer.", "lm_head.")) else "transformer." + k: v
              for k, v in hf.items()}  # a GPT2Model saved without its head has bare names
        out = {ours: hf[theirs].t() if transposed else hf[theirs]
               for ours, theirs, transposed in _gpt_names(cfg)}
    else:
        out = {"embed.tok.weight": hf["model.embed_tokens.weight"]}
        for i in range(cfg.num_layers):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out[b + "attn_norm.weight"] = hf[h + "input_layernorm.weight"]
            out[b + "mlp_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
            out[b + "attn.qkv.weight"] = _join_qkv(
                hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                hf[h + "self_attn.v_proj.weight"], cfg)
            out[b + "attn.proj.weight"] = hf[h + "self_attn.o_proj.weight"]
            if cfg.kind == "llama":
                out[b + "mlp.gate_up.weight"] = torch.cat(
                    [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
                out[b + "mlp.down.weight"] = hf[h + "mlp.down_proj.weight"]
            else:
                out.update(_experts_from_hf(cfg, hf, b, h))
        out["head.norm.weight"] = hf["model.norm.weight"]
    if not cfg.tie_embeddings:
        out["head.out.weight"] = hf["lm_head.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def _experts_from_hf(cfg: ModelConfig, hf: Tensors, b: str, h: str) -> Tensors:
    """One Mixtral layer's router and experts, per-expert or fused layout."""
    out: Tensors = {}
    fused = h + "mlp.experts.gate_up_proj"
    if fused in hf:  # [E, 2F, H] and [E, H, F]
        gate, up = hf[fused].chunk(2, dim=1)
        out[b + "mlp.experts.gate.weight"] = gate.transpose(1, 2)
        out[b + "mlp.experts.up.weight"] = up.transpose(1, 2)
        out[b + "mlp.experts.down.weight"] = hf[h + "mlp.experts.down_proj"].transpose(1, 2)
        out[b + "mlp.router.gate.weight"] = hf[h + "mlp.gate.weight"]
        return out
    moe = h + "block_sparse_moe."
    out[b + "mlp.router.gate.weight"] = hf[moe + "gate.weight"]
    for ours, theirs in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
        out[f"{b}mlp.experts.{ours}.weight"] = torch.stack(
            [hf[f"{moe}experts.{e}.{theirs}.weight"].t() for e in range(cfg.num_experts)])
    return out
