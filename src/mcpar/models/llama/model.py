"""Llama: the decoder of Llama 2/3 (and, with MoE blocks, of Mixtral), readable in one file.

Against GPT (``models/gpt``): RMSNorm instead of LayerNorm, rotary position embeddings (base
``model.rope_base``) instead of a learned position table, a SwiGLU MLP
``down(silu(gate x) * up x)`` of width ``cfg.ffn_size`` (Llama's 8/3 x hidden rounded up to
``ffn_multiple_of`` unless given), grouped-query attention (``num_kv_heads`` key/value heads,
each shared by ``num_heads / num_kv_heads`` query heads), and no biases. Initialization is
GPT's (normal 0.02, residual projections scaled by 1/sqrt(2 x layers), norms 1), seeded by the
config.

Weight layouts, chosen so that tensor parallelism needs no new mechanism:

- ``attn.qkv`` is one linear whose output rows are grouped by key/value head: for each of the
  ``num_kv_heads`` groups, its ``num_heads / num_kv_heads`` query heads, then its key head, then
  its value head (Megatron's GQA layout). A column-parallel split of the rows into tp equal
  slices then hands each rank whole groups (``num_kv_heads / tp`` of them), so the plan
  (``plans.py``) is a plain ``ColumnParallel`` and the head counts it names must both divide
  by tp.
- ``mlp.gate_up`` stacks gate over up (``fused=2``): each is split on its own, so a rank keeps
  matching slices of both.

Rotary embeddings use the rotate-half convention (the first half of each head's dims pairs with
the second half), computed in fp32; positions are 0..seq-1 of the whole sequence, which the
attention always sees (under sequence parallelism ``qkv``'s column-parallel input is gathered).

The MoE form (``llama_moe``) keeps the MoE model's router, capacity, auxiliary loss, balancing and
dispatch (``MoELayer``) and gives it SwiGLU experts (three stacked weights) and a SwiGLU shared
expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mcpar.config import ModelConfig
from mcpar.models.gpt.model import AttentionCore
from mcpar.models.moe.model import GroupedWeight, MoELayer
from mcpar.models.plan import ModelPieces


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # In fp32 whatever the activations' dtype: the mean of squares loses too much in 16 bits.
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


def rotary_cos_sin(seq_len: int, head_dim: int, base: float, device: torch.device,
                   positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [seq, head_dim] of position p times frequency base^(-2i/head_dim), each
    frequency repeated for both halves (rotate-half pairing), in fp32. ``positions``: the
    tokens' absolute positions (default 0..seq_len-1)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                        / head_dim)
    if positions is None:
        positions = torch.arange(seq_len, device=device)
    angles = torch.outer(positions.to(torch.float32), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each (x_i, x_{i+d/2}) pair of ``x`` [batch, heads, seq, d] by its angle."""
    first, second = x.float().chunk(2, dim=-1)
    rotated_half = torch.cat([-second, first], dim=-1)
    return (x.float() * cos + rotated_half * sin).to(x.dtype)


class GroupedQueryAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Head counts are divided by tp when the module is sharded; the forward pass reads the
        # local counts from the tensors and needs only these two invariants.
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.kv_heads
        self.queries_per_group = cfg.num_heads // cfg.kv_heads
        self.head_dim = cfg.head_dim
        self.rope_base = cfg.rope_base
        self.core = AttentionCore(cfg.dropout)
        # The absolute positions of the tokens this module sees, where they are not 0..seq-1
        # (a sequence shard: context parallelism sets it); not part of the model's state.
        self.register_buffer("positions", None, persistent=False)
        group_rows = (self.queries_per_group + 2) * self.head_dim
        self.qkv = nn.Linear(cfg.hidden_size, cfg.kv_heads * group_rows, bias=False)
        self.proj = nn.Linear(cfg.num_heads * self.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        groups = qkv.view(batch, seq, -1, self.queries_per_group + 2, self.head_dim)
        # -> [batch, heads, seq, head_dim]; query head j belongs to group j // queries_per_group.
        q = groups[:, :, :, :-2].reshape(batch, seq, -1, self.head_dim).transpose(1, 2)
        k = groups[:, :, :, -2].transpose(1, 2)
        v = groups[:, :, :, -1].transpose(1, 2)
        cos, sin = rotary_cos_sin(seq, self.head_dim, self.rope_base, x.device, self.positions)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.queries_per_group > 1:  # every query head of a group reads its group's k, v
            k = k.repeat_interleave(self.queries_per_group, dim=1)
            v = v.repeat_interleave(self.queries_per_group, dim=1)
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class SwiGLU(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: Callable[[ModelConfig], nn.Module] = SwiGLU):
        """``mlp`` builds the feed-forward sublayer (the MoE form passes its MoE layer)."""
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.attn = GroupedQueryAttention(cfg)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.mlp = mlp(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x)))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


class LlamaEmbedding(nn.Module):
    """Token embedding only: positions enter through the rotary embedding in attention."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.tok(tokens))


class LlamaHead(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.norm_eps)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def swiglu_experts(rows: torch.Tensor, counts: list[int], gate: torch.Tensor, up: torch.Tensor,
                   down: torch.Tensor) -> torch.Tensor:
    """Expert i's SwiGLU on the i-th run of ``counts[i]`` rows (rows sorted by expert). As in
    the MoE model's ``expert_mlps``, an expert with no rows still runs, to keep every rank's
    backward all-to-all connected."""
    outs = []
    for i, piece in enumerate(rows.split(counts)):
        hidden = F.silu(piece @ gate[i].to(piece.dtype)) * (piece @ up[i].to(piece.dtype))
        outs.append(hidden @ down[i].to(piece.dtype))
    return torch.cat(outs)


class SwiGLUExperts(nn.Module):
    """Every expert on this rank, with the MoE model's ``Experts`` interface."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        h, f, e = cfg.hidden_size, cfg.ffn_size, cfg.num_experts
        # Gate and up apart (not stacked): tensor parallelism splits each expert's width, and
        # a stacked [gate | up] width would hand one rank all of gate and the other all of up.
        self.gate = GroupedWeight(e, h, f)
        self.up = GroupedWeight(e, h, f)
        self.down = GroupedWeight(e, f, h)

    def forward(self, tokens: torch.Tensor, token_index: torch.Tensor,
                expert_index: torch.Tensor) -> torch.Tensor:
        order = torch.argsort(expert_index, stable=True)
        counts = torch.bincount(expert_index, minlength=self.num_experts).tolist()
        out = swiglu_experts(tokens[token_index[order]], counts, self.gate.weight,
                             self.up.weight, self.down.weight)
        return out[torch.argsort(order)]


class LlamaMoELayer(MoELayer):
    """The MoE model's layer (router, capacity, auxiliary loss, statistics), SwiGLU experts."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        # The parent built GELU experts (and shared MLP); replacing them here keeps its router
        # and dispatch untouched, for a transient allocation while the model is built.
        self.experts = SwiGLUExperts(cfg)
        self.shared = SwiGLU(cfg) if cfg.shared_expert else None


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig, moe: bool = False):
        """``moe``: the blocks' MLPs are MoE layers (the ``llama_moe`` entry)."""
        super().__init__()
        self.cfg = cfg
        mlp = LlamaMoELayer if moe else SwiGLU
        self.embed = LlamaEmbedding(cfg)
        self.blocks = nn.ModuleList(LlamaBlock(cfg, mlp) for _ in range(cfg.num_layers))
        self.head = LlamaHead(cfg)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        residual = (".attn.proj.", ".mlp.down.", ".mlp.shared.down.")
        with torch.no_grad():
            for name, p in self.named_parameters():  # a tied weight is listed (and drawn) once
                if name.endswith("norm.weight"):
                    p.fill_(1.0)
                else:
                    std = (residual_std if any(r in name for r in residual)
                           or name.endswith("experts.down.weight") else 0.02)
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for input token ids [batch, seq]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pieces(self) -> ModelPieces:
        return ModelPieces(self.embed, list(self.blocks), self.head, ("embed", "blocks", "head"))


def build_llama(cfg: ModelConfig, seed: int, moe: bool = False) -> Llama:
    model = Llama(cfg, moe)
    model.init_weights(seed)
    return model
