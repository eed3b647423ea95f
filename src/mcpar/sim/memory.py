"""Memory per rank: mcpar's one memory model, which ``mcpar check`` (and dynamic batch
splitting), ``mcpar simulate`` and ``mcpar plan`` all price with. What it counts per category
(model states, activations, in-flight micro-batches, the parameter store, ZeRO-3's gathered
working set, error feedback) is docs/cost_model.md's "Memory per GPU"; what the doc leaves out:

The per-rank memory is the job's (``MemoryBreakdown.per_rank``); a device adds its own reserve
(``Cluster.reserved_bytes``: CUDA context, NCCL and cuBLAS workspaces, fragmentation), which the
simulator counts against the GPU and the runtime leaves to its memory budget's headroom. Layers
are placed by the layout's stage cut (mcpar's cost-balanced cut for a config), not by pp alone.

Model states: mcpar keeps its parameters in fp32 and casts per op, so under autocast it has no
16-bit copy and no separate master copy (4 + 4 + 8 bytes per parameter): the old runtime
estimate's 16 bytes were right for mcpar, the simulator's 18 for bf16 were not; and expert state
is sharded over dp x cp / ep, where the old runtime estimate divided it by all of dp.

Activations per layer and micro-batch (Korthikanti et al. 2022), with X = b s h elements of the
residual stream:
- outside tensor parallelism: two LayerNorm inputs (the residual stream: fp32 under autocast,
  16-bit otherwise), the attention and MLP inputs (16-bit) and two dropout masks (none when
  the model has no dropout; 1 byte on CUDA, the values' 16 or 32 bits on CPU); divided by tp
  only under sequence parallelism;
- inside: Q, K, V (K and V at kv_heads/heads), the output projection's input, the MLP's ffn-wide
  tensors (2 for GELU/ReLU^2, 3 for SwiGLU; x top_k, + 1 for a shared expert, for MoE), / tp;
- the unfused kernel's scores: softmax output, dropout mask and dropout output (2 x 2 + 1 bytes
  per score; 2 without dropout), gone with flash attention or selective recompute; CPU's math
  kernel under dropout keeps three fp32 score tensors and fp32 copies of Q, K, V in place of
  them (``device_kernels.py``); the embedding's dropout mask on the first stage.
At 16 bits this is the paper's s b h (34 + 5 a s / h) (34 / tp with sequence parallelism). The
old runtime estimate used that sum for every model (doubling the 1-byte masks in fp32, pricing
the s x s scores mcpar's ``scaled_dot_product_attention`` never keeps, ignoring the ffn width,
MoE routing, recompute and autocast's fp32 residual stream), so this formula replaced it; it
also used min(pp, micro-batches) in flight for GPipe and ceil(layers / pp) layers on the first
rank. Full recompute keeps only each layer's input, plus one layer's full set while it is
recomputed.

Gathered working set (ZeRO-3): the group of ``gather_span`` blocks prefetched behind the block
computing (one block when blocks are large), at most the chunk's blocks.

Communication buffers besides the error feedback: under ZeRO-2 the full-size bucket a released
gradient is copied into before its reduce-scatter (at most ``bucket_mb``, at most the rank's
gradients; stages 0-1 reduce the gradient buffer in place, nothing extra); under ZeRO-3 the
largest unit's full gradient (a block, or the root parameters) before the store reduces it; and
with optimizer offload the two streaming groups (one being updated, one moving), each at most
``offload_buffer_mb`` and at most the state itself; on a pipeline, the receives a rank keeps
posted ahead of their tasks (``posted_receive_bytes``: on CPU two per sending peer, each a
micro-batch's residual stream; none on CUDA, ``pipeline_receives_ahead``).

Offload (``Offload``): the optimizer state leaves the device; it is reported as an off-device row
(``MemoryBreakdown.offloaded``), not in the peak. Under fp32 the state moved is the two moments,
8 B per parameter, the weights and gradients stay fp32 on the device (4 + 4); under bf16 the
device keeps bf16 weights and gradients (2 + 2) and the fp32 master copy joins the moments off
the device (12 B), except under ZeRO, whose flat fp32 buffers are the master weights (4 + 4
stay, 8 move). ZeRO shards what is moved as it shards what stays.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from mcpar.device_kernels import (
    MATH_ATTENTION_BYTES,
    MATH_ATTENTION_SCORE_TENSORS,
    dropout_mask_bytes,
    pipeline_receives_ahead,
)
from mcpar.registry.codec import CODECS
from mcpar.registry.recompute import RECOMPUTE_POLICIES, LayerActivations
from mcpar.registry.schedule import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    PipelineSchedule,
    placed_stage,
    schedule_as_run,
    schedule_placement,
    stage_rank,
)
from mcpar.sim.collectives import Group
from mcpar.sim.compute import ACT_BYTES
from mcpar.sim.hardware import RESERVED_BYTES
from mcpar.sim.workload import GATED_FFN, Layout, ModelShape, rank_layers, stage_blocks

__all__ = ["OFF_DEVICE_ROW", "RESERVED_BYTES", "MemoryBreakdown", "Offload", "format_bytes",
           "format_memory_rows", "held_limits", "memory_header", "memory_per_gpu",
           "params_per_rank", "rank_params", "schedule_entry", "state_bytes"]

# Row names of the memory every command prints (``mcpar check``, ``mcpar simulate``).
ROW_NAMES = ("parameters", "gradients", "optimizer state", "activations",
             "communication buffers", "gathered working set")
# The off-device row (offload): printed after the total, not part of it.
OFF_DEVICE_ROW = "optimizer state off device"


@dataclass(frozen=True)
class Offload:
    """Optimizer state moved off the device (``controllers.memory.offload``): where ("cpu" or
    "nvme") and the bytes of one streaming group (``controllers.memory.offload_buffer_mb``)."""
    kind: str
    buffer_bytes: float


@dataclass
class MemoryBreakdown:
    weights: float
    gradients: float
    optimizer: float  # on the device (0 when offloaded)
    activations: float  # kept for the backward pass, logits included
    comm_buffers: float = 0.0  # error feedback, buckets in flight, offload streaming buffers
    gathered: float = 0.0  # ZeRO-3's gathered layers and root parameters
    reserved: float = 0.0  # the device's own (not the job's): see Cluster.reserved_bytes
    params: float = 0.0  # parameters the busiest rank holds (before ZeRO)
    offloaded: float = 0.0  # optimizer state held off the device (not in the peak)

    @property
    def other(self) -> float:
        """Everything but model states and activations (the old single row)."""
        return self.comm_buffers + self.gathered

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
                                     self.activations, self.comm_buffers, self.gathered)]
        return list(zip(ROW_NAMES, values, strict=True)) + [("total", sum(values))]

    def off_device_rows(self) -> list[tuple[str, int]]:
        """The offloaded state, printed below the total (empty without offload)."""
        return [(OFF_DEVICE_ROW, round(self.offloaded))] if self.offloaded else []


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def format_memory_rows(rows: list[tuple[str, int]]) -> list[str]:
    """The memory rows as both commands print them: name, size, exact bytes."""
    return [f"  {name:<26} {format_bytes(value):>12} {value:>18,} B" for name, value in rows]


def memory_header(params: float) -> str:
    """The line above the rows (both commands)."""
    return f"per-rank memory estimate (largest rank, {round(params):,} parameters):"


def state_bytes(precision: str, autocast: bool = False,
                offload: bool = False) -> tuple[float, float, float]:
    """(weight, gradient, optimizer) bytes per parameter; with ``offload`` the optimizer's are
    the bytes moved off the device (bf16: the device keeps 2 + 2, the fp32 master copy moves)."""
    if offload and precision != "fp32":
        return 2.0, 2.0, 12.0
    if precision == "fp32" or autocast:
        return 4.0, 4.0, 8.0
    return 2.0, (2.0 if precision == "fp16" else 4.0), 12.0


def rank_params(m: ModelShape, lay: Layout) -> list[tuple[float, float]]:
    """(dense, expert) parameters one GPU of each pipeline rank holds, before ZeRO. Stage s sits
    on rank s % pp; the first stage holds the embedding (and position table), the last the final
    norm and the head, which is the embedding itself when tied and one stage holds both (the
    shape's ``stage_params``, which the families' exact counts are too). A schedule that places
    stages otherwise (the V of ``zbv``) moves them with it (``registry.schedule.stage_rank``)."""
    t, ep = lay.tp, lay.ep
    placement = schedule_placement(lay.schedule)
    sizes = stage_blocks(m, lay)
    # One layer, then the ends: the count is linear in the blocks (the planner prices many
    # layouts, each of up to pp x vp stages).
    dense_layer, expert_layer = m.stage_params(1, False, False, t, ep)
    dense = [0.0] * lay.pp
    experts = [0.0] * lay.pp
    for stage, n in enumerate(sizes):
        dense[stage_rank(stage, lay.pp, placement)] += n * dense_layer
        experts[stage_rank(stage, lay.pp, placement)] += n * expert_layer
    if len(sizes) == 1:
        dense[0] += m.stage_params(0, True, True, t, ep)[0]
    else:
        dense[0] += m.stage_params(0, True, False, t, ep)[0]
        dense[stage_rank(len(sizes) - 1, lay.pp, placement)] += m.stage_params(
            0, False, True, t, ep)[0]
    return list(zip(dense, experts, strict=True))


def params_per_rank(m: ModelShape, lay: Layout) -> tuple[float, float, float]:
    """(dense parameters on the busiest pipeline rank, expert parameters there, parameters of one
    layer on one GPU)."""
    dense, expert = max(rank_params(m, lay), key=lambda de: de[0] + de[1])
    split, replicated, layer_expert = m.layer_param_split()
    return dense, expert, split / lay.tp + replicated + layer_expert / lay.tp / lay.ep


def activation_bytes_per_layer(m: ModelShape, lay: Layout,
                               weights16: bool = False) -> tuple[float, float]:
    """(kept for backward, working set while recomputing) bytes of one layer, one micro-batch.
    `weights16`: autocast over 16-bit weights (bf16 with offload, whose fp32 masters are off the
    device): the residual stream is 16-bit and no weight copies are made."""
    a = ACT_BYTES[lay.precision]
    resid = 4 if lay.autocast and not weights16 else a  # the residual stream (the norms keep)
    # Dropout keeps a mask over each value it drops (the block's two, on the sublayers' a-byte
    # outputs): 1 byte on CUDA, the values' own bytes on CPU (``device_kernels.py``).
    masks = dropout_mask_bytes(lay.device, a) if m.dropout else 0
    t = lay.tp
    sp = t if lay.seq_parallel else 1
    tokens = lay.micro_batch * m.seq_len / lay.cp
    x = tokens * m.hidden  # residual-stream elements
    ratio_kv = m.kv_heads / m.heads
    # Two norms: their fp32 statistics per token (LayerNorm's mean and 1/std; RMSNorm's 1/rms),
    # and mcpar's RMSNorm, written out in fp32, also keeps its normalized fp32 tensor.
    mcpar_rmsnorm = lay.autocast and m.ffn_kind in GATED_FFN
    norms = 2 * tokens * (4 if mcpar_rmsnorm else 8) + (2 * 4 * x if mcpar_rmsnorm else 0)
    outside = ((2 * resid + 2 * a + 2 * masks) * x + norms) / sp
    ffn_tensors = 3 if m.ffn_kind in GATED_FFN else 2
    # mcpar's SwiGLU keeps the SiLU's output beside its inputs and product (fused kernels
    # recompute it), and its rotary embedding keeps a rotated copy of Q and K.
    ffn_tensors += 1 if mcpar_rmsnorm else 0
    rotary = 1 + ratio_kv if lay.autocast and not m.learned_positions else 0
    routed = (m.top_k + (1 if m.shared_expert else 0)) if m.is_moe else 1
    attention = a * x * (1 + 2 * ratio_kv + 1 + rotary) / t
    mlp = a * x * ffn_tensors * routed * m.ffn / m.hidden / t
    copies = 0.0
    if lay.autocast and lay.precision != "fp32" and not weights16:
        # Autocast's 16-bit copies of the layer's weights, saved by each matmul's backward.
        split, _, expert = m.layer_param_split()
        copies = a * (split / t + expert / t / lay.ep)
    scores = lay.micro_batch * m.heads / t * (m.seq_len / lay.cp) * m.seq_len
    replaced = 0.0
    if lay.attention_kind == "unfused":
        core = (a + (a + 1 if m.dropout else 0)) * scores
    elif lay.attention_kind == "math":
        # Its fp32 scores, and fp32 copies of Q, K and V in place of Q, K and V themselves
        # (which only the core kept: ``attention`` counts them).
        qkv = x * (1 + 2 * ratio_kv) / t
        core = (MATH_ATTENTION_SCORE_TENSORS * scores + qkv) * MATH_ATTENTION_BYTES
        replaced = a * qkv
    else:  # the flash kernel's fp32 log-sum-exp per query and head
        core = 4 * lay.micro_batch * m.heads / t * m.seq_len / lay.cp
    core += context_core_bytes(lay, a, x / t)
    # The recompute policy's entry says what of the layer's set stays saved.
    return RECOMPUTE_POLICIES.get(lay.recompute).saved(LayerActivations(
        block_input=resid * x / sp, outside=outside, attention=attention, mlp=mlp,
        weight_copies=copies, core=core, core_output=a * x / t, core_replaces=replaced))


def context_core_bytes(lay: Layout, a: float, local: float) -> float:
    """What mcpar's ring keeps beyond the flash kernel's log-sum-exp (which it keeps too), per
    layer and micro-batch; ``local``: elements of one [tokens, heads / tp, head_dim] tensor.
    The ring saves its fp32 output (the merge's accumulator); under 16-bit inputs the copy it
    returns is the core's output, a second tensor. Ulysses' local kernel keeps what it keeps
    without context parallelism (measured: the same saved bytes as the ring's at fp32)."""
    if lay.cp == 1 or lay.context_mode != "ring" or a >= 4:
        return 0.0
    return 4 * local


def context_workspace_bytes(m: ModelShape, lay: Layout) -> float:
    """The largest working set of one layer's context attention, beside what the layers keep:
    the ring's backward at its own block (step 0): that block's fp32 scores, probabilities, and
    the gradients of both (2c x 2c per head), the fp32 dK/dV accumulator and the one arriving,
    the stacked K/V and the block arriving, and fp32 Q, dO and dQ. Ulysses' backward: the
    all-to-all's input and output of dQ, dK and dV. Nothing without context parallelism."""
    if lay.cp == 1 or lay.context_mode == "flash_ring":
        return 0.0
    a = ACT_BYTES[lay.precision]
    local = lay.micro_batch * m.seq_len / lay.cp * m.hidden / lay.tp
    if lay.context_mode == "ulysses":
        return 6 * a * local
    own_block = lay.micro_batch * m.heads / lay.tp * (m.seq_len / lay.cp) ** 2
    return 4 * 4 * own_block + 2 * 2 * 4 * local + 2 * 2 * a * local + 3 * 4 * local


def layers_in_flight(m: ModelShape, lay: Layout, rank: int = 0,
                     entry: PipelineSchedule | None = None) -> float:
    """Layer-micro-batches of activations pipeline rank `rank` holds at its peak: its layers
    times the schedule's ``in_flight`` for that rank (1F1B: min(pp - r, micro-batches); the
    others counted from each rank's own order, a split schedule's until W). ``entry``: the
    schedule as it runs (``schedule_entry``; the layout's, unbounded, where None)."""
    per_rank = rank_layers(m, lay)[rank]
    mb = lay.num_microbatches
    if lay.pp == 1:
        return per_rank
    entry = entry or SCHEDULES.get(lay.schedule)
    return per_rank * entry.in_flight(lay.pp, rank, mb, lay.vp)


def head_activation_bytes(m: ModelShape, lay: Layout, weights16: bool = False,
                          held: int = 1) -> float:
    """What the last stage keeps beyond its blocks for ``held`` micro-batches whose backward
    has not run (the schedule's ``head_in_flight``: 1 but for GPipe): per micro-batch the final
    norm's input and statistics, the head's input (and, under autocast, its 16-bit weight
    copy), and the loss's fp32 log-probabilities; and once, at the backward's start, the
    gradient arriving at the log-softmax and the one it returns, all three the logits' size
    (vocabulary split by tp)."""
    a = ACT_BYTES[lay.precision]
    resid = 4 if lay.autocast and not weights16 else a
    tokens = lay.micro_batch * m.seq_len / lay.cp
    sp = lay.tp if lay.seq_parallel else 1
    head = (resid * m.hidden + 8) * tokens / sp + a * tokens * m.hidden
    if lay.autocast and lay.precision != "fp32" and not weights16:
        head += a * m.vocab * m.hidden / lay.tp
    logits = 4.0 * tokens * m.vocab / lay.tp
    return held * (head + logits) + 2 * logits


def embedding_activation_bytes(m: ModelShape, lay: Layout, weights16: bool = False) -> float:
    """What the first stage keeps for one micro-batch before its blocks: the lookups' int64
    indices, which each embedding's backward keeps (the token ids, and a learned position
    table's position ids, one row per micro-batch), and the mask of the embedding's dropout
    (over the embedding's output, in the weights' dtype), none without dropout."""
    tokens = lay.micro_batch * m.seq_len / lay.cp
    indices = 8 * (tokens + (m.seq_len / lay.cp if m.learned_positions else 0))
    if not m.dropout:
        return indices
    resid = 4 if lay.autocast and not weights16 else ACT_BYTES[lay.precision]
    sp = lay.tp if lay.seq_parallel else 1
    return indices + dropout_mask_bytes(lay.device, resid) * tokens * m.hidden / sp


def received_gradient_bytes(m: ModelShape, lay: Layout, weights16: bool = False) -> float:
    """The gradient a pipeline stage's backward receives from the next stage (the residual
    stream's size and dtype, split by tp under sequence parallelism), held while that backward
    runs: at the peak of a rank without the head (its first backward starts beside every
    activation in flight), where the meter counts it too."""
    resid = 4 if lay.autocast and not weights16 else ACT_BYTES[lay.precision]
    sp = lay.tp if lay.seq_parallel else 1
    return resid * lay.micro_batch * m.seq_len / lay.cp * m.hidden / sp


def sending_peers(lay: Layout, pp_rank: int) -> int:
    """The pipeline ranks that send ``pp_rank`` activations or gradients: the ranks of its
    stages' neighbours, other than itself (2 inside a pipeline of 3 or more; 1 at the ends of a
    one-chunk pipeline or of a V, and on either rank of 2)."""
    placement = schedule_placement(lay.schedule)
    last = lay.pp * lay.vp - 1
    stages = [placed_stage(c, pp_rank, lay.pp, placement) for c in range(lay.vp)]
    return len({stage_rank(n, lay.pp, placement) for s in stages for n in (s - 1, s + 1)
                if 0 <= n <= last} - {pp_rank})


def posted_receive_bytes(m: ModelShape, lay: Layout, pp_rank: int,
                         weights16: bool = False) -> float:
    """Receive buffers pipeline rank ``pp_rank`` keeps posted ahead of their tasks
    (``pipeline_receives_ahead`` per sending peer on the layout's device), each one
    micro-batch's residual stream, as the messages are."""
    if lay.pp == 1:
        return 0.0
    return (pipeline_receives_ahead(lay.device) * sending_peers(lay, pp_rank)
            * received_gradient_bytes(m, lay, weights16))


def rank_activations(m: ModelShape, lay: Layout, modes: tuple[str, ...] | None = None,
                     weights16: bool = False) -> list[float]:
    """Activation bytes of each pipeline rank at its peak: its layers in flight, one layer's
    re-forward working set (the largest among its layers), and on the rank holding the last
    stage, its head and loss. `modes`: each layer's recompute (global order; None: the
    layout's for every layer). The schedule runs as ``schedule_entry`` bounds it."""
    entry = schedule_entry(m, lay, modes)
    return [per_held * held + fixed for per_held, held, fixed
            in _rank_activation_terms(m, lay, modes, weights16, entry)]


def schedule_entry(m: ModelShape, lay: Layout,
                   modes: tuple[str, ...] | None = None) -> PipelineSchedule:
    """The layout's pipeline schedule as it runs (``schedule_as_run``, the one rule the
    runtime's order, the memory estimate and the cost model's replay share): its orders for
    overlapping steps where they overlap, a split schedule that takes held limits bounded to
    ``held_limits``."""
    return schedule_as_run(lay.schedule, held_limits(m, lay, modes), lay.overlapped_steps)


@functools.lru_cache(maxsize=1024)
def held_limits(m: ModelShape, lay: Layout,
                modes: tuple[str, ...] | None = None) -> tuple[int, ...] | None:
    """The most chunk activations each pipeline rank may hold (counted until W) so that no
    rank's activations pass the largest rank's under 1F1B with the same micro-batches: the
    zero-bubble schedules' memory is 1F1B's (Qi et al.), but a split schedule's order holds W's
    inputs where 1F1B idles, and the rank with the head (ZB-H1's last, ZBV's first) holds them
    beside the head's activations. None where the unbounded order stays within that peak, or
    the schedule takes no limit (then it runs unbounded)."""
    entry = SCHEDULES.get(lay.schedule)
    if lay.pp == 1 or not entry.takes_held_limits:
        return None
    terms = _rank_activation_terms(m, lay, modes, False, entry)
    plain = lay.with_(schedule=DEFAULT_SCHEDULE, vp=1)
    bound = max(per_held * held + fixed for per_held, held, fixed
                in _rank_activation_terms(m, plain, modes, False, SCHEDULES.get(
                    DEFAULT_SCHEDULE)))
    if max(per_held * held + fixed for per_held, held, fixed in terms) <= bound:
        return None
    # One chunk activation of rank r is its layers' per micro-batch over its chunks. A rank
    # within the bound keeps what its unbounded order holds: the same limits for layouts that
    # differ only in bytes, so the orders built for them are built once.
    return tuple(min(round(held * lay.vp), max(1, int((bound - fixed) / (per_held / lay.vp))))
                 if per_held > 0 else round(held * lay.vp) for per_held, held, fixed in terms)


def _rank_activation_terms(m: ModelShape, lay: Layout, modes: tuple[str, ...] | None,
                           weights16: bool, entry: PipelineSchedule
                           ) -> list[tuple[float, float, float]]:
    """Per pipeline rank (bytes per micro-batch held, micro-batches held at its peak under
    ``entry``, bytes held once: the re-forward working set, the head and loss)."""
    sizes = stage_blocks(m, lay)
    modes = modes or (lay.recompute,) * sum(sizes)
    per_mode = {mode: activation_bytes_per_layer(m, lay.with_(recompute=mode), weights16)
                for mode in set(modes)}
    rank_modes: list[list[str]] = [[] for _ in range(lay.pp)]
    placement = schedule_placement(lay.schedule)
    last_rank = stage_rank(len(sizes) - 1, lay.pp, placement)
    start = 0
    for stage, n in enumerate(sizes):
        rank_modes[stage_rank(stage, lay.pp, placement)] += modes[start:start + n]
        start += n
    head_held = (entry.head_in_flight(lay.pp, lay.num_microbatches, lay.vp)
                 if lay.pp > 1 else 1)
    head = head_activation_bytes(m, lay, weights16, head_held)
    received = received_gradient_bytes(m, lay, weights16) if lay.pp > 1 else 0.0
    out = []
    for r, held in enumerate(rank_modes):
        # Micro-batches in flight per layer of this rank (layers are alike).
        flight = layers_in_flight(m, lay, r, entry) / len(held) if held else 0.0
        per_micro = (sum(per_mode[mode][0] for mode in held)
                     + (embedding_activation_bytes(m, lay, weights16) if r == 0 else 0.0))
        working = max(max((per_mode[mode][1] for mode in held), default=0.0),
                      context_workspace_bytes(m, lay) if held else 0.0)
        # The head's loss transients and a received gradient are alive at different moments
        # (the last stage's backward receives none): the rank with the head peaks at the larger.
        out.append((per_micro, flight, working
                    + (max(head, received) if r == last_rank else received)))
    return out


def root_params(m: ModelShape, lay: Layout) -> float:
    """Parameters outside the transformer blocks (embedding, position table, final norm, head)
    on the pipeline rank holding the most of them (both ends on one rank without a pipeline,
    and under a V placement, whose first rank holds the first and the last stage)."""
    h, vocab = m.hidden, m.vocab * m.hidden / lay.tp
    first = vocab + (m.seq_len * h if m.learned_positions else 0)
    last = 2 * h + (0 if m.tied_embeddings and lay.pp * lay.vp == 1 else vocab)
    together = lay.pp == 1 or schedule_placement(lay.schedule) == "v"
    return first + last if together else max(first, last)


def gather_span(block_bytes: float, gather_mb: float, blocks: int) -> int:
    """ZeRO-3's blocks per parameter gather (``controllers.memory.gather_mb``): the fewest
    consecutive blocks holding ``gather_mb`` MiB, at most ``blocks``; 1 when it is 0. The
    parameter store gathers so and the cost model prices it: one rule."""
    if gather_mb <= 0 or block_bytes <= 0:
        return 1
    return max(1, min(blocks, math.ceil(gather_mb * 2**20 / block_bytes)))


def chunk_blocks(m: ModelShape, lay: Layout) -> int:
    """The blocks of one model chunk (a pipeline rank holds ``vp`` of them): what ZeRO-3's
    gather groups are cut from."""
    return max(1, round(m.layers / lay.pp / lay.vp))


def store_ranks_per_node(lay: Layout, gpus_per_node: int | None) -> int:
    """k, the data ranks of one node that share a block's secondary copy under the parameter
    store (1 when the node size is not known: a whole copy, the most it can cost)."""
    if not gpus_per_node:
        return 1
    # Data neighbours are tp ranks apart (mesh order: tp innermost), as the cost model places them.
    return Group(lay.dp * lay.cp, lay.tp).per_node(gpus_per_node)


def memory_per_gpu(m: ModelShape, lay: Layout, reserved: float = RESERVED_BYTES,
                   gpus_per_node: int | None = None, offload: Offload | None = None,
                   layer_recompute: tuple[str, ...] | None = None) -> MemoryBreakdown:
    """Memory of the busiest rank of `lay` training `m`: the model states of the pipeline rank
    holding the most of them, the first rank's activations in flight, the last rank's logits,
    and `reserved` bytes of the device's own (0 for the job alone). `gpus_per_node` sizes the
    parameter store's secondary copy (see ``store_ranks_per_node``); `offload` moves the
    optimizer state off the device; `layer_recompute`: each layer's recompute mode, when they
    differ (the MemoryController's placement)."""
    # Under ZeRO the optimizer's pieces are views of fp32 flat buffers: the weights stay fp32
    # and are the master copy, so offload moves only the moments, as under fp32.
    w_b, g_b, o_b = state_bytes(lay.precision, lay.autocast,
                                offload is not None and lay.zero_stage == 0)
    dp_group = lay.dp * lay.cp
    ep_group = max(1, dp_group // lay.ep)
    z = lay.zero_stage
    codec = CODECS.get(lay.compression)

    def sharded(count: float, per_param: float, stage: int, group: int) -> float:
        return count * per_param / (group if z >= stage else 1)

    def states(dense: float, expert: float) -> tuple[float, float, float]:
        return (sharded(dense, w_b, 3, dp_group) + sharded(expert, w_b, 3, ep_group),
                sharded(dense, g_b, 2, dp_group) + sharded(expert, g_b, 2, ep_group),
                sharded(dense, o_b, 1, dp_group) + sharded(expert, o_b, 1, ep_group))

    # The busiest pipeline rank: the most model states and activations together.
    weights16 = lay.autocast and w_b == 2  # bf16 offload: the model holds bf16 copies
    acts = rank_activations(m, lay, layer_recompute, weights16)
    params = rank_params(m, lay)
    busiest = max(range(lay.pp), key=lambda r: sum(states(*params[r])) + acts[r])
    dense_rank, expert_rank = params[busiest]
    weights, grads, optim = states(dense_rank, expert_rank)
    activations = acts[busiest]
    if lay.post_validation:
        # The step's weights, gradients and optimizer state, copied before each early update to
        # redo a step guessed wrong (``mcpar.post_validation``) and held into the next step:
        # counted with the optimizer state, as the trainer measures it.
        optim += weights + grads + optim

    gathered = comm = offloaded = 0.0
    if offload is not None:
        offloaded, optim = optim, 0.0
        comm += 2 * min(offload.buffer_bytes, offloaded)  # two streaming groups
    # ZeRO 2/3 reducing once per step (a split schedule, several chunks per rank): the step
    # accumulates the whole gradient before its buckets are reduce-scattered.
    once_per_step = z >= 2 and not lay.reduces_every_backward
    if once_per_step:
        comm += (dense_rank + expert_rank) * g_b
    elif z == 2 and lay.bucket_mb:
        comm += min(lay.bucket_mb * 2**20, grads * dp_group)  # one full bucket in flight
    if z >= 3:
        layer = params_per_rank(m, lay)[2]
        # The gathered block and the group prefetched behind it, and the root parameters,
        # gathered at the start of the forward and held until that micro-batch's backward;
        # with several chunks per rank, each chunk's last group is kept from its forward into
        # its backward, and a micro-batch's chunks are in flight together.
        blocks = chunk_blocks(m, lay)
        span = gather_span(layer * w_b, lay.gather_mb, blocks)
        gathered += (lay.vp * min(1 + span, blocks) * layer + root_params(m, lay)) * w_b
        # The largest unit's full gradient before the store reduces it: a block, or the root
        # parameters (embedding, position table, final norm, head), one unit of their own
        # (reducing once per step, the whole gradient is counted above).
        if not once_per_step:
            comm += max(layer, root_params(m, lay)) * g_b
        if lay.allocation == "topology_aware":
            # The store's secondary copy: a 1/k slice of every block, in the weights' dtype
            # (k = the node's data ranks), held between steps like the shards, so counted with
            # the parameters (as ``controllers/memory/held.py`` counts the tensors). Dense
            # parameters only: expert weights are gathered over their own replicas, uncached.
            k = store_ranks_per_node(lay, gpus_per_node)
            weights += dense_rank * w_b / k
            # The codec's error feedback on the 1/k shard each rank quantizes (int8): gradient
            # state.
            grads += codec.store_error_bytes(dense_rank / k)
    comm += codec.error_state_bytes(dense_rank + expert_rank, dp_group)  # error feedback
    comm += posted_receive_bytes(m, lay, busiest, weights16)
    return MemoryBreakdown(weights, grads, optim, activations, comm, gathered, reserved,
                           params=dense_rank + expert_rank, offloaded=offloaded)
