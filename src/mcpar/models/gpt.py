"""GPT: a pre-norm decoder-only transformer, readable in one file.

Learned positions, causal ``scaled_dot_product_attention``, GELU MLP, LayerNorm before each sublayer
and at the end, and an output head (tied to the token embedding when ``model.tie_embeddings``).
Initialization follows GPT-2 (normal 0.02, residual projections scaled by 1/sqrt(2 x layers)) and
is drawn from a generator seeded by the config, so every rank builds the same model without a
broadcast.

The model is three kinds of pieces, ``embed -> blocks -> head``, so that pipeline parallelism can
cut it between any two pieces and tensor parallelism can swap each piece's linears for sharded
ones; ``GPT.pieces`` and ``GPT_TENSOR_PARALLEL`` (at the end) say where those are, for the model
spec. Nothing else in this file knows about parallelism: shapes are read from the tensors (a
sharded attention has fewer local heads; a sequence-parallel block sees a slice of the sequence).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from mcpar.config import ModelConfig
from mcpar.models.plan import (
    BlockPlan,
    ColumnParallel,
    EmbeddingPlan,
    ModelPieces,
    OutputPlan,
    TensorParallelPlan,
)


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

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
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


# Where tensor parallelism finds the linears, embeddings and norms (paths inside each piece).
ATTENTION_TENSOR_PARALLEL = BlockPlan(
    column=(ColumnParallel("attn.qkv", fused=3),),  # q|k|v: each split by heads
    row=("attn.proj",),
    norms=("ln_attn", "ln_mlp"),
    heads=("attn.num_heads",),
)
GPT_TENSOR_PARALLEL = TensorParallelPlan(
    embedding=EmbeddingPlan(vocab="tok", positions="pos"),
    block=BlockPlan(
        column=(*ATTENTION_TENSOR_PARALLEL.column, ColumnParallel("mlp.fc")),
        row=(*ATTENTION_TENSOR_PARALLEL.row, "mlp.proj"),
        norms=ATTENTION_TENSOR_PARALLEL.norms,
        heads=ATTENTION_TENSOR_PARALLEL.heads,
    ),
    output=OutputPlan(projection="out", norms=("ln_final",)),
)


def gpt_num_params(cfg: ModelConfig) -> int:
    """Exact parameter count, without building the model (used by plans and estimates)."""
    h, f = cfg.hidden_size, cfg.ffn_size
    per_layer = (2 * h) + (3 * h * h + 3 * h) + (h * h + h) + (2 * h) + (h * f + f) + (f * h + h)
    head = 2 * h + (0 if cfg.tie_embeddings else cfg.vocab_size * h)
    return cfg.vocab_size * h + cfg.seq_len * h + cfg.num_layers * per_layer + head


def gpt_stage_num_params(cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
    """Parameters one rank holds for a pipeline stage of `num_blocks` blocks (plus the embedding
    on the first stage, the head on the last) under tensor parallelism `tp`: matrices, column
    biases and the vocabulary are split; norms, position embedding and row-parallel output biases
    are replicated. (``ep`` is for the MoE spec's signature; a dense model has no experts.)"""
    h, f, v = cfg.hidden_size, cfg.ffn_size, cfg.vocab_size
    sharded = (3 * h * h + 3 * h) + h * h + (h * f + f) + f * h
    replicated = 4 * h + 2 * h
    total = num_blocks * (sharded // tp + replicated)
    if first:
        total += v * h // tp + cfg.seq_len * h
    if last:
        total += 2 * h + (0 if cfg.tie_embeddings and first else v * h // tp)
    return total


def gpt_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token: 3 x forward (backward costs twice the forward).

    Forward per token: 2 FLOPs per weight of every matmul (QKV, attention output, two MLP
    matmuls, output head) plus attention scores and weighted values, 2 x 2 x seq x hidden per layer
    (counted over the full square, as the kernels compute it).
    """
    h, f, s = cfg.hidden_size, cfg.ffn_size, cfg.seq_len
    matmul = cfg.num_layers * 2 * (4 * h * h + 2 * h * f) + 2 * h * cfg.vocab_size
    attention = cfg.num_layers * 4 * s * h
    return 3.0 * (matmul + attention)
