"""The model spec: how a model family plugs into mcpar.

A spec says how to build the module from ``ModelConfig`` with a seeded init, how many parameters it
has (without building it, for plans of models too big for this machine) and how many FLOPs one
training token costs. ``model.kind`` picks the spec.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from mcpar.config import ModelConfig
from mcpar.models.gpt import GPT, gpt_flops_per_token, gpt_num_params, gpt_stage_num_params
from mcpar.models.moe import build_moe, moe_flops_per_token, moe_num_params, moe_stage_num_params


@dataclass(frozen=True)
class ModelSpec:
    name: str
    build: Callable[[ModelConfig, int], nn.Module]  # (config, seed) -> initialized module
    num_params: Callable[[ModelConfig], int]
    flops_per_token: Callable[[ModelConfig], float]
    # (config, blocks, holds embedding, holds head, tensor degree, expert degree) -> parameters
    # on one rank
    stage_num_params: Callable[[ModelConfig, int, bool, bool, int, int], int]


def _build_gpt(cfg: ModelConfig, seed: int) -> nn.Module:
    model = GPT(cfg)
    model.init_weights(seed)
    return model


MODEL_SPECS: dict[str, ModelSpec] = {
    "gpt": ModelSpec("gpt", _build_gpt, gpt_num_params, gpt_flops_per_token,
                     gpt_stage_num_params),
    "moe": ModelSpec("moe", build_moe, moe_num_params, moe_flops_per_token,
                     moe_stage_num_params),
}


def get_model_spec(kind: str) -> ModelSpec:
    if kind not in MODEL_SPECS:
        raise KeyError(f"no model spec '{kind}'; known: {sorted(MODEL_SPECS)}")
    return MODEL_SPECS[kind]
