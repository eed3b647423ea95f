"""A pipeline stage: a contiguous run of the model's pieces (embedding -> blocks -> head).

``cut_model`` takes the full, initialized model and keeps the pieces of one stage, so that each
rank holds only its stage's parameters, whose values are exactly those of the single-process
model. Which modules the pieces are is the model's business: its spec's ``pieces`` (a
``ModelPieces``: embedding, blocks, head and the names they have in the model) says, so nothing
here names a model's attributes. A stage registers its pieces under the model's own names, so
its parameter names (and checkpoints) read like the model's, with blocks numbered from 0 within
the stage (``first_layer`` is the index of its first block in the model).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

# model -> (embedding, blocks, head, (their three names)): a spec's ``pieces``
PiecesFn = Callable[[nn.Module], Any]


class StageModule(nn.Module):
    def __init__(self, embedding: nn.Module | None, blocks: Sequence[nn.Module],
                 head: nn.Module | None, first_layer: int, names: Sequence[str]):
        super().__init__()
        self.piece_names = tuple(names)
        self.first_layer = first_layer  # index of the first block in the full model, for names
        embedding_name, blocks_name, head_name = self.piece_names
        self.add_module(embedding_name, embedding)
        self.add_module(blocks_name, nn.ModuleList(blocks))
        self.add_module(head_name, head)

    def pieces(self) -> tuple[nn.Module | None, list[nn.Module], nn.Module | None,
                              tuple[str, ...]]:
        """(embedding or None, blocks, head or None, names), the layout of ``ModelPieces``, so a
        stage is cut and sharded like a model."""
        embedding, blocks, head = (getattr(self, name) for name in self.piece_names)
        return embedding, list(blocks), head, self.piece_names

    @property
    def is_first(self) -> bool:
        return self.pieces()[0] is not None

    @property
    def is_last(self) -> bool:
        return self.pieces()[2] is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or activations -> activations, or logits (last stage)."""
        embedding, blocks, head, _ = self.pieces()
        if embedding is not None:
            x = embedding(x)
        for block in blocks:
            x = block(x)
        if head is not None:
            x = head(x)
        return x


def _own_pieces(model: nn.Module) -> Any:
    return model.pieces()


def cut_model(model: nn.Module, layer_ranges: list[tuple[int, int]], stage: int,
              pieces: PiecesFn | None = None) -> StageModule:
    """The StageModule of `stage`, given every stage's [start, end) range of blocks.

    ``pieces`` finds the model's pieces (the model spec's ``pieces``); without it, the model's
    own ``pieces()`` method (a model, or a StageModule, that knows them)."""
    embedding, blocks, head, names = (pieces or _own_pieces)(model)
    start, end = layer_ranges[stage]
    return StageModule(
        embedding=embedding if stage == 0 else None,
        blocks=list(blocks)[start:end],
        head=head if stage == len(layer_ranges) - 1 else None,
        first_layer=start,
        names=names,
    )


def whole_model(model: nn.Module, pieces: PiecesFn | None = None) -> StageModule:
    """The whole model as one stage (what tensor and expert parallelism shard)."""
    num_blocks = len((pieces or _own_pieces)(model)[1])
    return cut_model(model, [(0, num_blocks)], 0, pieces)
