"""The contract of an activation recompute policy, a memory option (the built-ins: ``none``,
``selective``, ``full`` in ``controllers/memory/recompute.py``).

A policy says which activations of a transformer block the backward pass finds saved and which
it rebuilds: its rules (``problems``: refused everywhere; ``unsupported``: priced, but not
trained by this version), its memory term (``saved``: what one layer keeps and the working set
of its re-forward, from the layer's activation parts the memory model computes), its cost terms
(``recompute_seconds``, ``tp_passes``, ``layer_overhead``) and its build (``targets``: the
modules of a block whose forward reruns in the backward pass). ``mcpar check``, ``mcpar
train``, the memory estimate, the cost model and the planner all ask the entry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcpar.registry import Registry

if TYPE_CHECKING:  # the config validates recompute names through this registry without torch
    from torch import nn


@dataclass(frozen=True)
class RecomputeFacts:
    """What a policy's rules may look at."""

    is_moe: bool  # the model routes tokens to experts


@dataclass(frozen=True)
class LayerActivations:
    """One layer's saved activation bytes for one micro-batch, by part (the memory model's)."""

    block_input: float  # the residual stream entering the block
    outside: float  # norms, residual adds, dropout masks: everything beside attention and MLP
    attention: float  # Q, K, V, the core's output and the projections' inputs
    mlp: float  # the MLP's (or experts') inner tensors
    weight_copies: float  # autocast's 16-bit weight copies, saved by each matmul's backward
    core: float  # the attention core's own: scores (unfused, math) or log-sum-exp (flash)
    core_output: float  # the core's output, which its re-forward writes once more
    # Of ``attention``, what the core alone kept and no longer keeps because it saves copies of
    # its own (the math kernel's fp32 Q, K, V): unsaved when the core runs once, kept as the
    # recomputed core's inputs under selective recompute.
    core_replaces: float = 0.0

    @property
    def inside(self) -> float:
        return self.attention + self.mlp + self.weight_copies

    @property
    def full(self) -> float:
        return self.outside + self.inside + self.core - self.core_replaces


@dataclass(frozen=True)
class LayerWork:
    """One layer's forward seconds for one micro-batch, by part (the cost model's)."""

    forward: float  # the whole forward
    core: float  # the attention core's forward
    mlp: float  # the MLP's (or experts') matrix products


class RecomputePolicy(ABC):
    """One recompute policy; ``name`` is its ``controllers.memory.activation_checkpointing``."""

    name: str
    summary: str = ""
    tp_passes: int = 2  # passes whose tensor-parallel collectives run (a full re-forward: 3)
    layer_overhead: float = 1.0  # the per-layer fixed cost's factor (a full re-forward: 4/3)

    def problems(self, facts: RecomputeFacts) -> list[tuple[str, str]]:
        """(layout field, text) for each combination the policy cannot run with."""
        return []

    def unsupported(self, facts: RecomputeFacts) -> list[str]:
        """What this version cannot train with the policy (the cost model still prices it)."""
        return []

    @abstractmethod
    def saved(self, acts: LayerActivations) -> tuple[float, float]:
        """(bytes kept for the backward pass, working set while the layer is rebuilt)."""

    @abstractmethod
    def recompute_seconds(self, work: LayerWork) -> float:
        """The forward work the backward pass runs again."""

    @abstractmethod
    def targets(self, block: nn.Module) -> list[nn.Module]:
        """The modules of ``block`` whose forward reruns in the backward pass."""


RECOMPUTE_POLICIES: Registry[RecomputePolicy] = Registry(
    "recompute policy", "controllers.memory.activation_checkpointing")
