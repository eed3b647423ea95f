"""The contract of a model family entry (the built-ins: ``mcpar.models.gpt``, ``.moe``,
``.llama``), keyed by ``model.kind``.

An entry is the one place that knows its family: ``mcpar check``, ``mcpar simulate``, the
planner, the config and the runtime ask it and never test a kind. This half of the contract is
what the layers below the models need:

- what the family *is*, as attributes: ``moe`` (routed experts), ``grouped_query_attention``
  (``model.num_kv_heads`` may differ from ``num_heads``), ``rotary_positions`` (no position
  table; ``model.rope_base`` applies);
- ``default_ffn_size(cfg)``: the MLP width when ``model.ffn_hidden_size`` is unset;
- ``problems(cfg)`` and ``layout_problems(cfg, tp, ep, sequence_parallel)``: the rules of its
  keys, alone and against the parallel degrees (the generic rules stay in the config and in
  ``mcpar.plan``);
- ``shape(cfg)``: its ``ModelShape`` (``mcpar.registry.model_shape``), the count of parameters
  and FLOPs the cost model, the memory model and the planner read;
- ``num_params(cfg)``, ``stage_num_params(cfg, blocks, first, last, tp, ep)`` and
  ``flops_per_token(cfg)``: the exact counts of the built module without building it (plans of
  models too big for this machine, the memory estimate, the MFU), read off ``shape(cfg)``: the
  family is counted once, by its shape, and the tests hold that count to the built module.

The runtime half (``build``, the ``pieces``, tensor- and expert-parallel plans and the Hugging
Face name map) lives on the models' subclass,
``mcpar.models.spec.ModelSpec``, since the simulator below the models must price a family it
cannot build (as ``RuntimeCodec`` extends ``GradientCodec``).

``cfg`` is the config's ``model`` section (``mcpar.config.ModelConfig``, a layer above this one).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from mcpar.errors import problem
from mcpar.registry import Registry
from mcpar.registry.model_shape import ModelShape

# The config's model section (mcpar.config.ModelConfig), which this layer cannot import.
ModelSection = Any


class ModelFamily(ABC):
    """A model family. Subclasses set ``name`` and the attributes, and define ``shape``."""

    name: str = ""
    summary: str = ""  # one line for the docs
    moe: bool = False  # every block routes its tokens to experts (model.num_experts, top_k)
    grouped_query_attention: bool = False  # model.num_kv_heads key/value heads
    rotary_positions: bool = False  # rotary embeddings (model.rope_base), no position table

    def default_ffn_size(self, cfg: ModelSection) -> int:
        """The MLP's inner width when ``model.ffn_hidden_size`` is unset."""
        return 4 * cfg.hidden_size

    def problems(self, cfg: ModelSection) -> list[str]:
        """Rules between the model section's keys that belong to this family."""
        out = []
        if not self.grouped_query_attention and cfg.num_kv_heads is not None and \
                cfg.num_kv_heads != cfg.num_heads:
            kinds = " or ".join(f.name for f in MODEL_FAMILIES if f.grouped_query_attention)
            out.append(problem("model.num_kv_heads", f"model.kind {self.name!r} has full "
                               "multi-head attention; grouped-query attention needs kind "
                               f"{kinds} (or leave num_kv_heads unset)"))
        return out

    def layout_problems(self, cfg: ModelSection, tp: int, ep: int,
                        sequence_parallel: bool) -> list[str]:
        """Rules of this family against the tensor and expert degrees."""
        return []

    @abstractmethod
    def shape(self, cfg: ModelSection) -> ModelShape:
        """The model of ``cfg`` as the cost model and the memory model count it."""

    def num_params(self, cfg: ModelSection) -> int:
        """Parameters of the built module (a tied weight once)."""
        return round(self.shape(cfg).num_params())

    def stage_num_params(self, cfg: ModelSection, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
        """Parameters one rank holds for a pipeline stage of ``num_blocks`` blocks (plus the
        embedding on the first stage, the head on the last) at tensor degree ``tp`` and expert
        degree ``ep``."""
        return round(self.shape(cfg).stage_num_params(num_blocks, first, last, tp, ep))

    def flops_per_token(self, cfg: ModelSection) -> float:
        """Training FLOPs per token (3 x forward)."""
        return self.shape(cfg).flops_per_token()


MODEL_FAMILIES: Registry[ModelFamily] = Registry("model family", "model.kind")
