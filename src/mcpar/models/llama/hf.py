"""Llama <-> Hugging Face ``LlamaForCausalLM``, and its MoE form <-> ``MixtralForCausalLM``.

- ``llama``: both rotate halves of each head (no q/k permutation), both take RMSNorm's mean of
  squares in fp32 and multiply the weight after casting back, and a query head j reads
  key/value head j // (heads / kv_heads) in both. mcpar's fused ``qkv`` rows are grouped by
  key/value head (the queries of a group, its key, its value: see model.py), so q/k/v are
  regrouped here; ``gate_up`` is gate stacked over up.
- ``llama_moe``: Mixtral's router is a softmax over every expert, top-k, renormalised, and drops
  no token. mcpar computes exactly that only with ``router_score: softmax``,
  ``capacity_factor: null``, no shared expert, ``top_k`` >= 2 (with one expert per token
  Mixtral's weight is 1, mcpar's the probability) and a zero selection bias
  (``router_bias_update_rate`` moves it): ``mixtral_problems`` names the key otherwise. Experts
  are written in Mixtral's per-expert layout (``w1`` gate, ``w3`` up, ``w2`` down), which every
  ``transformers`` version loads; both that and the fused layout (``gate_up_proj`` /
  ``down_proj``) are read.

Both are checked against ``transformers``' own modeling code by the logits test
(tests/test_hf_interop.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mcpar.config import ModelConfig
from mcpar.errors import problem
from mcpar.models.hf import HFNames, Tensors

if TYPE_CHECKING:  # the family's entry holds this map; `mcpar check` reads it without torch
    import torch


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


def _split_qkv(qkv: torch.Tensor, cfg: ModelConfig) -> tuple[torch.Tensor, ...]:
    """mcpar's kv-grouped qkv rows -> (q, k, v) in head order."""
    groups = qkv.view(cfg.kv_heads, cfg.num_heads // cfg.kv_heads + 2, cfg.head_dim, -1)
    return (groups[:, :-2].reshape(cfg.num_heads * cfg.head_dim, -1),
            groups[:, -2].reshape(cfg.kv_heads * cfg.head_dim, -1),
            groups[:, -1].reshape(cfg.kv_heads * cfg.head_dim, -1))


def _join_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              cfg: ModelConfig) -> torch.Tensor:
    import torch

    d, kv = cfg.head_dim, cfg.kv_heads
    groups = torch.cat([q.reshape(kv, -1, d, q.shape[-1]), k.reshape(kv, 1, d, k.shape[-1]),
                        v.reshape(kv, 1, d, v.shape[-1])], dim=1)
    return groups.reshape(-1, q.shape[-1])


def _experts_from_hf(cfg: ModelConfig, hf: Tensors, b: str, h: str) -> Tensors:
    """One Mixtral layer's router and experts, per-expert or fused layout."""
    import torch

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


class LlamaNames(HFNames):
    """``LlamaForCausalLM``, or with ``moe`` ``MixtralForCausalLM``."""

    embedding = "model.embed_tokens.weight"
    # Rotary positions have no table: a run may train on shorter (or longer) windows than the
    # max_position_embeddings it was imported with.
    free_keys = ("seq_len",)

    def __init__(self, moe: bool = False):
        self.moe = moe
        self.kind = "llama_moe" if moe else "llama"
        self.architecture = "MixtralForCausalLM" if moe else "LlamaForCausalLM"

    def export_problems(self, cfg: ModelConfig, expert_bias: Tensors) -> list[str]:
        return mixtral_problems(cfg, expert_bias) if self.moe else []

    def config_json(self, cfg: ModelConfig) -> dict[str, Any]:
        out = {"model_type": "llama", "hidden_size": cfg.hidden_size,
               "intermediate_size": cfg.ffn_size, "num_hidden_layers": cfg.num_layers,
               "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.kv_heads,
               "head_dim": cfg.head_dim, "hidden_act": "silu",
               "max_position_embeddings": cfg.seq_len, "rms_norm_eps": cfg.norm_eps,
               # Both spellings: older releases read rope_theta, newer ones rope_parameters.
               "rope_theta": cfg.rope_base,
               "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_base},
               "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False}
        if self.moe:
            out.update(model_type="mixtral", num_local_experts=cfg.num_experts,
                       num_experts_per_tok=cfg.top_k, router_jitter_noise=0.0,
                       output_router_logits=False, router_aux_loss_coef=cfg.aux_loss_coef,
                       sliding_window=None)
        return out

    def model_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
        rope = (hf.get("rope_parameters") or {}).get("rope_theta", hf.get("rope_theta", 10000.0))
        keys = {"kind": self.kind, "num_layers": hf["num_hidden_layers"],
                "hidden_size": hf["hidden_size"], "num_heads": hf["num_attention_heads"],
                "num_kv_heads": hf.get("num_key_value_heads") or hf["num_attention_heads"],
                "ffn_hidden_size": hf["intermediate_size"], "vocab_size": hf["vocab_size"],
                # 2048: LlamaConfig's default, for a config.json that leaves it out.
                "seq_len": hf.get("max_position_embeddings", 2048),
                "rope_base": float(rope), "norm_eps": hf.get("rms_norm_eps", 1e-6),
                "tie_embeddings": bool(hf.get("tie_word_embeddings", False))}
        if self.moe:
            # What makes mcpar's MoE compute Mixtral's (see mixtral_problems).
            keys.update(num_experts=hf["num_local_experts"], top_k=hf["num_experts_per_tok"],
                        router_score="softmax", capacity_factor=None, shared_expert=False,
                        router_bias_update_rate=0.0)
        return keys

    def to_hf(self, cfg: ModelConfig, params: Tensors) -> Tensors:
        out = {"model.embed_tokens.weight": params["embed.tok.weight"]}
        for i in range(cfg.num_layers):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out[h + "input_layernorm.weight"] = params[b + "attn_norm.weight"]
            out[h + "post_attention_layernorm.weight"] = params[b + "mlp_norm.weight"]
            q, k, v = _split_qkv(params[b + "attn.qkv.weight"], cfg)
            out[h + "self_attn.q_proj.weight"], out[h + "self_attn.k_proj.weight"] = q, k
            out[h + "self_attn.v_proj.weight"] = v
            out[h + "self_attn.o_proj.weight"] = params[b + "attn.proj.weight"]
            if not self.moe:
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
        return out

    def from_hf(self, cfg: ModelConfig, hf: Tensors) -> Tensors:
        import torch

        out = {"embed.tok.weight": hf["model.embed_tokens.weight"]}
        for i in range(cfg.num_layers):
            b, h = f"blocks.{i}.", f"model.layers.{i}."
            out[b + "attn_norm.weight"] = hf[h + "input_layernorm.weight"]
            out[b + "mlp_norm.weight"] = hf[h + "post_attention_layernorm.weight"]
            out[b + "attn.qkv.weight"] = _join_qkv(
                hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                hf[h + "self_attn.v_proj.weight"], cfg)
            out[b + "attn.proj.weight"] = hf[h + "self_attn.o_proj.weight"]
            if not self.moe:
                out[b + "mlp.gate_up.weight"] = torch.cat(
                    [hf[h + "mlp.gate_proj.weight"], hf[h + "mlp.up_proj.weight"]])
                out[b + "mlp.down.weight"] = hf[h + "mlp.down_proj.weight"]
            else:
                out.update(_experts_from_hf(cfg, hf, b, h))
        out["head.norm.weight"] = hf["model.norm.weight"]
        return out
