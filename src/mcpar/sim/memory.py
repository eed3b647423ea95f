"""Memory per GPU: model states by ZeRO stage, activations by recompute mode, and buffers.

Model states per parameter (mixed precision with Adam, as in the ZeRO paper): 16-bit weights
(2 bytes), gradients (2 bytes under fp16, where Megatron-2021 reduced fp16 gradients; 4 bytes under
bf16, whose gradients are accumulated and reduced in fp32), and 12 bytes of fp32 master weights
and Adam moments. fp32 training: 4 + 4 + 8. ZeRO shards the optimizer state (stage >= 1), the
gradients (>= 2) and the weights (3) over the data-parallel group (dp x cp; dp x cp / ep for
expert weights).

Activations per layer and micro-batch follow Korthikanti et al. (2022), generalized to
grouped-query attention and SwiGLU: with X = b s h elements of the residual stream, a layer keeps
- outside tensor parallelism: two LayerNorm inputs, the attention and MLP inputs (16-bit) and two
  1-byte dropout masks; divided by tp only under sequence parallelism;
- inside: Q, K, V (K and V at kv_heads/heads), the output projection's input, the MLP's ffn-wide
  tensors (2 for GELU/ReLU^2, 3 for SwiGLU; x top_k for MoE), divided by tp;
- the unfused kernel's scores: softmax output, dropout mask and output (2 x 2 + 1 bytes per score),
  gone with flash attention or selective recompute.
Full recompute keeps only each layer's input, plus one layer's full set while it is recomputed.

In flight on the first pipeline rank: 1F1B holds min(pp, micro-batches) micro-batches of its
layers; the interleaved schedule (Narayanan et al. 2021) holds l (1 + (pp - 1) / (pp vp)) layers'
worth of one micro-batch; GPipe holds all micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.sim.compute import ACT_BYTES
from mcpar.sim.hardware import GIB
from mcpar.sim.workload import GATED_FFN, Layout, ModelShape

# CUDA context, NCCL and cuBLAS workspaces and allocator fragmentation, per GPU.
RESERVED_BYTES = 2.0 * GIB


@dataclass
class MemoryBreakdown:
    weights: float
    gradients: float
    optimizer: float
    activations: float
    other: float  # logits, gathered ZeRO-3 layers, compression buffers, reserve

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer + self.activations + self.other


def state_bytes(precision: str) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter."""
    if precision == "fp32":
        return 4.0, 4.0, 8.0
    return 2.0, (2.0 if precision == "fp16" else 4.0), 12.0


def params_per_rank(m: ModelShape, lay: Layout) -> tuple[float, float, float]:
    """(dense parameters on the busiest pipeline rank, expert parameters there, dense parameters
    of one layer on one GPU). Embedding and head (untied) sit on the first and last ranks and
    are split over the vocabulary by tp."""
    dense, expert = m.layer_params()
    t = lay.tp
    layers = m.layers / lay.pp
    per_layer_dense = dense / t
    vocab = m.vocab * m.hidden / t
    # The first rank holds the embedding, the last the head (same size); one rank holds both.
    ends = vocab * (2 if lay.pp == 1 else 1)
    dense_rank = layers * per_layer_dense + ends
    expert_rank = layers * expert / t / lay.ep
    return dense_rank, expert_rank, per_layer_dense + expert / t / lay.ep


def activation_bytes_per_layer(m: ModelShape, lay: Layout) -> tuple[float, float]:
    """(kept for backward, working set while recomputing) bytes of one layer, one micro-batch."""
    a = ACT_BYTES[lay.precision]
    t = lay.tp
    x = lay.micro_batch * m.seq_len / lay.cp * m.hidden  # residual-stream elements
    ratio_kv = m.kv_heads / m.heads
    outside = (4 * a + 2) * x / (t if lay.seq_parallel else 1)
    ffn_tensors = 3 if m.ffn_kind in GATED_FFN else 2
    routed = m.top_k if m.is_moe else 1
    inside = a * x * (1 + 2 * ratio_kv + 1) / t + a * x * ffn_tensors * routed * m.ffn \
        / m.hidden / t
    scores = 0.0
    if lay.attention_kind == "unfused":
        scores = (2 * a + 1) * lay.micro_batch * m.heads / t * (m.seq_len / lay.cp) * m.seq_len
    full = outside + inside + scores
    if lay.recompute == "full":
        return a * x / (t if lay.seq_parallel else 1), full
    if lay.recompute == "selective":
        return outside + inside, scores
    return full, 0.0


def layers_in_flight(m: ModelShape, lay: Layout) -> float:
    """Layer-micro-batches of activations the first pipeline rank holds at its peak."""
    per_rank = m.layers / lay.pp
    mb = lay.num_microbatches
    if lay.pp == 1:
        return per_rank
    if lay.schedule == "gpipe":
        return per_rank * mb
    if lay.vp > 1:
        return min(m.layers * (1 + (lay.pp - 1) / (lay.pp * lay.vp)), per_rank * mb)
    return per_rank * min(lay.pp, mb)


def memory_per_gpu(m: ModelShape, lay: Layout) -> MemoryBreakdown:
    dense_rank, expert_rank, layer_params = params_per_rank(m, lay)
    w_b, g_b, o_b = state_bytes(lay.precision)
    dp_group = lay.dp * lay.cp
    ep_group = max(1, dp_group // lay.ep)
    z = lay.zero_stage

    def sharded(count: float, per_param: float, stage: int, group: int) -> float:
        return count * per_param / (group if z >= stage else 1)

    weights = sharded(dense_rank, w_b, 3, dp_group) + sharded(expert_rank, w_b, 3, ep_group)
    grads = sharded(dense_rank, g_b, 2, dp_group) + sharded(expert_rank, g_b, 2, ep_group)
    optim = sharded(dense_rank, o_b, 1, dp_group) + sharded(expert_rank, o_b, 1, ep_group)

    kept, working = activation_bytes_per_layer(m, lay)
    activations = kept * layers_in_flight(m, lay) + working

    other = RESERVED_BYTES
    tok = lay.micro_batch * m.seq_len / lay.cp
    other += 2 * 4.0 * tok * m.vocab / lay.tp  # fp32 logits and their gradient (last rank)
    if z >= 3:
        other += 2 * layer_params * w_b  # the gathered layer and the one prefetched
    if lay.compression == "1bit":
        other += 4.0 * (dense_rank + expert_rank) * (1 + 1 / dp_group)  # worker + server error
    elif lay.compression == "powersgd":
        other += 4.0 * (dense_rank + expert_rank)  # error feedback
    return MemoryBreakdown(weights, grads, optim, activations, other)
