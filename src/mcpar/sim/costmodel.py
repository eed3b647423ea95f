"""The analytical model of one training step: pipeline of per-layer costs, plus data-parallel
synchronization and the optimizer, on a given cluster.

Step = pipeline time + exposed once-per-step gradient/parameter traffic + optimizer.

- Pipeline rank r does, per micro-batch, W_r: its layers' forward, backward and recompute
  (``compute.layer_times``), their exposed tensor/context/expert-parallel communication, the
  embedding (first rank) or the head (last rank), the point-to-point sends to its neighbours
  (2 per model chunk: activation forward, gradient backward), per-micro-batch ZeRO-2/3 traffic
  and a fixed per-layer overhead. Layers are split evenly over the pp x vp stages.
- 1F1B and GPipe take m W_max + (sum_r W_r - W_max); the interleaved schedule divides the fill
  and drain by vp: m W_max + (sum_r W_r - W_max) / vp. With equal stages that is the familiar
  (m + (pp - 1) / vp) W.
- Data-parallel gradient traffic runs over dp x cp ranks (experts: dp x cp / ep) on the
  inter-node fabric once dp neighbours sit in different nodes. Stage 0 all-reduces once per step;
  stage 1 reduce-scatters gradients and all-gathers updated weights once per step; stage 2
  reduce-scatters every micro-batch; stage 3 also all-gathers the weights for the forward and
  again for the backward of every micro-batch. Gradient traffic overlaps the last micro-batch's
  backward, weight gathers the forward; ``overlap`` is the share of that overlappable time
  actually hidden, and the last bucket never is; a stack that exchanges them between the last
  backward and the optimizer step (``Layout.dp_overlap`` false) hides none. Each bucket
  (``bucket_mb``; by default Megatron's max(40M, 1M x dp) elements) pays the collective's
  latency; ZeRO-3 moves one layer per call, and with the hierarchical parameter store its
  backward gathers stay in the node and its reduce-scatter goes in two levels (``zero3``).
- Compression: fp16/bf16 halve fp32 gradient bytes; ``1bit`` is 1-bit Adam's compression stage
  (signs + scales, about 1/32 of fp32, after its warm-up); ``powersgd`` sends rank-r factors
  P (n x r) and Q (m x r) of each weight matrix's gradient in two all-reduce rounds (a DDP
  hook: overlapped like plain gradients). Both pay their encode/decode work at memory (and, for
  PowerSGD, GEMM) speed. 1-bit with ``hierarchical`` topology compresses only the inter-node
  stage; 1-bit Adam exchanges momentum in the optimizer step, so it is never hidden.
- The optimizer streams every local parameter's state once (Adam, memory-bound).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from mcpar.errors import UserError
from mcpar.registry.codec import CODECS
from mcpar.registry.recompute import RECOMPUTE_POLICIES
from mcpar.registry.schedule import PipelineSchedule
from mcpar.registry.schedule_replay import replay
from mcpar.sim.collectives import (
    Group,
    all_gather,
    all_reduce,
    host_p2p,
    onebit_all_reduce,
    p2p,
    reduce_scatter,
)
from mcpar.sim.compute import (
    Roofline,
    cpu_threads,
    embedding_times,
    head_times,
    layer_times,
    oversubscription,
    roofline,
    tokens_per_gpu,
)
from mcpar.sim.hardware import Cluster, Efficiency
from mcpar.sim.memory import (
    MemoryBreakdown,
    chunk_blocks,
    gather_span,
    memory_per_gpu,
    params_per_rank,
    schedule_entry,
    state_bytes,
)
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.workload import Layout, ModelShape, layout_problems, model_problems, rank_layers
from mcpar.sim.zero3 import STORE, zero3_traffic


@dataclass
class Prediction:
    step_s: float
    pipeline_s: float
    bubble_s: float  # idle time of the average pipeline rank (fill, drain, imbalance)
    comm_exposed_s: float  # communication on the critical path, not hidden behind compute
    dp_comm_s: float  # data-parallel traffic, hidden or not
    optimizer_s: float
    memory: MemoryBreakdown
    memory_limit: float
    model_flops: float  # per step: 6 x matmul weights x tokens + attention over the full square
    num_gpus: int
    peak_flops: float
    tokens: float
    breakdown: dict[str, float] = field(default_factory=dict)  # critical-path seconds by kind

    @property
    def fits(self) -> bool:
        return self.memory.total <= self.memory_limit

    @property
    def mfu(self) -> float:
        return self.model_flops / (self.step_s * self.num_gpus * self.peak_flops)

    @property
    def comm_fraction(self) -> float:
        return self.comm_exposed_s / self.step_s

    @property
    def bubble_fraction(self) -> float:
        return self.bubble_s / self.step_s

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s


def model_flops_per_token(m: ModelShape) -> float:
    """Training FLOPs of one token without recompute (the shape's count)."""
    return m.flops_per_token()


def rank_roofline(cluster: Cluster, lay: Layout, eff: Efficiency) -> Roofline:
    """One rank's rates at full speed (sharing of oversubscribed cores comes in ``finish``)."""
    threads = cpu_threads(cluster, lay.num_gpus)
    rl = roofline(cluster, lay, eff, float(threads))
    if cluster.accel.is_cpu:
        # Memory bandwidth: each thread streams its own rate (hbm_bw holds the one-thread rate)
        # until the busy cores together saturate the socket.
        rl.mem_bw = min(rl.mem_bw, cluster.accel.mem_bw_total * threads / cluster.cores)
    return rl


def _chunks(nbytes: float, bucket: float) -> int:
    return max(1, math.ceil(nbytes / bucket)) if nbytes > 0 else 1


def _exposed(comm: float, window: float, overlap: float, calls: int) -> float:
    """Communication left on the critical path when it may hide behind `window` of compute;
    the last of its `calls` (the last bucket) never can."""
    return _exposed_parts([(comm, overlap)], window, calls)


def _exposed_parts(parts: list[tuple[float, float]], window: float, calls: int) -> float:
    """``_exposed`` of traffic made of parts that hide in different shares, (seconds, overlap)
    each, behind one `window` (with one share: ``overlap * min(comm, window)`` hidden)."""
    comm = sum(seconds for seconds, _ in parts)
    hidden = min(sum(seconds * share for seconds, share in parts),
                 max(share for _, share in parts) * window)
    return max(comm - hidden, comm / calls)


def powersgd_factors(m: ModelShape, lay: Layout) -> float:
    """Sum over this rank's weight matrices of (rows + cols): PowerSGD sends rank x that."""
    h, t = m.hidden, lay.tp
    kv = max(m.kv_heads / t, 1.0) * m.head_dim
    per_layer = (h + h / t + 2 * kv) + (h / t + h)
    experts = m.experts / lay.ep if m.is_moe else 1
    per_layer += experts * m.mlp_matrices * (h + m.ffn / t)
    return per_layer * m.layers / lay.pp + (m.vocab / t + h)


@dataclass
class DPCost:
    per_micro_exposed: float  # inside every micro-batch (ZeRO-2/3)
    per_step_exposed: float  # once per step, after the pipeline drains
    total: float  # all data-parallel traffic time, hidden or not
    encode_s: float  # compression work on the critical path


@dataclass
class _Wire:
    """One parameter group's replicated exchange, as a codec entry prices it (``Wire``)."""

    count: float
    calls: int
    grad_bytes: float
    group: Group
    cluster: Cluster
    net: float
    topology: str
    rl: Roofline
    model: ModelShape
    lay: Layout
    all_params: float  # dense + expert parameters of the rank

    @property
    def hierarchical(self) -> bool:
        return self.topology != "flat"

    @property
    def low_rank(self) -> int:
        return self.lay.powersgd_rank

    def all_reduce(self, nbytes: float) -> float:
        return all_reduce(nbytes, self.group, self.cluster, self.net, self.topology)

    def all_gather(self, nbytes: float) -> float:
        return all_gather(nbytes, self.group, self.cluster, self.net, self.topology)

    def onebit_all_reduce(self, values: float) -> float:
        return onebit_all_reduce(values, self.group, self.cluster, self.net,
                                 hierarchical=self.hierarchical)

    def stream(self, nbytes: float) -> float:
        return self.rl.stream(nbytes)

    def gemm_seconds(self, flops: float) -> float:
        return flops / self.rl.gemm_flops

    def low_rank_values(self, rank: int) -> float:
        return rank * powersgd_factors(self.model, self.lay) * (self.count / self.all_params)


def dp_cost(m: ModelShape, lay: Layout, cluster: Cluster, eff: Efficiency, rl: Roofline,
            fwd_window: float, bwd_window: float) -> DPCost:
    dense, expert, layer = params_per_rank(m, lay)
    w_b, g_b, _ = state_bytes(lay.precision, lay.autocast)
    store = lay.allocation == STORE
    codec = CODECS.get(lay.compression)
    g_b = codec.wire_grad_bytes(g_b, store)
    if lay.zero_stage >= 2 and not lay.autocast:
        # ZeRO-2/3 runs of the published stacks (DeepSpeed, FSDP) reduce-scatter in the 16-bit
        # compute dtype; mcpar (autocast) reduces its fp32 gradients in fp32.
        g_b = min(g_b, 2.0)
    groups = [(dense, Group(lay.dp * lay.cp, lay.tp))]
    if expert:
        groups.append((expert, Group(lay.dp * lay.cp // lay.ep, lay.tp * lay.ep)))
    net, topo = eff.network, lay.topology
    overlap = eff.overlap if lay.dp_overlap else 0.0
    # ZeRO-3's gathers are prefetched, launched a block ahead; where a profile measured how
    # much of such a gather hides (a CPU's backend moves its bytes without the cores that
    # compute, while a reduction needs them), that share, else the fitted overlap.
    prefetched = (cluster.gather_overlap if cluster.gather_overlap is not None
                  else eff.overlap) if lay.dp_overlap else 0.0
    layers_rank = max(1, round(m.layers / lay.pp))
    per_micro = per_step = total = encode = 0.0
    for index, (count, group) in enumerate(groups):
        if group.size <= 1:
            continue
        grads, weights = count * g_b, count * w_b
        bucket = (lay.bucket_mb * 2**20 if lay.bucket_mb is not None
                  else max(40e6, 1e6 * group.size) * g_b)
        # ZeRO-3 gathers and reduces one layer (one FSDP unit) per call, or a group of small
        # ones (``gather_span``).
        span = gather_span(layer * w_b, lay.gather_mb, chunk_blocks(m, lay))
        calls = math.ceil(layers_rank / span) if lay.zero_stage == 3 else _chunks(grads, bucket)
        if lay.zero_stage == 0:
            # The codec's entry prices the replicated exchange (mcpar.registry.codec).
            cost = codec.price(_Wire(count, calls, g_b, group, cluster, net, topo, rl, m, lay,
                                     dense + expert))
            encode += cost.encode_s
            # An exchange started from the backward pass hides behind it; one inside the
            # optimizer step (1-bit Adam's momentum) does not.
            per_step += (_exposed(cost.comm_s, bwd_window, overlap, calls)
                         if cost.overlappable else cost.comm_s)
            total += cost.comm_s
            continue
        if lay.zero_stage == 3:
            # The store caches and compresses the dense buckets; expert weights, reduced over
            # their own replicas, are gathered and reduced as plain ZeRO-3 does.
            z3_lay = lay if index == 0 else lay.with_(allocation="default")
            z3 = zero3_traffic(count, w_b, g_b, group, z3_lay, cluster, net, topo, calls, rl)
            # Prefetching hides the next block's gather behind the current block's compute.
            per_micro += _exposed(z3.forward, fwd_window, prefetched, calls)
            encode += z3.encode * lay.num_microbatches
            gathers = z3.backward - z3.reduce
            if lay.reduces_every_backward:
                per_micro += _exposed_parts([(gathers, prefetched), (z3.reduce, overlap)],
                                            bwd_window, 2 * calls)
                total += (z3.forward + z3.backward) * lay.num_microbatches
                continue
            # The gathers every backward, the reduce-scatters once per step.
            per_micro += _exposed(gathers, bwd_window, prefetched, calls)
            per_step += _exposed(z3.reduce, bwd_window, overlap, calls)
            total += (z3.forward + gathers) * lay.num_microbatches + z3.reduce
            continue
        reduce = all_reduce if lay.grad_all_reduce else reduce_scatter
        rs = calls * reduce(grads / calls, group, cluster, net, topo)
        ag_calls = _chunks(weights, bucket)
        ag = ag_calls * all_gather(weights / ag_calls, group, cluster, net, topo)
        if not lay.reduces_every_backward:  # stage 1, or 2 reducing once per step
            per_step += _exposed(rs, bwd_window, overlap, calls)
            per_step += _exposed(ag, fwd_window, overlap, ag_calls)
            total += rs + ag
        else:
            per_micro += _exposed(rs, bwd_window, overlap, calls)
            per_step += _exposed(ag, fwd_window, overlap, ag_calls)
            total += rs * lay.num_microbatches + ag
    return DPCost(per_micro, per_step, total, encode)


# Bytes the optimizer step streams per parameter, pass by pass (multi-tensor kernels):
# fp16 (loss-scaled, 16-bit gradients): copy grads to fp32 (2+4), unscale and inf check (4+4),
#   norm (4), clip (4+4), fused Adam (read grad, weight, m, v; write weight, m, v: 28),
#   fp32 -> fp16 weight copy (4+2), zero the gradients (2 + 4);
# bf16 (gradients accumulated in fp32): norm, clip, Adam, weight copy, zero (4);
# fp32: norm, clip, Adam, zero.
OPTIMIZER_BYTES = {"fp16": 6 + 8 + 4 + 8 + 28 + 6 + 6, "bf16": 4 + 8 + 28 + 6 + 4,
                   "fp8": 4 + 8 + 28 + 6 + 4, "fp32": 4 + 8 + 28 + 4}


def optimizer_time(m: ModelShape, lay: Layout, rl: Roofline) -> float:
    """Adam with gradient clipping over the local parameters (ZeRO >= 1: the rank's shard for
    the fp32 work; gradients are zeroed in full below stage 2)."""
    dense, expert, _ = params_per_rank(m, lay)
    group = lay.dp * lay.cp
    shard = dense / (group if lay.zero_stage >= 1 else 1)
    shard += expert / (max(1, group // lay.ep) if lay.zero_stage >= 1 else 1)
    return rl.stream(OPTIMIZER_BYTES[lay.precision] * shard)


def check(m: ModelShape, lay: Layout, cluster: Cluster, where: str,
          names: dict[str, str] | None = None) -> None:
    problems = model_problems(m, where) or layout_problems(m, lay, cluster.num_gpus,
                                                           cluster.gpus_per_node, where, names)
    if problems:
        raise UserError(problems)


@dataclass
class PipelineCore:
    """What a layout's pipeline costs before ZeRO stage, compression and collective topology
    are chosen (the planner prices those variants on one core)."""

    work_max: float  # per-micro-batch work of the busiest rank
    work_sum: float  # summed over ranks
    at_max: dict[str, float]  # the busiest rank's work by category
    summed: dict[str, float]  # every rank's work by category, summed
    fwd_window: float  # forward compute of the busiest rank, one micro-batch
    bwd_window: float
    rl: Roofline
    eff: Efficiency
    rank_work: list[float]  # per-micro-batch work of every pipeline rank
    fwd_share: float  # the forward's share of a layer's work
    # A pipeline message's time on a wire between nodes that the ranks do not drive (mcpar's
    # stage executor posts sends and receives around compute): it delays the rank that waits
    # for the message, not the sender (``schedule_replay``'s latency). 0: a message costs its
    # ranks what ``p2p_comm`` says, as on one host or through a GPU's copy engine.
    wire_s: float = 0.0


def pipeline_core(m: ModelShape, lay: Layout, cluster: Cluster,
                  eff: Efficiency | None = None) -> PipelineCore:
    eff = eff or cluster.efficiency or GPU_EFFICIENCY
    rl = rank_roofline(cluster, lay, eff)
    layer = layer_times(m, lay, cluster, eff, rl)
    head = head_times(m, lay, cluster, eff, rl)
    emb = embedding_times(m, lay, cluster, eff, rl)
    p, v = lay.pp, lay.vp
    counts = rank_layers(m, lay)
    overhead_per_layer = eff.layer_overhead_s * RECOMPUTE_POLICIES.get(lay.recompute).layer_overhead

    p2p_s = wire_s = 0.0
    if p > 1:
        group = Group(p, lay.tp * lay.cp * lay.dp)
        msg = tokens_per_gpu(m, lay) * m.hidden * rl.act_bytes
        if lay.p2p_split or lay.seq_parallel:
            msg /= lay.tp
        sent = p2p(msg, group, cluster, eff.network)
        handled = host_p2p(msg, cluster)
        if cluster.accel.is_cpu and handled is not None and sent > handled:
            # Between CPU nodes a rank handles a message as on its host (the profile's line);
            # the rest is the wire's, and delays only whoever waits for the message.
            sent, wire_s = handled, sent - handled
        p2p_s = 2 * v * sent

    ranks: list[dict[str, float]] = []
    for r, n_layers in enumerate(counts):
        parts: dict[str, float] = {k: n_layers * t for k, t in layer.parts.items()}
        ends = ([emb] if r == 0 else []) + ([head] if r == p - 1 else [])
        for unit in ends:
            for k, t in unit.parts.items():
                parts[k] = parts.get(k, 0.0) + t
        parts["overhead"] = n_layers * overhead_per_layer
        if p2p_s:
            parts["p2p_comm"] = p2p_s
        ranks.append(parts)
    work = [sum(parts.values()) for parts in ranks]
    i_max = work.index(max(work))
    summed: dict[str, float] = {}
    for parts in ranks:
        for k, t in parts.items():
            summed[k] = summed.get(k, 0.0) + t
    busiest = max(counts)
    return PipelineCore(work[i_max], sum(work), ranks[i_max], summed, busiest * layer.fwd,
                        busiest * layer.bwd, rl, eff, work, layer.fwd / layer.total, wire_s)


def finish(core: PipelineCore, m: ModelShape, lay: Layout, cluster: Cluster) -> Prediction:
    """The step: the pipeline with per-micro-batch ZeRO traffic, then once-per-step traffic,
    compression work and the optimizer."""
    dp = dp_cost(m, lay, cluster, core.eff, core.rl, core.fwd_window, core.bwd_window)
    p, v, mb = lay.pp, lay.vp, lay.num_microbatches
    z = dp.per_micro_exposed
    at_max = dict(core.at_max, zero_comm=z)
    summed = dict(core.summed, zero_comm=p * z)
    w_max, w_sum = core.work_max + z, core.work_sum + p * z
    entry = schedule_entry(m, lay)  # bounded as it runs (a split schedule to 1F1B's memory)
    work = [w + z for w in core.rank_work]
    # Steps that overlap (post-validation) cost the schedule's steady period: the fill and
    # drain one step pays are hidden behind its neighbours' (``PipelineSchedule.period``).
    pipeline = (entry.period(mb, work, v, core.fwd_share) if lay.overlapped_steps
                else entry.span(mb, w_max, w_sum, work, v, core.fwd_share))
    fill_drain = mb * w_max + (w_sum - w_max) / v
    if pipeline == fill_drain and fill_drain >= w_sum:
        # Each category's share of the critical path (the busiest rank's m slots plus the
        # others' fill and drain), so that the breakdown sums to the pipeline time.
        breakdown = {k: mb * at_max.get(k, 0.0) + (summed[k] - at_max.get(k, 0.0)) / v
                     for k in summed}
    elif pipeline == w_sum:
        # Fewer micro-batches than the schedule can overlap: one micro-batch must still cross
        # every stage forward and back.
        breakdown = dict(summed)
    else:  # another shape of step: the categories in proportion to their work
        breakdown = {k: t * pipeline / w_sum for k, t in summed.items()}
    bubble = pipeline - mb * w_sum / p
    breakdown["dp_comm"] = dp.per_step_exposed
    breakdown["compression"] = dp.encode_s
    breakdown["optimizer"] = optimizer_time(m, lay, core.rl)
    crowd = oversubscription(cluster, lay.num_gpus)
    if crowd > 1:
        pipeline, bubble, breakdown = _shared_cores(core, lay, entry, cluster, z, pipeline,
                                                    breakdown, crowd)
    elif core.wire_s > 0:
        # The messages' time on the wire that no rank's work hides (the step replayed with it,
        # against without it).
        on_wire = (entry.period(mb, work, v, core.fwd_share, core.wire_s)
                   if lay.overlapped_steps else
                   entry.span(mb, w_max, w_sum, work, v, core.fwd_share, core.wire_s))
        breakdown["p2p_comm"] = breakdown.get("p2p_comm", 0.0) + on_wire - pipeline
        bubble += on_wire - pipeline
        pipeline = on_wire
    step = pipeline + sum(breakdown[k] for k in ("dp_comm", "compression", "optimizer"))
    comm = sum(t for k, t in breakdown.items() if k.endswith("_comm"))
    tokens = lay.global_batch * m.seq_len
    return Prediction(
        step_s=step, pipeline_s=pipeline, bubble_s=bubble, comm_exposed_s=comm,
        dp_comm_s=dp.total, optimizer_s=breakdown["optimizer"],
        memory=memory_per_gpu(m, lay, cluster.reserved_bytes, cluster.gpus_per_node),
        memory_limit=cluster.accel.hbm_bytes,
        model_flops=model_flops_per_token(m) * tokens, num_gpus=lay.num_gpus,
        peak_flops=cluster.accel.peak(lay.precision), tokens=tokens,
        breakdown={k: t for k, t in breakdown.items() if t > 0},
    )


def _shared_cores(core: PipelineCore, lay: Layout, entry: PipelineSchedule, cluster: Cluster,
                  z: float,
                  pipeline: float, breakdown: dict[str, float], crowd: float,
                  ) -> tuple[float, float, dict[str, float]]:
    """CPU workers with more threads than cores share them:
    - compute that runs on all ranks at once slows by `crowd`, and by what switching the
      workers in and out costs beyond that (``Cluster.time_slicing_penalty``, measured at two
      workers a core; linear from none at one). A pipeline whose steps do not overlap, of any
      registered schedule and any chunks per rank, is replayed with processor sharing instead
      of the uniform slowdown (``schedule_replay.replay``): a rank in its bubble leaves its
      share of the cores to the others;
    - the collectives (every ``*_comm``) do not slow: groups that reach their collectives
      together have nothing computing beside them. Measured here (gloo, 4 workers on 2 cores,
      each call after ~10 ms of compute, the groups in lockstep): 2-rank all-reduces of 1 and
      4 MiB in two groups at once 3.1 and 6.9 ms a call, against 3.3 and 6.5 ms for 2 workers
      alone; a 4-rank one of 4 MiB 12.2 ms, against 11.9 ms priced from the 2-rank line without
      the slowdown. In training the groups drift apart, and the ranking bench's tensor-2
      layouts read 8-12% fast under this rule (docs/cost_model.md, "Ranking layouts here")."""
    mb = lay.num_microbatches
    shared = pipeline * crowd
    wire = 0.0
    if lay.pp > 1 and not lay.overlapped_steps:
        # (Overlapping steps leave no bubble to free cores in: the uniform slowdown holds.)
        work = [w + z for w in core.rank_work]
        # The ranks of one pipeline stage in every data-parallel replica and tensor group run
        # the same tasks at the same time: they load the cores together.
        per_stage = cpu_threads(cluster, lay.num_gpus) * lay.tp * lay.dp * lay.cp
        shared = replay(entry, work, mb, lay.vp, core.fwd_share,
                        cluster.cores, per_stage)
        # The messages' time on the wire between nodes that no rank's work hides: the same
        # replay with it, against without it (``PipelineCore.wire_s``).
        wire = (replay(entry, work, mb, lay.vp, core.fwd_share, cluster.cores, per_stage,
                       latency=core.wire_s) - shared if core.wire_s > 0 else 0.0)
    elif lay.pp > 1 and core.wire_s > 0:  # overlapping steps: the steady period's share
        work = [w + z for w in core.rank_work]
        wire = (entry.period(mb, work, lay.vp, core.fwd_share, core.wire_s)
                - entry.period(mb, work, lay.vp, core.fwd_share))
    scale = shared / pipeline
    slicing = 1.0 + cluster.time_slicing_penalty * min(1.0, crowd - 1.0)
    once_per_step = ("dp_comm", "compression", "optimizer")
    out = {k: v if k.endswith("_comm") else
           v * (crowd if k in once_per_step else scale) * slicing
           for k, v in breakdown.items()}
    if wire > 0:
        out["p2p_comm"] = out.get("p2p_comm", 0.0) + wire
    shared = sum(v for k, v in out.items() if k not in once_per_step)
    comm = sum(v for k, v in core.summed.items() if k.endswith("_comm")) + lay.pp * z
    compute_share = 1.0 - comm / max(core.work_sum + lay.pp * z, 1e-30)
    busy = mb * (core.work_sum + lay.pp * z) / lay.pp * (
        compute_share * crowd * slicing + (1.0 - compute_share))
    return shared, max(0.0, shared - busy), out


def simulate(m: ModelShape, lay: Layout, cluster: Cluster, eff: Efficiency | None = None,
             where: str = "layout", validate: bool = True,
             names: dict[str, str] | None = None) -> Prediction:
    """Predict one optimizer step of `m` under `lay` on `cluster`."""
    if validate:
        check(m, lay, cluster, where, names)
    return finish(pipeline_core(m, lay, cluster, eff), m, lay, cluster)
