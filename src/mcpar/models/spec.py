"""The model spec: how a model family plugs into mcpar.

A spec says how to build the module from ``ModelConfig`` with a seeded init, how many parameters it
has (without building it, for plans of models too big for this machine) and how many FLOPs one
training token costs; and what parallelizing needs to know about the built module
(mcpar.models.plan): its ``pieces`` (embedding, blocks, head: where the pipeline cuts; the blocks
are also the per-layer modules), its ``tensor_parallel`` plan (which linears are column- or
row-parallel, which embedding and output projection are split over the vocabulary, which norms
are sequence-parallel, which head counts to divide) and its ``expert_parallel`` plan (where
the MoE layers and their experts are). ``mcpar.parallel`` follows those and names no model
attribute, so a new family plugs in here alone. ``model.kind`` picks the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mcpar.config import ModelConfig
from mcpar.models.gpt import (
    GPT,
    GPT_TENSOR_PARALLEL,
    gpt_flops_per_token,
    gpt_num_params,
    gpt_stage_num_params,
)
from mcpar.models.llama import (
    LLAMA_MOE_EXPERTS,
    LLAMA_MOE_TENSOR_PARALLEL,
    LLAMA_TENSOR_PARALLEL,
    Llama,
    build_llama,
    llama_flops_per_token,
    llama_num_params,
    llama_stage_num_params,
)
from mcpar.models.moe import (
    MOE_EXPERTS,
    MOE_TENSOR_PARALLEL,
    build_moe,
    moe_flops_per_token,
    moe_num_params,
    moe_stage_num_params,
)
from mcpar.models.plan import ExpertPlan, ModelPieces, TensorParallelPlan


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[ModelConfig, int], nn.Module]  # (config, seed) -> initialized module
    num_params: Callable[[ModelConfig], int]
    flops_per_token: Callable[[ModelConfig], float]
    # (config, blocks, holds embedding, holds head, tensor degree, expert degree) -> parameters
    # on one rank
    stage_num_params: Callable[[ModelConfig, int, bool, bool, int, int], int]
    # built module -> its embedding, blocks and head (and their names in it)
    pieces: Callable[[nn.Module], ModelPieces]
    tensor_parallel: TensorParallelPlan | None = None  # None: not tensor-parallel
    expert_parallel: ExpertPlan | None = None  # None: a dense model

    def blocks(self, model: nn.Module) -> list[nn.Module]:
        """The per-layer modules of a built model, in order."""
        return self.pieces(model).blocks


def _build_gpt(cfg: ModelConfig, seed: int) -> nn.Module:
    model = GPT(cfg)
    model.init_weights(seed)
    return model


MODEL_SPECS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", _build_gpt, gpt_num_params, gpt_flops_per_token,
                     gpt_stage_num_params, pieces=GPT.pieces,
                     tensor_parallel=GPT_TENSOR_PARALLEL),
    "moe": ModelSpec("moe", build_moe, moe_num_params, moe_flops_per_token,
                     moe_stage_num_params, pieces=GPT.pieces,
                     tensor_parallel=MOE_TENSOR_PARALLEL, expert_parallel=MOE_EXPERTS),
    # One file for both Llama forms: the MoE form differs in its blocks' MLP and in the plans.
    "llama": ModelSpec("llama", build_llama, llama_num_params, llama_flops_per_token,
                       llama_stage_num_params, pieces=Llama.pieces,
                       tensor_parallel=LLAMA_TENSOR_PARALLEL),
    "llama_moe": ModelSpec("llama_moe", build_llama, llama_num_params, llama_flops_per_token,
                           llama_stage_num_params, pieces=Llama.pieces,
                           tensor_parallel=LLAMA_MOE_TENSOR_PARALLEL,
                           expert_parallel=LLAMA_MOE_EXPERTS),
}


def get_model_spec(kind: str) -> ModelSpec:
    if kind not in MODEL_SPECS:
        raise KeyError(f"no model spec '{kind}'; known: {sorted(MODEL_SPECS)}")
    return MODEL_SPECS[kind]
