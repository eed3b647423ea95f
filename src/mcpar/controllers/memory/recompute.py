"""Activation recompute: which activations the backward pass finds saved, and which it rebuilds.

``controllers.memory.activation_checkpointing``:
- ``full``: each transformer block keeps only its input; its forward runs again in the backward
  pass (one more forward per block, the least activation memory);
- ``selective``: only the attention core (``models.gpt.AttentionCore``: softmax(q k^T) v and its
  dropout, no parameters) is rebuilt, the part whose saved activations grow with the sequence
  squared in an unfused kernel (Korthikanti et al. 2022); its cost is a fraction of a block's;
- ``none``.

``controllers.memory.recompute_blocks`` ([none, selective, full] counts, which the placement to a
memory budget sets, ``placement.py``) mixes the modes per block: the first blocks of the model,
on the first pipeline rank, which keeps the most micro-batches in flight, recompute the most.

Mechanism: ``torch.utils.checkpoint`` (non-reentrant) around the module's own ``forward``, set on
the instance, so the module's hooks (ZeRO-3's gathers, for one) run once around it and are not
replayed, and the parameter names (checkpoints) do not change. The RNG state of each forward is
saved and restored for its replay, so dropout draws the same masks and the losses are equal.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from mcpar.models.gpt import AttentionCore

MODES = ("none", "selective", "full")

# The memory measurement's probe of the re-forward's working set (``measure.py``): called with
# a recomputed module's forward and inputs after its checkpointed forward, at a measured step only.
_reforward_probe: Callable[[Callable[..., torch.Tensor], tuple], None] | None = None


def set_reforward_probe(probe: Callable[[Callable[..., torch.Tensor], tuple], None] | None,
                        ) -> None:
    global _reforward_probe
    _reforward_probe = probe


def _recompute_forward(module: nn.Module) -> None:
    forward = module.forward

    def run(*args: torch.Tensor) -> torch.Tensor:
        if not torch.is_grad_enabled():  # evaluation: nothing to save, nothing to replay
            return forward(*args)
        out = checkpoint(forward, *args, use_reentrant=False)
        if _reforward_probe is not None:  # after: the inputs checkpoint keeps are counted then
            _reforward_probe(forward, args)
        return out

    module.forward = run  # type: ignore[method-assign]


def apply_recompute(blocks: Iterable[nn.Module], mode: str) -> int:
    """Set ``mode`` on these transformer blocks; how many modules now recompute."""
    targets: list[nn.Module] = []
    if mode == "full":
        targets = list(blocks)
    elif mode == "selective":
        targets = [m for block in blocks for m in block.modules() if isinstance(m, AttentionCore)]
    for module in targets:
        _recompute_forward(module)
    return len(targets)


def apply_layer_recompute(chunks: list[nn.Module], layer_ranges: list[tuple[int, int]],
                          pp_rank: int, pp: int, modes: tuple[str, ...]) -> int:
    """Set each block of this rank's chunks (chunk j is global stage pp_rank + j pp) to its
    mode; how many modules now recompute."""
    count = 0
    for j, chunk in enumerate(chunks):
        start = layer_ranges[pp_rank + j * pp][0]
        for i, block in enumerate(chunk.pieces()[1]):  # type: ignore[operator]
            count += apply_recompute([block], modes[start + i])
    return count
