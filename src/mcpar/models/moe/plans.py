"""Where tensor and expert parallelism find the MoE model's pieces (``model.py``; the vocabulary
of ``mcpar.models.plan``)."""

from __future__ import annotations

from dataclasses import replace

from mcpar.models.gpt.plans import (
    ATTENTION_TENSOR_PARALLEL,
    GPT_CONTEXT_PARALLEL,
    GPT_TENSOR_PARALLEL,
)
from mcpar.models.plan import (
    BlockPlan,
    ColumnParallel,
    ContextParallelPlan,
    ExpertPlan,
    ExpertWeight,
    LazyFunction,
    TensorParallelPlan,
)

# Tensor parallelism shards GPT's attention, embedding and head; a block's MoE layer is split by
# the expert plan (each expert's width over the tensor axis, like a dense MLP's).
MOE_TENSOR_PARALLEL = TensorParallelPlan(
    embedding=GPT_TENSOR_PARALLEL.embedding,
    block=ATTENTION_TENSOR_PARALLEL,
    output=GPT_TENSOR_PARALLEL.output,
)
# Context parallelism: GPT's, with the block's MoE layer summing its routing statistics.
JOIN_ROUTING = LazyFunction("mcpar.models.moe.model:join_context_routing")
MOE_CONTEXT_PARALLEL: ContextParallelPlan = replace(GPT_CONTEXT_PARALLEL, routed_layer="mlp",
                                                    join_routing=JOIN_ROUTING)
MOE_EXPERTS = ExpertPlan(
    # Named, not imported: the entry holding this plan loads without torch (`mcpar check`).
    layers=LazyFunction("mcpar.models.moe.model:moe_layers"),
    routed="experts",
    weights=(ExpertWeight("fc.weight", width_dim=2), ExpertWeight("proj.weight", width_dim=1)),
    compute=LazyFunction("mcpar.models.moe.model:expert_mlps"),
    dense=BlockPlan(column=(ColumnParallel("shared.fc"),), row=("shared.proj",)),
)
