"""GPT: a pre-norm decoder-only transformer, readable in one file.

Learned positions, causal ``scaled_dot_product_attention``, GELU MLP, LayerNorm before each sublayer
and at the end, and an output head (tied to the token embedding when ``model.tie_embeddings``).
Initialization follows GPT-2 (normal 0.02, residual projections scaled by 1/sqrt(2 x layers)) and
is drawn from a generator seeded by the config, so every rank builds the same model without a
broadcast.

The model is three kinds of pieces, ``embed -> blocks -> head``, so that pipeline parallelism can
cut it between any two pieces and tensor parallelism can swap each piece's linears for sharded
ones; ``GPT.pieces`` and ``plans.py`` say where those are, for the family entry (``family.py``).
Nothing else in this file knows about parallelism: shapes are read from the tensors (a
sharded attention has fewer local heads; a sequence-parallel block sees a slice of the sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mcpar.config import ModelConfig
from mcpar.models.plan import ModelPieces


class AttentionCore(nn.Module):
    """softmax(q k^T / sqrt(d), causal) v, with attention dropout: no parameters, the part of a
    block whose saved activations grow with the sequence squared in an unfused kernel. A module
    of its own so that selective recompute (``controllers/memory/recompute.py``) can name it."""

    def __init__(self, dropout: float):
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_heads = cfg.num_heads
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.core = AttentionCore(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)
        batch, seq, _ = qkv.shape
        # [batch, heads, seq, head_dim], the layout scaled_dot_product_attention expects.
        q, k, v = (t.view(batch, seq, self.num_heads, -1).transpose(1, 2)
                   for t in qkv.chunk(3, dim=2))
        y = self.core(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.proj = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, mlp: Callable[[ModelConfig], nn.Module] = MLP):
        """``mlp`` builds the feed-forward sublayer (the MoE model passes its MoE layer)."""
        super().__init__()
        self.ln_attn = nn.LayerNorm(cfg.hidden_size)
        self.attn = CausalSelfAttention(cfg)
        self.ln_mlp = nn.LayerNorm(cfg.hidden_size)
        self.mlp = mlp(cfg)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.dropout(self.attn(self.ln_attn(x)))
        return x + self.dropout(self.mlp(self.ln_mlp(x)))


class TokenEmbedding(nn.Module):
    """Token plus learned position embedding: token ids [batch, seq] -> [batch, seq, hidden]."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(cfg.seq_len, cfg.hidden_size)
        self.dropout = nn.Dropout(cfg.dropout)
        # The absolute positions of the tokens this module sees, where they are not 0..seq-1
        # (a sequence shard: context parallelism sets it); not part of the model's state.
        self.register_buffer("positions", None, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = (self.positions if self.positions is not None
                     else torch.arange(tokens.shape[1], device=tokens.device))
        return self.dropout(self.tok(tokens) + self.pos(positions))


class OutputHead(nn.Module):
    """Final LayerNorm and the projection to vocabulary logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_final = nn.LayerNorm(cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.ln_final(x))


class GPT(nn.Module):
    def __init__(self, cfg: ModelConfig, block: Callable[[ModelConfig], nn.Module] = Block):
        """``block`` builds one transformer block (the MoE model passes its own)."""
        super().__init__()
        self.cfg = cfg
        self.embed = TokenEmbedding(cfg)
        self.blocks = nn.ModuleList(block(cfg) for _ in range(cfg.num_layers))
        self.head = OutputHead(cfg)
        if cfg.tie_embeddings:
            self.head.out.weight = self.embed.tok.weight

    def init_weights(self, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        residual_std = 0.02 / math.sqrt(2 * self.cfg.num_layers)
        with torch.no_grad():
            for name, p in self.named_parameters():  # a tied weight is listed (and drawn) once
                if name.endswith("bias"):
                    p.zero_()
                elif ".ln_" in name:
                    p.fill_(1.0)
                else:
                    std = residual_std if name.endswith("proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits [batch, seq, vocab] for input token ids [batch, seq]."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def pieces(self) -> ModelPieces:
        """The pieces a pipeline cuts between, under the names they have here."""
        return ModelPieces(self.embed, list(self.blocks), self.head, ("embed", "blocks", "head"))
