"""The MoE model's registry entry (``model.kind: moe``): its counts without building it, its
shape for the simulator, and the rules every MoE family shares (``moe_layout_problems``, which
the Llama MoE form uses too)."""

from __future__ import annotations

from dataclasses import replace

from torch import nn

from mcpar.config import ModelConfig
from mcpar.errors import problem
from mcpar.models.gpt.family import (
    gpt_flops_per_token,
    gpt_num_params,
    gpt_shape,
    gpt_stage_num_params,
)
from mcpar.models.gpt.model import GPT
from mcpar.models.moe.model import build_moe
from mcpar.models.moe.plans import MOE_EXPERTS, MOE_TENSOR_PARALLEL
from mcpar.models.plan import ModelPieces
from mcpar.models.spec import ModelSpec
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import ModelShape


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
    """A dense family's shape with ``cfg``'s experts in every block."""
    return replace(shape, experts=cfg.num_experts, top_k=cfg.top_k,
                   shared_expert=cfg.shared_expert)


def _moe_block_params(cfg: ModelConfig, tp: int = 1, ep: int = 1) -> tuple[int, int]:
    """(params one rank holds per block that differ from the dense block's MLP, the dense
    MLP's) for removing the dense MLP from GPT's counts."""
    h, f, e = cfg.hidden_size, cfg.ffn_size, cfg.num_experts
    moe = h * e + (e // ep) * 2 * h * f // tp
    if cfg.shared_expert:
        moe += (h * f + f) // tp + f * h // tp + h
    dense = (h * f + f) // tp + f * h // tp + h
    return moe, dense


def moe_num_params(cfg: ModelConfig) -> int:
    moe, dense = _moe_block_params(cfg)
    return gpt_num_params(cfg) + cfg.num_layers * (moe - dense)


def moe_stage_num_params(cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
    """Parameters one rank holds for a stage: the experts are split over ``ep`` and their
    width over ``tp``; the router is replicated."""
    moe, _ = _moe_block_params(cfg, tp, ep)
    h, f = cfg.hidden_size, cfg.ffn_size
    dense_on_rank = (h * f + f) // tp + f * h // tp + h
    return gpt_stage_num_params(cfg, num_blocks, first, last, tp) + num_blocks * (
        moe - dense_on_rank)


def moe_flops_per_token(cfg: ModelConfig) -> float:
    """Training FLOPs per token (3 x forward): the router, top_k experts' MLPs and the shared
    expert instead of one dense MLP."""
    h, f = cfg.hidden_size, cfg.ffn_size
    dense_mlp = 2 * 2 * h * f
    routed = 2 * h * cfg.num_experts + cfg.top_k * 2 * 2 * h * f
    if cfg.shared_expert:
        routed += dense_mlp
    return gpt_flops_per_token(cfg) + 3.0 * cfg.num_layers * (routed - dense_mlp)


class MoEFamily(ModelSpec):
    name = "moe"
    summary = "GPT whose blocks route each token to top-k of E GELU expert MLPs"
    moe = True
    tensor_parallel = MOE_TENSOR_PARALLEL
    expert_parallel = MOE_EXPERTS

    def build(self, cfg: ModelConfig, seed: int) -> nn.Module:
        return build_moe(cfg, seed)

    def pieces(self, model: nn.Module) -> ModelPieces:
        assert isinstance(model, GPT), type(model)
        return model.pieces()

    def num_params(self, cfg: ModelConfig) -> int:
        return moe_num_params(cfg)

    def stage_num_params(self, cfg: ModelConfig, num_blocks: int, first: bool, last: bool,
                         tp: int = 1, ep: int = 1) -> int:
        return moe_stage_num_params(cfg, num_blocks, first, last, tp, ep)

    def flops_per_token(self, cfg: ModelConfig) -> float:
        return moe_flops_per_token(cfg)

    def layout_problems(self, cfg: ModelConfig, tp: int, ep: int,
                        sequence_parallel: bool) -> list[str]:
        return moe_layout_problems(cfg, ep, sequence_parallel)

    def shape(self, cfg: ModelConfig) -> ModelShape:
        return routed_shape(gpt_shape(cfg), cfg)


MOE_FAMILY = MODEL_FAMILIES.register(MoEFamily())
