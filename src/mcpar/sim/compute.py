"""Time of one layer (and of the embedding and head) for one micro-batch on one GPU: the
per-layer terms of the step that docs/cost_model.md states ("Per layer, per micro-batch, per
GPU": roofline GEMMs, the attention kernels, element-wise work, MoE layers, recompute).

Beyond the doc: element-wise work is counted in tensor reads+writes of the hidden size, 2 per
LayerNorm and 3.5 per bias-dropout-residual add (the mask at 1 byte), and the backward moves
twice the forward's bytes; the busiest expert rank's share is ``MOE_LOAD_IMBALANCE``. Where
drawing a dropout mask is a kernel of its own (a CPU: the accelerator's ``mask_rate``, measured
by the local profile), each mask costs its draw: the embedding's, the attention and MLP
outputs', and the attention probabilities' under the unfused or math kernel. The
communication inside a layer (tensor, context and expert parallelism) is priced here too, per
pass: forward, backward, and the forward again under full recompute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mcpar.registry.recompute import RECOMPUTE_POLICIES, LayerWork
from mcpar.ring_geometry import score_elements
from mcpar.sim.collectives import (
    Group,
    all_gather,
    all_reduce,
    all_to_all,
    p2p,
    reduce_scatter,
)
from mcpar.sim.hardware import Cluster, Efficiency
from mcpar.sim.workload import GATED_FFN, Layout, ModelShape

ACT_BYTES = {"fp16": 2, "bf16": 2, "fp8": 2, "fp32": 4}
# Element-wise traffic, in hidden-sized tensors per token per layer (forward).
HIDDEN_TENSORS_FWD = 2 * 2 + 2 * 3.5
SCORE_TENSORS_FWD, SCORE_TENSORS_BWD = 4.5, 5.5
FLASH_BWD_FACTOR = 2.5
# Speed of each flash kernel (``workload.FLASH_KERNELS``) relative to FlashAttention-2, forward
# and backward, as the FlashAttention-2 paper measured them (Dao 2023, section 4.1, A100): it runs
# about 2x FlashAttention-1's speed, and 1.3-1.5x (forward) and about 2x (backward) the speed of
# the Triton port of FlashAttention. The ``attention`` efficiency is FlashAttention-2's.
FLASH_KERNEL_SPEED = {"fa2": (1.0, 1.0), "fa1": (0.5, 0.5), "triton": (1 / 1.4, 0.5)}
# mcpar's ring blocks (``parallel/ring_attention.py``), eager fp32 ops over each block's scores,
# in score-sized reads + writes beyond the GEMMs' own, counted from the code: forward, the
# scale (2), the log-sum-exp (3: its max and its sum of exponentials) and the probabilities
# (4: subtract, exponentiate); backward, the probabilities again (6) and dS = P (dP - D) scale
# (7); the own block's causal mask adds its construction and the fill (3, each pass).
RING_SCORE_PASSES_FWD, RING_SCORE_PASSES_BWD, RING_MASK_PASSES = 9.0, 13.0, 3.0
# Ulysses' reorders per pass, in [tokens, hidden / tp] tensors: Q, K, V and the output each
# copied before their all-to-all (contiguous) and after it (the chunks put in order).
ULYSSES_COPIES = 8
# Busiest expert-parallel rank's tokens over the mean: routers balanced by an auxiliary loss
# still leave a max/mean load around 1.1 (MaxVio of about 0.1 in Wang et al. 2024).
MOE_LOAD_IMBALANCE = 1.1
# Tensor-parallel overlap (Transformer Engine's userbuffers, as NeMo's H100 configurations set
# it, e.g. ub_cfg_h100_175b_tp4_mbs1_seqlen2k): the reduce-scatters after the out-projection and
# the MLP-out GEMMs run as chunked kernels on 24 and 20 SMs kept from those GEMMs; the gathers
# go by ring exchange of copies (no SM); the backward's are bulk transfers on 2-8 SMs beside
# the other GEMM of the pair (their SMs are not kept from it, and not priced).
UB_SCATTER_SMS = (24, 20)
UB_SPLITS = 4  # chunks of the pipelined reduce-scatter
# Bytes the cross-entropy moves per logit element, (forward, backward), by kernel
# (``workload.CROSS_ENTROPY``). fused: one fp32 read and write each way. megatron: Megatron's
# vocab-parallel cross-entropy as its code runs it, unfused: forward, the 16-bit logits cast to
# fp32 (2 + 4), the max (4), subtracting it in place (4 + 4), exp in place (4 + 4), the sum (4)
# and the division into the softmax it saves (4 + 4); backward, the softmax scaled in place by
# the loss gradient (4 + 4) and cast back to 16 bits (4 + 2).
CE_BYTES = {"fused": (8.0, 8.0), "megatron": (38.0, 14.0)}


@dataclass
class Roofline:
    """The per-GPU rates one micro-batch's kernels run at."""

    gemm_flops: float
    attn_flops: float
    mem_bw: float
    act_bytes: int
    mask_rate: float = 0.0  # dropout-mask elements/s; 0: drawn inside the element-wise kernels

    def masks(self, elements: float) -> float:
        """Drawing dropout masks of ``elements`` where that is a kernel of its own (CPU)."""
        return elements / self.mask_rate if self.mask_rate > 0 else 0.0

    def gemm(self, m: float, n: float, k: float, count: float = 1.0) -> float:
        flops = 2.0 * m * n * k * count
        moved = self.act_bytes * (m * k + k * n + m * n) * count
        return max(flops / self.gemm_flops, moved / self.mem_bw)

    def stream(self, nbytes: float) -> float:
        return nbytes / self.mem_bw


def cpu_threads(cluster: Cluster, ranks: int) -> int:
    """Threads each CPU worker runs (mcpar: max(1, cores // workers)); 1 on GPUs."""
    return max(1, cluster.cores // ranks) if cluster.accel.is_cpu else 1


def oversubscription(cluster: Cluster, ranks: int) -> float:
    """How many times more threads than cores the workers run (1 when they fit)."""
    if not cluster.accel.is_cpu:
        return 1.0
    return max(1.0, ranks * cpu_threads(cluster, ranks) / cluster.cores)


def crowded_exchange(cluster: Cluster, lay: Layout) -> float:
    """Seconds each posted point-to-point exchange costs beyond its uncrowded price where the
    workers share cores: the measured cost at two workers a core (``Cluster.
    crowded_exchange_s``), linear from none at one, as the time-slicing penalty is."""
    crowd = oversubscription(cluster, lay.num_gpus)
    return cluster.crowded_exchange_s * min(1.0, crowd - 1.0)


def roofline(cluster: Cluster, lay: Layout, eff: Efficiency, share: float = 1.0) -> Roofline:
    """Rates for one rank; `share` < 1 when ranks share cores (CPU oversubscription)."""
    peak = cluster.accel.peak(lay.precision)
    attn_peak = (cluster.accel.peak("bf16" if lay.precision == "fp8" else lay.precision)
                 * cluster.accel.attention_share)
    return Roofline(peak * eff.gemm * share, attn_peak * eff.attention * share,
                    cluster.accel.hbm_bw * eff.memory * share, ACT_BYTES[lay.precision],
                    # A dropout mask is drawn in one thread however many a worker runs
                    # (``localprofile._measure``): its rate is not multiplied.
                    cluster.accel.mask_rate)


@dataclass
class PassTimes:
    """Seconds for one micro-batch through one unit (a layer, the head, ...), by category;
    categories ending in ``_comm`` are exposed communication."""

    parts: dict[str, float] = field(default_factory=dict)
    fwd: float = 0.0  # forward compute alone (what overlapped traffic can hide behind)
    bwd: float = 0.0  # backward compute alone

    def add(self, key: str, seconds: float) -> None:
        self.parts[key] = self.parts.get(key, 0.0) + seconds

    @property
    def comm(self) -> float:
        return sum(v for k, v in self.parts.items() if k.endswith("_comm"))

    @property
    def total(self) -> float:
        return sum(self.parts.values())


def pipelined_exposed(comm: float, gemm: float, chunks: int) -> float:
    """What a collective split into ``chunks`` and pipelined with a GEMM (each chunk's transfer
    beside the previous chunk's GEMM) adds to the GEMM: the longer of the two runs whole, and
    one chunk of the shorter cannot overlap (the pipeline's fill)."""
    return max(comm, gemm) + min(comm, gemm) / chunks - gemm


def tp_overlap_exposed(m: ModelShape, lay: Layout, cluster: Cluster, rl: Roofline,
                       gather: float, scatter: float) -> float:
    """Seconds tensor-parallel overlap (``Layout.tp_comm_overlap``) leaves on a layer's critical
    path, every pass: forward, the gathers ring-exchanged beside the QKV and MLP-in GEMMs (tp
    chunks) and the reduce-scatters pipelined beside the out-projection and MLP-out GEMMs, which
    run on the SMs the scatter leaves them (``UB_SCATTER_SMS``); backward, the gathers of the
    out-projection's and MLP-out's output gradients ring-exchanged beside their input-gradient
    GEMMs, and for QKV and MLP-in the input's gather beside the input-gradient GEMM and the
    input gradient's reduce-scatter beside the weight-gradient GEMM (bulk: whichever is longer).
    The forward runs again under full recompute."""
    t = lay.tp
    tok = tokens_per_gpu(m, lay)
    h, f = float(m.hidden), float(m.ffn)
    kv_local = max(m.kv_heads / t, 1.0) * m.head_dim
    qkv = rl.gemm(tok, h / t + 2 * kv_local, h)
    mlp_in = rl.gemm(tok, f / t, h) * (m.mlp_matrices - 1)
    outs = (rl.gemm(tok, h, h / t), rl.gemm(tok, h, f / t))  # out-projection, MLP-out
    sms = cluster.accel.sms
    fwd = pipelined_exposed(gather, qkv, t) + pipelined_exposed(gather, mlp_in, t)
    for gemm, kept in zip(outs, UB_SCATTER_SMS, strict=True):
        slow = gemm * (sms / (sms - kept) if sms > kept else 1.0)
        fwd += pipelined_exposed(scatter, slow, UB_SPLITS) + slow - gemm
    bwd = sum(pipelined_exposed(gather, g, t) for g in outs)
    bwd += sum(max(0.0, c - g) for c, g in ((gather, qkv), (scatter, qkv),
                                             (gather, mlp_in), (scatter, mlp_in)))
    passes = RECOMPUTE_POLICIES.get(lay.recompute).tp_passes
    return (passes - 1) * fwd + bwd


def tokens_per_gpu(m: ModelShape, lay: Layout) -> float:
    return lay.micro_batch * m.seq_len / lay.cp


def head_dim_factor(cluster: Cluster, head_dim: int) -> float:
    """The attention kernel's rate at ``head_dim`` over the one the efficiency holds, where the
    profile measured it by head dimension (``Cluster.attention_head_dims``): interpolated in
    log2 of the head dimension between the measured ones, the nearest outside them; 1 else."""
    rates = sorted(cluster.attention_head_dims.items())
    if not rates:
        return 1.0
    if head_dim <= rates[0][0]:
        return rates[0][1]
    for (d0, r0), (d1, r1) in zip(rates, rates[1:], strict=False):
        if head_dim <= d1:
            w = (math.log2(head_dim) - math.log2(d0)) / (math.log2(d1) - math.log2(d0))
            return r0 + w * (r1 - r0)
    return rates[-1][1]


def tp_group(lay: Layout) -> Group:
    return Group(lay.tp, 1)


def layer_times(m: ModelShape, lay: Layout, cluster: Cluster, eff: Efficiency,
                rl: Roofline) -> PassTimes:
    t = lay.tp
    tok = tokens_per_gpu(m, lay)
    h, f = float(m.hidden), float(m.ffn)
    dh = m.head_dim
    kv_local = max(m.kv_heads / t, 1.0) * dh  # kv heads are replicated when tp > kv_heads
    heads_local = m.heads / t
    out = PassTimes()

    # Attention projections.
    proj = rl.gemm(tok, h / t + 2 * kv_local, h) + rl.gemm(tok, h, h / t)
    # Attention core.
    if lay.cp > 1 and lay.context_mode == "ring":
        core_f, core_b = ring_core_times(m, lay, cluster, rl)
    elif lay.attention_kind == "flash":
        flops = 2.0 * tok * m.seq_len * h / t  # 4 T s h over the causal half
        speed_f, speed_b = FLASH_KERNEL_SPEED[lay.flash_kernel]
        rate = rl.attn_flops * head_dim_factor(cluster, dh)
        core_f = flops / rate / speed_f
        core_b = FLASH_BWD_FACTOR * flops / rate / speed_b
    else:
        batch = lay.micro_batch * heads_local
        sq = m.seq_len / lay.cp
        scores = batch * sq * m.seq_len
        core_f = (rl.gemm(sq, m.seq_len, dh, batch) + rl.gemm(sq, dh, m.seq_len, batch)
                  + rl.stream(SCORE_TENSORS_FWD * scores * rl.act_bytes))
        core_b = (2 * (rl.gemm(sq, m.seq_len, dh, batch) + rl.gemm(sq, dh, m.seq_len, batch))
                  + rl.stream(SCORE_TENSORS_BWD * scores * rl.act_bytes))
        if m.dropout:  # the probabilities' mask, drawn again when the core is recomputed
            core_f += rl.masks(scores)
    # MLP or experts.
    hidden_share = 1.0 / t if lay.seq_parallel else 1.0
    moved = HIDDEN_TENSORS_FWD * tok * h * hidden_share  # element-wise traffic, in elements
    if m.is_moe:
        # Token-expert pairs on this GPU: top_k per token, and with experts spread over ranks
        # the busiest rank gets more than its share.
        load = MOE_LOAD_IMBALANCE if lay.ep > 1 else 1.0
        routed = tok * m.top_k * load
        local_experts = m.experts / lay.ep
        per_expert = routed / local_experts
        mlp = rl.gemm(tok, m.experts, h) + m.mlp_matrices * rl.gemm(
            per_expert, f / t, h, local_experts)
        moved += 2 * (tok + routed) * h  # permute tokens to expert order and back
        act_tokens = routed
    else:
        mlp = m.mlp_matrices * rl.gemm(tok, f / t, h)
        act_tokens = tok
    moved += (3 if m.ffn_kind in GATED_FFN else 2) * act_tokens * f / t
    if lay.precision == "fp8":
        # Each GEMM input is cast to fp8 (read 16-bit, write 8-bit): QKV and MLP inputs, the
        # output projection's and the down projection's inputs.
        moved += 1.5 * tok * (2 * h + h / t + act_tokens / tok * f / t)
    elementwise = rl.stream(rl.act_bytes * moved)
    # The attention and MLP outputs' masks, drawn in the forward (the backward multiplies by
    # the kept mask: that traffic is in `moved`).
    masks = rl.masks(2 * tok * h * hidden_share) if m.dropout else 0.0

    gemm_f = proj + mlp
    out.fwd = gemm_f + core_f + elementwise + masks
    out.bwd = 2 * gemm_f + core_b + 2 * elementwise
    out.add("gemm", 3 * gemm_f)
    out.add("attention", core_f + core_b)
    out.add("elementwise", 3 * elementwise + masks)
    policy = RECOMPUTE_POLICIES.get(lay.recompute)  # what the backward pass runs again
    again = policy.recompute_seconds(LayerWork(forward=out.fwd, core=core_f, mlp=mlp))
    if lay.alternate_mm_recompute:
        again += alternate_mm_seconds(m, lay, rl) + elementwise + masks
    if again:
        out.add("recompute", again)
    passes = policy.tp_passes  # forward, backward (, forward again)

    # Tensor parallelism: two all-reduces per pass on the residual stream, or under sequence
    # parallelism two reduce-scatter + all-gather pairs (the same bytes on a ring).
    msg = tok * h * rl.act_bytes
    if lay.seq_parallel:
        gather = all_gather(msg, tp_group(lay), cluster, eff.network, "flat")
        scatter = reduce_scatter(msg, tp_group(lay), cluster, eff.network, "flat")
        if lay.tp_comm_overlap and t > 1:
            out.add("tp_comm", tp_overlap_exposed(m, lay, cluster, rl, gather, scatter))
        else:
            out.add("tp_comm", passes * 2 * (gather + scatter))
    else:
        out.add("tp_comm", passes * 2 * all_reduce(msg, tp_group(lay), cluster, eff.network,
                                                   "flat"))

    # Context parallelism (docs/cost_model.md, "Context parallelism").
    if lay.cp > 1:
        out.add("cp_comm", context_exposed(m, lay, cluster, eff, rl, core_f, core_b, passes))
        if lay.context_mode == "ulysses":  # the head/sequence reorders around each all-to-all
            copies = rl.stream(ULYSSES_COPIES * tok * h / t * rl.act_bytes)
            out.fwd += copies
            out.bwd += copies
            out.add("elementwise", 2 * copies)

    # Expert parallelism: dispatch and combine all-to-alls of the routed tokens, per pass; the
    # tensor ranks each send their 1/tp share.
    if m.is_moe and lay.ep > 1:
        ep_group = Group(lay.ep, lay.tp * lay.cp)
        routed_bytes = tok * m.top_k * MOE_LOAD_IMBALANCE * h * rl.act_bytes / t
        a2a = 2 * all_to_all(routed_bytes, ep_group, cluster, eff.network)
        out.add("ep_comm", passes * a2a)
    return out


def alternate_mm_seconds(m: ModelShape, lay: Layout, rl: Roofline) -> float:
    """Forward seconds of every second matrix product of a block, in the order it runs them
    (``Layout.alternate_mm_recompute``, torchtitan's op-level selective checkpointing: the
    query, key, value and output projections, then the MLP's products, gate before up before
    down); the attention core's output is kept."""
    t = lay.tp
    tok = tokens_per_gpu(m, lay)
    h, f = float(m.hidden), float(m.ffn)
    kv_local = max(m.kv_heads / t, 1.0) * m.head_dim
    products = [rl.gemm(tok, h / t, h), rl.gemm(tok, kv_local, h), rl.gemm(tok, kv_local, h),
                rl.gemm(tok, h, h / t)]
    products += [rl.gemm(tok, f / t, h)] * (m.mlp_matrices - 1) + [rl.gemm(tok, h, f / t)]
    return sum(products[1::2])


def ring_core_times(m: ModelShape, lay: Layout, cluster: Cluster,
                    rl: Roofline) -> tuple[float, float]:
    """(forward, backward) seconds of mcpar's ring blocks (``parallel/ring_attention.py``) on one
    rank: its own 2c x 2c block with the causal mask applied to full scores, and cp - 1 dense
    c x 2c blocks (c = seq / 2cp), each a math kernel in fp32 (scores written out, log-sum-exp,
    probabilities, the online merge); the backward recomputes each block's probabilities from
    the saved log-sum-exp, then dV, dP, dQ and dK. A profile that timed these blocks
    (``Cluster.ring_blocks``: a CPU's, where small blocks run far below the GEMM rate and the
    exponentials are compute-bound, not streamed) prices them as measured; else the GEMMs and
    the score passes below, at the accelerator's rates."""
    dh = m.head_dim
    c = m.seq_len / (2 * lay.cp)
    batch = lay.micro_batch * m.heads / lay.tp
    if cluster.ring_blocks is not None:
        return cluster.ring_blocks.seconds(lay.cp, score_elements(batch, 2 * c, lay.cp), dh,
                                           cpu_threads(cluster, lay.num_gpus))
    acc = _fp32(rl, cluster, lay)
    forward = backward = 0.0
    for rows, count, mask in ((2 * c, 1, RING_MASK_PASSES), (c, lay.cp - 1, 0.0)):
        qk = acc.gemm(rows, 2 * c, dh, batch * count)  # the scores
        pv = acc.gemm(rows, dh, 2 * c, batch * count)  # probabilities x V (and its adjoints)
        scores = batch * count * rows * 2 * c * 4
        forward += qk + pv + acc.stream((RING_SCORE_PASSES_FWD + mask) * scores)
        backward += qk + 4 * pv + acc.stream((RING_SCORE_PASSES_BWD + mask) * scores)
    return forward, backward


def _fp32(rl: Roofline, cluster: Cluster, lay: Layout) -> Roofline:
    """``rl`` for fp32 operands: the ring accumulates in fp32 whatever the layout's precision,
    so its GEMMs run at the accelerator's fp32 peak (a GPU's is TF32, half its 16-bit peak: see
    docs/cost_model.md) and its element-wise work moves 4-byte scores."""
    peaks = cluster.accel.peak_flops
    scale = peaks["fp32"] / peaks[lay.precision] if (
        "fp32" in peaks and lay.precision in peaks) else 1.0
    return Roofline(rl.gemm_flops * scale, rl.attn_flops * scale, rl.mem_bw, 4, rl.mask_rate)


def context_exposed(m: ModelShape, lay: Layout, cluster: Cluster, eff: Efficiency,
                    rl: Roofline, core_f: float, core_b: float, passes: int) -> float:
    """Seconds the context axis's traffic adds to one layer's passes (forward, backward, and
    the forward again under full recompute: ``passes``), by ``lay.context_mode``."""
    n, t = lay.cp, lay.tp
    group = Group(n, t)
    tok = tokens_per_gpu(m, lay)
    local = tok * m.hidden / t  # elements of one [tokens, heads / tp, head_dim] tensor
    if lay.context_mode == "ulysses":
        # Q, K, V (K and V expanded to the query heads) to head shards and the output back:
        # four all-to-alls per pass, nothing to hide them behind.
        return passes * 4 * all_to_all(local * rl.act_bytes, group, cluster, eff.network)
    if lay.context_mode == "flash_ring":
        # A published ring: the key-value heads' K/V around (n - 1 steps), overlapped with
        # the blocks as a whole; backward, K/V and their gradients likewise.
        kv_local = max(m.kv_heads / t, 1.0) * m.head_dim
        ring_f = (n - 1) * p2p(2 * tok * kv_local * rl.act_bytes, group, cluster, eff.network)
        exposed_f = max(0.0, ring_f - core_f)
        return exposed_f * (passes - 1) + max(0.0, 2 * ring_f - core_b)
    # mcpar's ring: K and V (expanded to the query heads, in the inputs' dtype) stacked in one
    # message per step, posted before each block and waited after it, so each transfer hides
    # behind one block: the own block (2 of the n + 1 block units of work, its full scores
    # masked) at step 0, a dense block (1 unit) after. Backward: n steps; each block's fp32
    # dK/dV is sent on after the block is computed and waited at once (exposed), behind the
    # K/V still in flight on the same link.
    # Where workers share cores, every exchange, hidden or not, costs the measured crowded
    # handoff on top (``crowded_exchange``): n - 1 K/V hops a pass, and the backward's n dK/dV.
    kv = p2p(2 * local * rl.act_bytes, group, cluster, eff.network)
    dkv = p2p(2 * local * 4, group, cluster, eff.network)
    crowded = crowded_exchange(cluster, lay)

    def hidden_behind(unit: float) -> float:
        return max(0.0, kv - 2 * unit) + (n - 2) * max(0.0, kv - unit) + (n - 1) * crowded

    forward = hidden_behind(core_f / (n + 1))
    backward = hidden_behind(core_b / (n + 1)) + n * (dkv + crowded)
    return forward * (passes - 1) + backward


def head_times(m: ModelShape, lay: Layout, cluster: Cluster, eff: Efficiency,
               rl: Roofline) -> PassTimes:
    """Final norm, output projection over the vocabulary slice, and the cross-entropy."""
    t = lay.tp
    tok = tokens_per_gpu(m, lay)
    gemm = rl.gemm(tok, m.vocab / t, m.hidden)
    ce_f, ce_b = (rl.stream(b * tok * m.vocab / t) for b in CE_BYTES[lay.cross_entropy])
    norm = rl.stream(2 * rl.act_bytes * tok * m.hidden)
    out = PassTimes(fwd=gemm + ce_f + norm, bwd=2 * gemm + ce_b + 2 * norm)
    out.add("gemm", 3 * gemm)
    out.add("elementwise", ce_f + ce_b + 3 * norm)
    # The input gradient of the vocabulary-parallel head is summed over tensor ranks, and the
    # vocabulary-parallel cross-entropy reduces three per-token values (max, sum of exponentials,
    # the target's logit): small messages, where latency is the cost.
    group = tp_group(lay)
    out.add("tp_comm", all_reduce(tok * m.hidden * rl.act_bytes, group, cluster, eff.network,
                                  "flat")
            + 3 * all_reduce(4.0 * tok, group, cluster, eff.network, "flat"))
    return out


def embedding_times(m: ModelShape, lay: Layout, cluster: Cluster, eff: Efficiency,
                    rl: Roofline) -> PassTimes:
    """Row gather forward, scatter-add backward; the vocabulary-parallel lookup's partial sums
    are all-reduced over tensor ranks."""
    tok = tokens_per_gpu(m, lay)
    move = rl.stream(2 * rl.act_bytes * tok * m.hidden)
    masks = rl.masks(tok * m.hidden) if m.dropout else 0.0
    out = PassTimes(fwd=move + masks, bwd=2 * move)
    out.add("elementwise", 3 * move + masks)
    out.add("tp_comm", all_reduce(tok * m.hidden * rl.act_bytes, tp_group(lay), cluster,
                                  eff.network, "flat"))
    return out
