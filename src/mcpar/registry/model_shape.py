"""The shape of a model as the cost model and the memory model count it (``ModelShape``).

A model family's registry entry gives the shape of a config (``ModelFamily.shape``); the
published presets and the calibration rows are shapes too. It lives here, below the simulator
and the config, so that the simulator prices any registered family without importing it.

``ffn`` is the inner width of one MLP (of one expert for MoE); every layer is an MoE layer when
``experts > 0``. The flags default to the published stacks (no linear biases, LayerNorms with a
bias, rotary positions, untied head, dropout masks kept); a family's ``shape`` sets them to its
own modules, so that the parameters a rank holds are counted as the family counts them.

These methods are the one count: a model family's ``num_params``, ``stage_num_params`` and
``flops_per_token`` (``mcpar.registry.model_family``) are its shape's, and the tests hold them
to the built modules, parameter for parameter.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

FFN_KINDS = ("gelu", "swiglu", "relu2", "geglu", "relu", "silu")
GATED_FFN = ("swiglu", "geglu")  # a gate matrix beside the up projection


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    ffn_kind: str
    vocab: int
    seq_len: int
    experts: int = 0
    top_k: int = 0
    name: str = ""
    bias: bool = False  # biases on the attention and dense-MLP linears (GPT-2, mcpar's GPT)
    learned_positions: bool = False  # a seq_len x hidden position table beside the embedding
    tied_embeddings: bool = False  # the head shares the embedding when one rank holds both
    shared_expert: bool = False  # MoE: a dense MLP every token goes through, beside the experts
    dropout: bool = True  # dropout layers keep 1-byte masks for the backward pass
    norm_bias: bool = True  # a bias beside each norm's weight (LayerNorm; RMSNorm has none)

    @property
    def head_dim(self) -> float:
        return self.hidden / self.heads

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of one MLP: SwiGLU has a gate beside the up projection."""
        return 3 if self.ffn_kind in GATED_FFN else 2

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def norm_params(self) -> int:
        """Parameters of one norm: a weight of hidden, and LayerNorm's bias."""
        return self.hidden * (2 if self.norm_bias else 1)

    def layer_param_split(self) -> tuple[float, float, float]:
        """Parameters of one layer as tensor parallelism places them: (split over tp ranks,
        replicated on every tp rank, expert weights). Split: the attention and MLP matrices, the
        biases of column-parallel linears (QKV, up/gate), a shared expert's. Replicated: the two
        norms (weight, and bias for LayerNorm), the biases of row-parallel linears (added after
        the reduction), the router. The experts' matrices have no biases."""
        return self._layer_split

    # Computed once per shape: the planner and the calibration's fits price every stage of a
    # shape's layouts many times over.
    @cached_property
    def _layer_split(self) -> tuple[float, float, float]:
        h, f = self.hidden, self.ffn
        kv = self.kv_heads * self.head_dim
        split = h * (h + 2 * kv) + h * h + (h + 2 * kv if self.bias else 0)
        replicated = 2 * self.norm_params + (h if self.bias else 0)
        dense_mlp_split = self.mlp_matrices * h * f + ((self.mlp_matrices - 1) * f if self.bias
                                                        else 0)
        dense_mlp_replicated = h if self.bias else 0
        if not self.is_moe:
            return split + dense_mlp_split, replicated + dense_mlp_replicated, 0.0
        replicated += h * self.experts  # the router
        if self.shared_expert:
            split += dense_mlp_split
            replicated += dense_mlp_replicated
        return split, replicated, float(self.experts * self.mlp_matrices * h * f)

    def layer_params(self) -> tuple[float, float]:
        """(dense, expert) parameters of one layer: attention + norms (+ dense MLP or router)
        and the experts' MLPs."""
        split, replicated, expert = self.layer_param_split()
        return split + replicated, expert

    def stage_params(self, blocks: int, first: bool, last: bool, tp: int = 1,
                     ep: int = 1) -> tuple[float, float]:
        """(dense, expert) parameters one GPU holds for a pipeline stage of ``blocks`` layers at
        tensor degree ``tp`` and expert degree ``ep``: the first stage adds the embedding (split
        over the vocabulary) and the position table, the last the final norm and the head, which
        is the embedding itself when tied and one stage holds both. The experts are split over
        ``ep`` and their width over ``tp``."""
        split, replicated, expert = self._layer_split
        h = self.hidden
        dense = blocks * (split / tp + replicated)
        vocab = self.vocab * h / tp
        if first:
            dense += vocab + (self.seq_len * h if self.learned_positions else 0)
        if last:
            dense += self.norm_params + (0 if self.tied_embeddings and first else vocab)
        return dense, blocks * expert / tp / ep

    def stage_num_params(self, blocks: int, first: bool, last: bool, tp: int = 1,
                         ep: int = 1) -> float:
        """All parameters one GPU holds for a stage (``stage_params``, dense and expert)."""
        return sum(self.stage_params(blocks, first, last, tp, ep))

    def num_params(self) -> float:
        """Layers, embedding (and position table), final norm and head (none when tied): the
        whole model as one stage on one GPU."""
        return self.stage_num_params(self.layers, True, True)

    def flops_terms(self) -> dict[str, float]:
        """Training FLOPs of one token without recompute, term by term: 3 x the forward's 2 per
        multiply-add (``profiler/mfu.py`` documents each term and what is left out).
        attention_linears: QKV and output projections; mlp: the MLP matrices (experts x top_k
        and the shared expert) and the router; attention_scores: q k^T and p v over the full
        s x s square, as the published formulas count them; head: the output projection."""
        h = self.hidden
        kv = self.kv_heads * self.head_dim
        routed = (self.top_k + (1 if self.shared_expert else 0)) if self.is_moe else 1
        mlp = self.mlp_matrices * h * self.ffn * routed + (h * self.experts if self.is_moe
                                                           else 0)
        return {"attention_linears": 6.0 * self.layers * (h * (h + 2 * kv) + h * h),
                "mlp": 6.0 * self.layers * mlp,
                "attention_scores": 12.0 * self.layers * self.seq_len * h,
                "head": 6.0 * h * self.vocab}

    def flops_per_token(self) -> float:
        """Training FLOPs of one token without recompute: the sum of ``flops_terms``."""
        return sum(self.flops_terms().values())
