"""Activation recompute: which activations the backward pass finds saved, and which it rebuilds.

``controllers.memory.activation_checkpointing`` names a policy, a registry entry
(``mcpar.registry.recompute``); the built-ins:
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
from typing import TYPE_CHECKING

from mcpar.registry.recompute import (
    RECOMPUTE_POLICIES,
    LayerActivations,
    LayerWork,
    RecomputeFacts,
    RecomputePolicy,
)

if TYPE_CHECKING:  # the policies' rules and terms are read without torch (`mcpar check`)
    import torch
    from torch import nn


class NoRecompute(RecomputePolicy):
    name = "none"
    summary = "every activation saved"

    def saved(self, acts: LayerActivations) -> tuple[float, float]:
        return acts.full, 0.0

    def recompute_seconds(self, work: LayerWork) -> float:
        return 0.0

    def targets(self, block: nn.Module) -> list[nn.Module]:
        return []


class SelectiveRecompute(RecomputePolicy):
    name = "selective"
    summary = "the attention core rebuilt (its s^2 scores in an unfused kernel)"

    def saved(self, acts: LayerActivations) -> tuple[float, float]:
        # The core's inputs (Q, K, V) and output (the projection's input) stay saved by their
        # neighbours; the re-forward rebuilds the output once more and the core's own.
        return acts.outside + acts.inside, acts.core_output + acts.core

    def recompute_seconds(self, work: LayerWork) -> float:
        # The s^2 scores (unfused) or, with flash, the kernel's forward, which keeps its output
        # for nothing else.
        return work.core

    def targets(self, block: nn.Module) -> list[nn.Module]:
        from mcpar.models.gpt.model import AttentionCore

        return [m for m in block.modules() if isinstance(m, AttentionCore)]


class FullRecompute(RecomputePolicy):
    name = "full"
    summary = "each block keeps its input and runs its forward again"
    tp_passes = 3  # forward, backward, forward again
    layer_overhead = 4 / 3

    def unsupported(self, facts: RecomputeFacts) -> list[str]:
        if facts.is_moe:
            return ["'full' would replay the MoE layers' routing (and its statistics) in the "
                    "backward pass, which this version does not support; use 'selective' (the "
                    "attention core) or 'none' with MoE models"]
        return []

    def saved(self, acts: LayerActivations) -> tuple[float, float]:
        # The block's input is kept; the re-forward rebuilds the rest of its set.
        return acts.block_input, acts.full - acts.block_input

    def recompute_seconds(self, work: LayerWork) -> float:
        return work.forward

    def targets(self, block: nn.Module) -> list[nn.Module]:
        return [block]


for _policy in (NoRecompute(), SelectiveRecompute(), FullRecompute()):
    RECOMPUTE_POLICIES.register(_policy)

# The memory measurement's probe of the re-forward's working set (``measure.py``): called with
# a recomputed module's forward and inputs after its checkpointed forward, at a measured step only.
_reforward_probe: Callable[[Callable[..., torch.Tensor], tuple], None] | None = None


def set_reforward_probe(probe: Callable[[Callable[..., torch.Tensor], tuple], None] | None,
                        ) -> None:
    global _reforward_probe
    _reforward_probe = probe


def _recompute_forward(module: nn.Module) -> None:
    import torch
    from torch.utils.checkpoint import checkpoint

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
    """Set the policy ``mode`` on these transformer blocks; how many modules now recompute."""
    policy = RECOMPUTE_POLICIES.get(mode)
    targets = [m for block in blocks for m in policy.targets(block)]
    for module in targets:
        _recompute_forward(module)
    return len(targets)


def apply_layer_recompute(chunks: list[nn.Module], layer_ranges: list[tuple[int, int]],
                          pp_rank: int, pp: int, modes: tuple[str, ...]) -> int:
    """Set each block of this rank's chunks to its mode (a chunk's blocks start at its
    ``first_layer`` in the model, wherever the schedule placed it); how many modules now
    recompute."""
    count = 0
    for chunk in chunks:
        start = chunk.first_layer  # type: ignore[attr-defined]
        for i, block in enumerate(chunk.pieces()[1]):  # type: ignore[operator]
            count += apply_recompute([block], modes[start + i])
    return count
