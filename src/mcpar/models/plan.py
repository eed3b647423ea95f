"""What parallelizing needs to know about a model family, as data the family writes down.

A model is three kinds of pieces, ``embedding -> blocks -> head``: pipeline parallelism cuts it
between any two pieces, tensor parallelism swaps linears inside each piece for sharded ones and
expert parallelism spreads the experts of the MoE layers it finds in a block. Each family says
where those things are in its modules in its package (``models/<family>/plans.py``), and its
registry entry (``ModelSpec``, spec.py) carries it; ``mcpar.parallel`` reads only these
descriptions and never names a model's attributes.

Module paths are dotted attribute paths *relative to a piece* (``"attn.qkv"`` inside a block,
``"tok"`` inside the embedding; ``""`` is the piece itself, e.g. an embedding piece that is the
bare table), in the spirit of TorchTitan's parallelize plans; the mechanism behind them is
mcpar's own (parallel/tensor.py, parallel/expert.py).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:  # plans are data: `mcpar check` reads the entries holding them without torch
    import torch
    from torch import nn


class ModelPieces(NamedTuple):
    """A built model as the pipeline sees it.

    ``names`` are the attribute names a pipeline stage registers the pieces under (the model's
    own, so that a stage's parameter names, and with them checkpoints, read like the model's).
    """

    embedding: nn.Module  # token ids [batch, seq] -> activations [batch, seq, hidden]
    blocks: list[nn.Module]  # activations -> activations, one per layer
    head: nn.Module  # activations -> logits [batch, seq, vocab]
    names: tuple[str, str, str]  # (embedding, blocks, head) attribute names in a stage


@dataclass(frozen=True)
class ColumnParallel:
    """A linear split by output features. ``fused`` projections stacked along its outputs (a
    fused q|k|v linear: 3) are each split on their own, so every rank keeps the same heads of
    each projection."""

    path: str
    fused: int = 1


@dataclass(frozen=True)
class BlockPlan:
    """Tensor-parallel plan of one block (paths relative to the block)."""

    column: tuple[ColumnParallel, ...] = ()  # first linear of each pair
    row: tuple[str, ...] = ()  # second linear of each pair, split by input features
    # Replicated modules on the residual stream (norms): under sequence parallelism they act on
    # a sequence shard and their gradients are summed over the tensor axis.
    norms: tuple[str, ...] = ()
    # Attributes holding a head count that the tensor degree divides ("attn.num_heads").
    heads: tuple[str, ...] = ()


@dataclass(frozen=True)
class EmbeddingPlan:
    """Tensor-parallel plan of the embedding piece (paths relative to it)."""

    vocab: str  # an nn.Embedding split over the vocabulary
    # An nn.Embedding of positions, replicated (under sequence parallelism it looks up only the
    # positions of this rank's shard), or None.
    positions: str | None = None


@dataclass(frozen=True)
class OutputPlan:
    """Tensor-parallel plan of the head piece (paths relative to it)."""

    projection: str  # the linear to vocabulary logits, split over the vocabulary (never gathered)
    norms: tuple[str, ...] = ()  # replicated, sequence-parallel norms before it


@dataclass(frozen=True)
class TensorParallelPlan:
    """Where the tensor-parallel linears, embeddings and norms of a model are.

    A head whose projection weight *is* the embedding's weight (tied) shares the embedding's
    vocabulary slice when both are on the same stage.
    """

    embedding: EmbeddingPlan
    block: BlockPlan  # every block alike
    output: OutputPlan  # the head piece


@dataclass(frozen=True)
class ContextParallelPlan:
    """Where context parallelism finds a model's attention cores and position ids.

    ``attention_core``: the attention core inside a block (a parameter-free module called as
    ``core(q, k, v)`` on [batch, heads, seq, head_dim], causal), which context parallelism
    replaces. ``embedding_positions`` / ``block_positions``: modules (inside the embedding piece /
    inside a block) with a ``positions`` buffer, the absolute positions of the tokens they see
    (None there: 0..seq-1); context parallelism sets it to the positions of this rank's shard.
    ``routed_layer``: a block's routed (MoE) layer, whose per-sequence routing statistics are
    summed over the context ranks; None in a dense model. ``join_routing(layer, shards, sum)``
    (the family's function, named) tells that layer the number of context ranks and the
    in-place sum over them.
    """

    attention_core: str
    embedding_positions: str | None = None
    block_positions: str | None = None
    routed_layer: str | None = None
    join_routing: LazyFunction | None = None


@dataclass(frozen=True)
class ExpertWeight:
    """One grouped expert weight ``[experts, ...]`` of an experts module: its path and the dim
    of the expert's inner width, which the tensor axis splits."""

    path: str
    width_dim: int


# (rows sorted by expert, rows per expert, this rank's grouped weights in ExpertPlan order)
# -> each row through its expert
ExpertCompute = Callable[..., "torch.Tensor"]


class LazyFunction:
    """A function named ``"module:attr"``, imported on its first call: a plan names its
    family's torch functions (``ExpertPlan.layers``, ``.compute``) without importing them, so
    the registry entry holding the plan loads without torch."""

    def __init__(self, target: str):
        self.target = target
        self._function: Callable[..., Any] | None = None

    def resolve(self) -> Callable[..., Any]:
        if self._function is None:
            module, _, attr = self.target.partition(":")
            self._function = getattr(importlib.import_module(module), attr)
        return self._function

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyFunction({self.target!r})"


def lazy_attributes(package: str, module: str, names: tuple[str, ...]
                    ) -> Callable[[str], Any]:
    """A package's module-level ``__getattr__`` that imports ``names`` from ``module`` on first
    use: a family package re-exports its torch classes without importing torch itself."""
    def attribute(name: str) -> Any:
        if name not in names:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(module), name)

    return attribute


@dataclass(frozen=True)
class ExpertPlan:
    """Where the routed experts of a model are and how they compute.

    ``layers(block)`` lists a block's MoE layers. In a MoE layer, the module at ``routed`` is
    called as ``routed(tokens, token_index, expert_index)`` (rows ``tokens[token_index[i]]``
    through expert ``expert_index[i]``, in entry order); expert parallelism replaces it with one
    that holds this rank's experts, split as ``weights`` says. ``compute`` runs the experts on
    rows sorted by expert. ``dense`` is the tensor-parallel plan of the layer's dense sublayers
    (a shared expert), relative to the MoE layer (a path whose module is None is skipped); they
    act on every token, without sequence parallelism.
    """

    layers: Callable[[nn.Module], list[nn.Module]]
    routed: str
    weights: tuple[ExpertWeight, ...]
    compute: ExpertCompute
    dense: BlockPlan = field(default_factory=BlockPlan)
