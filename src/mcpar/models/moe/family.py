"""The MoE model's registry entry (``model.kind: moe``): its shape (which the simulator prices
and from which the entry's parameter and FLOP counts are read), and the rules every MoE family
shares (``moe_layout_problems``, which the Llama MoE form uses too)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mcpar.config import ModelConfig
from mcpar.errors import problem
from mcpar.models.gpt.family import gpt_shape
from mcpar.models.moe.plans import MOE_CONTEXT_PARALLEL, MOE_EXPERTS, MOE_TENSOR_PARALLEL
from mcpar.models.plan import ModelPieces
from mcpar.models.spec import ModelSpec
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import ModelShape

if TYPE_CHECKING:  # the entry is read without torch (`mcpar check`); build and pieces import it
    from torch import nn


def moe_layout_problems(cfg: ModelConfig, ep: int, sequence_parallel: bool) -> list[str]:
    """A routed model against the expert degree and sequence parallelism."""
    problems = []
    if sequence_parallel:
        problems.append(problem(
            "parallelism.sequence_parallel",
            f"is not supported with model.kind {cfg.kind!r} (the router needs every token of the "
            "sequence on each tensor rank); set it to false",
        ))
    if cfg.num_experts % ep:
        problems.append(problem(
            "model.num_experts",
            f"{cfg.num_experts} experts are not divisible by parallelism.experts {ep}",
        ))
    if cfg.top_k > cfg.num_experts:
        problems.append(problem(
            "model.top_k",
            f"top_k {cfg.top_k} is larger than num_experts {cfg.num_experts}; use at "
            f"most {cfg.num_experts}",
        ))
    return problems


def routed_shape(shape: ModelShape, cfg: ModelConfig) -> ModelShape:
    """A dense family's shape with ``cfg``'s experts in every block (and its shared expert: a
    dense MLP of the family's own, biases and all)."""
    return replace(shape, experts=cfg.num_experts, top_k=cfg.top_k,
                   shared_expert=cfg.shared_expert)


class MoEFamily(ModelSpec):
    name = "moe"
    summary = "GPT whose blocks route each token to top-k of E GELU expert MLPs"
    moe = True
    tensor_parallel = MOE_TENSOR_PARALLEL
    expert_parallel = MOE_EXPERTS
    context_parallel = MOE_CONTEXT_PARALLEL

    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        from mcpar.models.moe.model import build_moe

        return build_moe(cfg, seed)

    def pieces(self, model: nn.Module) -> ModelPieces:
        from mcpar.models.gpt.model import GPT

        assert isinstance(model, GPT), type(model)
        return model.pieces()

    def layout_problems(self, cfg: ModelConfig, tp: int, ep: int,
                        sequence_parallel: bool) -> list[str]:
        return moe_layout_problems(cfg, ep, sequence_parallel)

    def shape(self, cfg: ModelConfig) -> ModelShape:
        return routed_shape(gpt_shape(cfg), cfg)


MOE_FAMILY = MODEL_FAMILIES.register(MoEFamily())
