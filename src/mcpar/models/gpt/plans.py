"""Where tensor parallelism finds GPT's linears, embeddings and norms (paths inside each piece
of ``model.py``; the vocabulary of ``mcpar.models.plan``)."""

from __future__ import annotations

from mcpar.models.plan import (
    BlockPlan,
    ColumnParallel,
    ContextParallelPlan,
    EmbeddingPlan,
    OutputPlan,
    TensorParallelPlan,
)

# Where tensor parallelism finds the linears, embeddings and norms (paths inside each piece).
ATTENTION_TENSOR_PARALLEL = BlockPlan(
    column=(ColumnParallel("attn.qkv", fused=3),),  # q|k|v: each split by heads
    row=("attn.proj",),
    norms=("ln_attn", "ln_mlp"),
    heads=("attn.num_heads",),
)
# Context parallelism: the block's attention core, and the position table's lookup positions.
GPT_CONTEXT_PARALLEL = ContextParallelPlan(attention_core="attn.core", embedding_positions="")
GPT_TENSOR_PARALLEL = TensorParallelPlan(
    embedding=EmbeddingPlan(vocab="tok", positions="pos"),
    block=BlockPlan(
        column=(*ATTENTION_TENSOR_PARALLEL.column, ColumnParallel("mlp.fc")),
        row=(*ATTENTION_TENSOR_PARALLEL.row, "mlp.proj"),
        norms=ATTENTION_TENSOR_PARALLEL.norms,
        heads=ATTENTION_TENSOR_PARALLEL.heads,
    ),
    output=OutputPlan(projection="out", norms=("ln_final",)),
)
