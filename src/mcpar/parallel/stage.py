"""A pipeline stage: a contiguous run of the model's pieces (embed -> blocks -> head).

``cut_model`` takes the full, initialized GPT and keeps the pieces of one stage, so that each rank
holds only its stage's parameters, whose values are exactly those of the single-process model.
A stage has the same attribute names as ``GPT`` (``embed``, ``blocks``, ``head``), so tensor
parallelism shards a stage and a whole model the same way.
"""

from __future__ import annotations

import torch
from torch import nn

from mcpar.models.gpt import GPT


class StageModule(nn.Module):
    def __init__(self, embed: nn.Module | None, blocks: list[nn.Module], head: nn.Module | None,
                 first_layer: int):
        super().__init__()
        self.embed = embed
        self.blocks = nn.ModuleList(blocks)
        self.head = head
        self.first_layer = first_layer  # index of blocks[0] in the full model, for names

    @property
    def is_first(self) -> bool:
        return self.embed is not None

    @property
    def is_last(self) -> bool:
        return self.head is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Token ids (first stage) or activations -> activations, or logits (last stage)."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.head(x)
        return x


def cut_model(model: GPT, layer_ranges: list[tuple[int, int]], stage: int) -> StageModule:
    """The StageModule of `stage`, given every stage's [start, end) range of blocks."""
    start, end = layer_ranges[stage]
    return StageModule(
        embed=model.embed if stage == 0 else None,
        blocks=list(model.blocks[start:end]),
        head=model.head if stage == len(layer_ranges) - 1 else None,
        first_layer=start,
    )
