"""The contract of a family's Hugging Face name map (``ModelSpec.hf``): its architecture, its
config.json fields and its tensor names. ``mcpar.interop`` reads and writes Hugging Face
directories through it and names no family.

Parameters are passed by mcpar's names, as ``named_parameters`` of the built model lists them
(a tied head appears once, as the embedding); the head (``lm_head.weight`` <->
``head.out.weight``, absent when tied) is mapped by ``mcpar.interop`` for every family.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from mcpar.config import ModelConfig

if TYPE_CHECKING:  # `mcpar check` reads the name maps' entries without torch
    import torch

Tensors = dict[str, "torch.Tensor"]


class HFNames(ABC):
    architecture: str = ""  # config.json's "architectures"[0]
    embedding: str = ""  # the token embedding's Hugging Face name (a tied head reads it)
    # ``model`` keys of model_keys a run may set otherwise and still start from the directory
    # (``model.init_from``), its function unchanged.
    free_keys: tuple[str, ...] = ()

    def export_problems(self, cfg: ModelConfig, expert_bias: Tensors) -> list[str]:
        """Why this model cannot be written as its counterpart (empty: it can).
        ``expert_bias``: the routers' selection-bias buffers, by mcpar name."""
        return []

    @abstractmethod
    def config_json(self, cfg: ModelConfig) -> dict[str, Any]:
        """config.json's fields but the common ones (architectures, vocabulary, dtype, tying)."""

    @abstractmethod
    def model_keys(self, hf: dict[str, Any]) -> dict[str, Any]:
        """The mcpar ``model`` keys of a config.json of this architecture (``kind`` included)."""

    def notes(self, hf: dict[str, Any]) -> list[str]:
        """What mcpar computes a little differently from a config.json it still accepts."""
        return []

    def tensor_names(self, hf: Tensors) -> Tensors:
        """The tensors of a directory under the names ``from_hf`` reads (a saved base model
        without its head may have bare names)."""
        return hf

    @abstractmethod
    def to_hf(self, cfg: ModelConfig, params: Tensors) -> Tensors:
        """Hugging Face tensors from mcpar's full parameters (the head aside)."""

    @abstractmethod
    def from_hf(self, cfg: ModelConfig, hf: Tensors) -> Tensors:
        """mcpar's full parameters (the head aside) from Hugging Face tensors; KeyError naming
        the first Hugging Face key that is missing."""
