"""GPT: a pre-norm decoder-only transformer, readable in one file.

Learned positions, causal ``scaled_dot_product_attention``, GELU MLP, LayerNorm before each sublayer
and at the end, output head tied to the token embedding. Initialization follows GPT-2 (normal 0.02,
residual projections scaled by 1/sqrt(2 x layers)) and is drawn from a generator seeded by the
config, so every rank builds the same model without a broadcast.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from mcpar.config import ModelConfig


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        # [batch, heads, seq, head_dim], the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.hidden_size)
        self.mlp = MLP(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x)))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.ln_final = nn.LayerNorm(cfg.hidden_size)

    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln_" in name or name.startswith("ln_"):
                    p.fill_(1.0)
                else:
                    std = residual_std if name.endswith("proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for input token ids [batch, seq]."""
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.dropout(self.tok_emb(tokens) + self.pos_emb(positions))
        for block in self.blocks:
            x = block(x)
        # Tied head: the token embedding doubles as the output projection.
        return F.linear(self.ln_final(x), self.tok_emb.weight)


def gpt_num_params(cfg: ModelConfig) -> int:
    """Exact parameter count, without building the model (used by plans and estimates)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    per_layer = (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (2 * h) + (h * f + f) + (f * h + h)
    return cfg.vocab_size * h + cfg.seq_len * h + cfg.num_layers * per_layer + 2 * h


def gpt_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 3 x forward (backward costs twice the forward).

    Forward per token: 2 FLOPs per weight of every matmul (QKV, attention output, two MLP
    matmuls, tied head) plus attention scores and weighted values, 2 x 2 x seq x hidden per layer
    (counted over the full square, as the kernels compute it).
    """
    h, f, s = cfg.hidden_size, cfg.ffn_size, cfg.seq_len
    matmul = cfg.num_layers * 2 * (4 * h * h + 2 * h * f) + 2 * h * cfg.vocab_size
    attention = cfg.num_layers * 4 * s * h
    return 3.0 * (matmul + attention)
