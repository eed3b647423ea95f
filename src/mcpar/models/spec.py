"""The runtime half of a model family's registry entry (``ModelSpec``), and its lookup.

``mcpar.registry.model_family.ModelFamily`` says what the config, ``mcpar check`` and the
simulator need (attributes, rules, ``shape``); a ``ModelSpec`` adds what training needs:

- ``build(cfg, seed)``: the module, with a seeded init (every rank builds the same model);
- ``pieces(model)``: its embedding, blocks and head (where the pipeline cuts; the blocks are also
  the per-layer modules), ``tensor_parallel`` (which linears are column- or row-parallel, which
  embedding and output projection are split over the vocabulary, which norms are
  sequence-parallel, which head counts to divide) and ``expert_parallel`` (where the MoE layers
  and their experts are), in the vocabulary of ``mcpar.models.plan``. ``mcpar.parallel`` follows
  those and names no model attribute;
- ``num_params``, ``stage_num_params`` and ``flops_per_token`` it inherits: the exact counts of
  the built module, without building it, read off its ``shape`` (``ModelFamily``);
- ``hf``: its Hugging Face name map (``mcpar.models.hf.HFNames``), or None.

``model.kind`` names the entry in ``MODEL_FAMILIES``; ``get_model_spec(kind)`` returns it.
"""

from __future__ import annotations

from abc import abstractmethod
from typing import TYPE_CHECKING

from mcpar.config import ModelConfig
from mcpar.models.hf import HFNames
from mcpar.models.plan import ContextParallelPlan, ExpertPlan, ModelPieces, TensorParallelPlan
from mcpar.registry.model_family import MODEL_FAMILIES, ModelFamily

if TYPE_CHECKING:  # an entry is read without torch (`mcpar check`); its build imports it
    from torch import nn


class ModelSpec(ModelFamily):
    """A model family that mcpar can train. Subclasses define ``build``, ``pieces`` and
    ``shape`` (which gives the counts), and set the plans they support."""

    tensor_parallel: TensorParallelPlan | None = None  # None: not tensor-parallel
    expert_parallel: ExpertPlan | None = None  # None: a dense model
    context_parallel: ContextParallelPlan | None = None  # None: no context parallelism
    hf: HFNames | None = None  # None: no Hugging Face counterpart

    @abstractmethod
    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        """The initialized module."""

    @abstractmethod
    def pieces(self, model: nn.Module) -> ModelPieces:
        """A built module's embedding, blocks and head (and their names in it)."""

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The per-layer modules of a built model, in order."""
        return self.pieces(model).blocks


def get_model_spec(kind: str) -> ModelSpec:
    """The registered family ``kind`` (KeyError naming the registered ones if there is none,
    TypeError if the entry cannot be trained)."""
    family = MODEL_FAMILIES.get(kind)
    if not isinstance(family, ModelSpec):
        raise TypeError(f"model family {kind!r} has no module to train (not a ModelSpec)")
    return family
