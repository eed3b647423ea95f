"""MoE: GPT whose blocks route each token to top-k of E expert MLPs, one package: ``model.py``
(the router, the experts and the MoE layer, readable in one file), ``plans.py`` (where tensor
and expert parallelism split it) and ``family.py`` (its shape, which counts it, the rules of
routed models and its registry entry, ``model.kind: moe``). It has no Hugging Face counterpart."""

from typing import TYPE_CHECKING

from mcpar.models.moe.family import MOE_FAMILY, moe_layout_problems
from mcpar.models.moe.plans import MOE_EXPERTS, MOE_TENSOR_PARALLEL
from mcpar.models.plan import lazy_attributes

if TYPE_CHECKING:
    from mcpar.models.moe.model import (
        Experts,
        GroupedWeight,
        MoELayer,
        Router,
        build_moe,
        describe_expert_kernel,
        expert_kernel,
        expert_mlps,
        grouped_expert_mlps,
        loop_expert_mlps,
        moe_block,
        moe_layers,
        set_expert_kernel,
    )

__all__ = ["MOE_EXPERTS", "MOE_FAMILY", "MOE_TENSOR_PARALLEL", "Experts", "GroupedWeight",
           "MoELayer", "Router", "build_moe", "describe_expert_kernel", "expert_kernel",
           "expert_mlps", "grouped_expert_mlps", "loop_expert_mlps", "moe_block",
           "moe_layers", "moe_layout_problems", "set_expert_kernel"]


# The modules' classes and functions import torch: they load on first use, so that the family's
# registry entry (family.py, which ``mcpar check`` reads) loads without torch.
__getattr__ = lazy_attributes(__name__, "mcpar.models.moe.model", (
    "Experts", "GroupedWeight", "MoELayer", "Router", "build_moe", "describe_expert_kernel",
    "expert_kernel", "expert_mlps", "grouped_expert_mlps", "loop_expert_mlps", "moe_block",
    "moe_layers", "set_expert_kernel",
))
