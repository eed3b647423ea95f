"""Where tensor and expert parallelism find Llama's pieces (``model.py``; the vocabulary of
``mcpar.models.plan``), for the dense and the MoE form."""

from __future__ import annotations

from mcpar.models.plan import (
    BlockPlan,
    ColumnParallel,
    ContextParallelPlan,
    EmbeddingPlan,
    ExpertPlan,
    ExpertWeight,
    LazyFunction,
    OutputPlan,
    TensorParallelPlan,
)

# Context parallelism: the attention core, and the attention's rotary positions.
LLAMA_CONTEXT_PARALLEL = ContextParallelPlan(attention_core="attn.core", block_positions="attn")
# The MoE form's blocks also sum their routing statistics over the context ranks.
LLAMA_MOE_CONTEXT_PARALLEL = ContextParallelPlan(attention_core="attn.core",
                                                 block_positions="attn", routed_layer="mlp",
                                                 join_routing=LazyFunction(
                                                     "mcpar.models.moe.model:join_context_routing"))
LLAMA_ATTENTION_TENSOR_PARALLEL = BlockPlan(
    column=(ColumnParallel("attn.qkv"),),  # whole kv groups per rank (layout above)
    row=("attn.proj",),
    norms=("attn_norm", "mlp_norm"),
    heads=("attn.num_heads", "attn.num_kv_heads"),
)
_EMBEDDING = EmbeddingPlan(vocab="tok")  # no position table
_OUTPUT = OutputPlan(projection="out", norms=("norm",))
LLAMA_TENSOR_PARALLEL = TensorParallelPlan(
    embedding=_EMBEDDING,
    block=BlockPlan(
        column=(*LLAMA_ATTENTION_TENSOR_PARALLEL.column, ColumnParallel("mlp.gate_up", fused=2)),
        row=(*LLAMA_ATTENTION_TENSOR_PARALLEL.row, "mlp.down"),
        norms=LLAMA_ATTENTION_TENSOR_PARALLEL.norms,
        heads=LLAMA_ATTENTION_TENSOR_PARALLEL.heads,
    ),
    output=_OUTPUT,
)
# The MoE layer is split by the expert plan (each expert's width over tp, like a dense MLP).
LLAMA_MOE_TENSOR_PARALLEL = TensorParallelPlan(
    embedding=_EMBEDDING, block=LLAMA_ATTENTION_TENSOR_PARALLEL, output=_OUTPUT)
LLAMA_MOE_EXPERTS = ExpertPlan(
    # Named, not imported: the entry holding this plan loads without torch (`mcpar check`).
    layers=LazyFunction("mcpar.models.moe.model:moe_layers"),
    routed="experts",
    weights=(ExpertWeight("gate.weight", width_dim=2), ExpertWeight("up.weight", width_dim=2),
             ExpertWeight("down.weight", width_dim=1)),
    compute=LazyFunction("mcpar.models.llama.model:swiglu_experts"),
    dense=BlockPlan(column=(ColumnParallel("shared.gate_up", fused=2),), row=("shared.down",)),
)
