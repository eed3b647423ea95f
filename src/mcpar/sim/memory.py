"""Memory per rank: mcpar's one memory model.

``mcpar check`` (``controllers.memory.estimate``, which the dynamic batch splitting also asks),
``mcpar simulate`` and ``mcpar plan`` all price memory here: an mcpar config reaches this module
through ``fromconfig``'s mapping, a published run or a plan through its ``ModelShape`` and
``Layout``. The per-rank memory is the job's (``MemoryBreakdown.per_rank``); a device adds its own
reserve (``Cluster.reserved_bytes``: CUDA context, NCCL and cuBLAS workspaces, fragmentation),
which the simulator counts against the GPU and the runtime leaves to its memory budget's headroom.

Parameters. The busiest pipeline rank's parameters, counted exactly (``ModelShape`` flags give
mcpar's biases, position table and tied head; tensor parallelism splits the matrices, the
column-parallel biases and the vocabulary, and replicates norms, row-parallel biases and the
router; expert weights are split over ep as well). Layers are placed by the layout's stage cut
(mcpar's cost-balanced cut for a config), not by pp alone.

Model states per parameter (Adam):
- 16-bit weight copies beside fp32 master weights (Megatron, DeepSpeed, the published runs):
  2 (weights) + 2 or 4 (gradients: fp16, where Megatron-2021 reduced fp16 gradients; fp32 under
  bf16, accumulated and reduced in fp32) + 12 (fp32 master weights and two moments);
- autocast (PyTorch AMP, mcpar's ``training.dtype: bfloat16``) and fp32: 4 + 4 + 8. mcpar keeps
  its parameters in fp32 and casts per op, so it has no 16-bit copy and no separate master copy:
  the old runtime estimate's 16 bytes were right for mcpar, the simulator's 18 for bf16 were not.
ZeRO shards the optimizer state (stage >= 1), the gradients (>= 2) and the weights (3) over the
data-parallel group (dp x cp; dp x cp / ep for expert weights, which ep ranks do not share). The
old runtime estimate divided expert state by all of dp, as if every data rank held every expert.

Activations per layer and micro-batch follow Korthikanti et al. (2022), generalized to GQA,
SwiGLU, MoE and the compute dtype, with X = b s h elements of the residual stream:
- outside tensor parallelism: two LayerNorm inputs (the residual stream: fp32 under autocast,
  16-bit otherwise), the attention and MLP inputs (16-bit) and two 1-byte dropout masks (none
  when the model has no dropout); divided by tp only under sequence parallelism;
- inside: Q, K, V (K and V at kv_heads/heads), the output projection's input, the MLP's ffn-wide
  tensors (2 for GELU/ReLU^2, 3 for SwiGLU; x top_k, + 1 for a shared expert, for MoE), / tp;
- the unfused kernel's scores: softmax output, dropout mask and dropout output (2 x 2 + 1 bytes
  per score; 2 without dropout), gone with flash attention or selective recompute.
At 16 bits this is the paper's s b h (34 + 5 a s / h) (34 / tp with sequence parallelism). The
old runtime estimate used that sum for every model: it doubled the 1-byte masks in fp32 (fp32
masks are still 1 byte), priced the s x s scores although mcpar's ``scaled_dot_product_attention``
never keeps them (flash / memory-efficient kernels), ignored the ffn width, MoE routing,
recompute and the fp32 residual stream of autocast, so the formula here replaced it.
Full recompute keeps only each layer's input, plus one layer's full set while it is recomputed.

In flight on the first pipeline rank (the one holding the most): 1F1B keeps min(pp, micro-batches)
micro-batches of its layers; the interleaved schedule (Narayanan et al. 2021) keeps
pp (1 + (pp - 1) / (pp vp)) of them; GPipe keeps all micro-batches (the old runtime estimate
used min(pp, micro-batches) for GPipe too). Its layers are the first rank's under the cut (the
old estimate took ceil(layers / pp), the simulator layers / pp). The last rank's fp32 logits and
their gradient (one micro-batch, vocabulary split by tp) count as activations.

The hierarchical parameter store adds its secondary copy to the parameters (P / k of the dense
parameters in the weights' dtype, k data ranks per node) and, with int8 gradient compression,
its fp32 error feedback on the 1/k shard to the gradients: both are held between steps.

Other: under ZeRO-3 the gathered layer, the prefetched one and the root parameters (embedding,
final norm, head: gathered at the start of each forward, freed after its backward); the
error-feedback buffers of 1-bit Adam and PowerSGD.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.sim.collectives import Group
from mcpar.sim.compute import ACT_BYTES
from mcpar.sim.hardware import RESERVED_BYTES
from mcpar.sim.workload import GATED_FFN, Layout, ModelShape, rank_layers, stage_blocks

__all__ = ["RESERVED_BYTES", "MemoryBreakdown", "format_bytes", "format_memory_rows",
           "memory_header", "memory_per_gpu", "params_per_rank", "rank_params", "state_bytes"]

# Row names of the memory every command prints (``mcpar check``, ``mcpar simulate``).
ROW_NAMES = ("parameters", "gradients", "optimizer state", "activations", "other")


@dataclass
class MemoryBreakdown:
    weights: float
    gradients: float
    optimizer: float
    activations: float  # kept for the backward pass, logits included
    other: float  # gathered ZeRO-3 layers, compression buffers
    reserved: float = 0.0  # the device's own (not the job's): see Cluster.reserved_bytes
    params: float = 0.0  # parameters the busiest rank holds (before ZeRO)

    @property
    def per_rank(self) -> float:
        """The job's memory on its busiest rank (what ``mcpar check`` reports)."""
        return self.weights + self.gradients + self.optimizer + self.activations + self.other

    @property
    def total(self) -> float:
        """What the device must hold: the job's memory and the device's reserve."""
        return self.per_rank + self.reserved

    def rows(self) -> list[tuple[str, int]]:
        """(name, bytes) rows in whole bytes, then ("total", their sum)."""
        values = [round(v) for v in (self.weights, self.gradients, self.optimizer,
                                     self.activations, self.other)]
        return list(zip(ROW_NAMES, values, strict=True)) + [("total", sum(values))]


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_memory_rows(rows: list[tuple[str, int]]) -> list[str]:
    """The memory rows as both commands print them: name, size, exact bytes."""
    return [f"  {name:<16} {format_bytes(value):>12} {value:>18,} B" for name, value in rows]


def memory_header(params: float) -> str:
    """The line above the rows (both commands)."""
    return f"per-rank memory estimate (largest rank, {round(params):,} parameters):"


def state_bytes(precision: str, autocast: bool = False) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter."""
    if precision == "fp32" or autocast:
        return 4.0, 4.0, 8.0
    return 2.0, (2.0 if precision == "fp16" else 4.0), 12.0


def rank_params(m: ModelShape, lay: Layout) -> list[tuple[float, float]]:
    """(dense, expert) parameters one GPU of each pipeline rank holds, before ZeRO. Stage s sits
    on rank s % pp; the first stage holds the embedding (and position table), the last the final
    norm and the head, which is the embedding itself when tied and one stage holds both."""
    split, replicated, expert = m.layer_param_split()
    t = lay.tp
    dense_layer = split / t + replicated
    expert_layer = expert / t / lay.ep
    sizes = stage_blocks(m, lay)
    dense = [0.0] * lay.pp
    experts = [0.0] * lay.pp
    for stage, n in enumerate(sizes):
        dense[stage % lay.pp] += n * dense_layer
        experts[stage % lay.pp] += n * expert_layer
    h, vocab = m.hidden, m.vocab * m.hidden / t
    dense[0] += vocab + (m.seq_len * h if m.learned_positions else 0)
    last = (len(sizes) - 1) % lay.pp
    dense[last] += 2 * h + (0 if m.tied_embeddings and len(sizes) == 1 else vocab)
    return list(zip(dense, experts, strict=True))


def params_per_rank(m: ModelShape, lay: Layout) -> tuple[float, float, float]:
    """(dense parameters on the busiest pipeline rank, expert parameters there, parameters of one
    layer on one GPU)."""
    dense, expert = max(rank_params(m, lay), key=lambda de: de[0] + de[1])
    split, replicated, layer_expert = m.layer_param_split()
    return dense, expert, split / lay.tp + replicated + layer_expert / lay.tp / lay.ep


def activation_bytes_per_layer(m: ModelShape, lay: Layout) -> tuple[float, float]:
    """(kept for backward, working set while recomputing) bytes of one layer, one micro-batch."""
    a = ACT_BYTES[lay.precision]
    resid = 4 if lay.autocast else a  # the residual stream (what the norms keep)
    masks = 1 if m.dropout else 0
    t = lay.tp
    sp = t if lay.seq_parallel else 1
    x = lay.micro_batch * m.seq_len / lay.cp * m.hidden  # residual-stream elements
    ratio_kv = m.kv_heads / m.heads
    outside = (2 * resid + 2 * a + 2 * masks) * x / sp
    ffn_tensors = 3 if m.ffn_kind in GATED_FFN else 2
    routed = (m.top_k + (1 if m.shared_expert else 0)) if m.is_moe else 1
    inside = a * x * (1 + 2 * ratio_kv + 1) / t + a * x * ffn_tensors * routed * m.ffn \
        / m.hidden / t
    scores = 0.0
    if lay.attention_kind == "unfused":
        per_score = a + (a + 1 if m.dropout else 0)
        scores = per_score * lay.micro_batch * m.heads / t * (m.seq_len / lay.cp) * m.seq_len
    full = outside + inside + scores
    if lay.recompute == "full":
        return resid * x / sp, full
    if lay.recompute == "selective":
        return outside + inside, scores
    return full, 0.0


def layers_in_flight(m: ModelShape, lay: Layout) -> float:
    """Layer-micro-batches of activations the first pipeline rank holds at its peak."""
    per_rank = rank_layers(m, lay)[0]
    mb = lay.num_microbatches
    if lay.pp == 1:
        return per_rank
    if lay.schedule == "gpipe":
        return per_rank * mb
    if lay.vp > 1:
        return min(per_rank * lay.pp * (1 + (lay.pp - 1) / (lay.pp * lay.vp)), per_rank * mb)
    return per_rank * min(lay.pp, mb)


def root_params(m: ModelShape, lay: Layout) -> float:
    """Parameters outside the transformer blocks (embedding, position table, final norm, head)
    on the pipeline rank holding the most of them."""
    h, vocab = m.hidden, m.vocab * m.hidden / lay.tp
    first = vocab + (m.seq_len * h if m.learned_positions else 0)
    last = 2 * h + (0 if m.tied_embeddings and lay.pp * lay.vp == 1 else vocab)
    return first + last if lay.pp == 1 else max(first, last)


def store_ranks_per_node(lay: Layout, gpus_per_node: int | None) -> int:
    """k, the data ranks of one node that share a block's secondary copy under the parameter
    store (1 when the node size is not known: a whole copy, the most it can cost)."""
    if not gpus_per_node:
        return 1
    # Data neighbours are tp ranks apart (mesh order: tp innermost), as the cost model places them.
    return Group(lay.dp * lay.cp, lay.tp).per_node(gpus_per_node)


def memory_per_gpu(m: ModelShape, lay: Layout, reserved: float = RESERVED_BYTES,
                   gpus_per_node: int | None = None) -> MemoryBreakdown:
    """Memory of the busiest rank of `lay` training `m`: the model states of the pipeline rank
    holding the most of them, the first rank's activations in flight, the last rank's logits,
    and `reserved` bytes of the device's own (0 for the job alone). `gpus_per_node` sizes the
    parameter store's secondary copy (see ``store_ranks_per_node``)."""
    w_b, g_b, o_b = state_bytes(lay.precision, lay.autocast)
    dp_group = lay.dp * lay.cp
    ep_group = max(1, dp_group // lay.ep)
    z = lay.zero_stage

    def sharded(count: float, per_param: float, stage: int, group: int) -> float:
        return count * per_param / (group if z >= stage else 1)

    def states(dense: float, expert: float) -> tuple[float, float, float]:
        return (sharded(dense, w_b, 3, dp_group) + sharded(expert, w_b, 3, ep_group),
                sharded(dense, g_b, 2, dp_group) + sharded(expert, g_b, 2, ep_group),
                sharded(dense, o_b, 1, dp_group) + sharded(expert, o_b, 1, ep_group))

    dense_rank, expert_rank = max(rank_params(m, lay), key=lambda de: sum(states(*de)))
    weights, grads, optim = states(dense_rank, expert_rank)

    kept, working = activation_bytes_per_layer(m, lay)
    tok = lay.micro_batch * m.seq_len / lay.cp
    logits = 2 * 4.0 * tok * m.vocab / lay.tp  # fp32 logits and their gradient (last rank)
    activations = kept * layers_in_flight(m, lay) + working + logits

    other = 0.0
    if z >= 3:
        # The gathered block and the prefetched one, and the root parameters, gathered at the
        # start of the forward and held until that micro-batch's backward is done.
        other += (2 * params_per_rank(m, lay)[2] + root_params(m, lay)) * w_b
        if lay.allocation == "topology_aware":
            # The store's secondary copy: a 1/k slice of every block, in the weights' dtype
            # (k = the node's data ranks), held between steps like the shards, so counted with
            # the parameters (as ``controllers/memory/held.py`` counts the tensors). Dense
            # parameters only: expert weights are gathered over their own replicas, uncached.
            k = store_ranks_per_node(lay, gpus_per_node)
            weights += dense_rank * w_b / k
            if lay.compression == "int8":
                # qgZ's error feedback: fp32 residuals of the 1/k shard each rank quantizes,
                # gradient state.
                grads += 4.0 * dense_rank / k
    if lay.compression == "1bit":
        other += 4.0 * (dense_rank + expert_rank) * (1 + 1 / dp_group)  # worker + server error
    elif lay.compression == "powersgd":
        other += 4.0 * (dense_rank + expert_rank)  # error feedback
    return MemoryBreakdown(weights, grads, optim, activations, other, reserved,
                           params=dense_rank + expert_rank)
