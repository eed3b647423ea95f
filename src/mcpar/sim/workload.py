"""What is simulated: the model's shape, the parallel layout and the training settings.

The model is a ``ModelShape`` (``mcpar.registry.model_shape``, re-exported here): a config's is
its family's ``shape`` (the registry entry), a published preset's is its family's shape with the
published stacks' flags. A ``Layout`` holds the degrees and settings a run or a plan chooses.
``layout_problems`` lists every impossible combination, each naming the key at fault, so that a
bad CSV row or config fails with all its problems at once.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from functools import lru_cache

from mcpar.config.model import PUBLISHED_MODELS, ModelConfig, PublishedModel
from mcpar.errors import problem
from mcpar.registry.codec import ExchangeFacts, codec_problems
from mcpar.registry.model_family import MODEL_FAMILIES
from mcpar.registry.model_shape import FFN_KINDS, GATED_FFN, ModelShape
from mcpar.registry.recompute import RECOMPUTE_POLICIES, RecomputeFacts
from mcpar.registry.schedule import (
    SCHEDULES,
    default_schedule,
    schedule_placement,
    splits_backward,
    stage_rank,
    steps_overlap,
)
from mcpar.registry.zero import ZERO_STAGES, ZeroFacts, zero_stage

__all__ = ["CROSS_ENTROPY", "FFN_KINDS", "GATED_FFN", "MODEL_PRESETS", "Layout", "ModelPreset",
           "ModelShape", "layout_problems", "model_preset", "model_problems", "rank_layers",
           "stage_blocks"]
PRECISIONS = ("fp16", "bf16", "fp8", "fp32")
# default: ZeRO's flat shards; topology_aware: the hierarchical parameter store (ZeRO++ hpZ), a
# secondary copy of every block sharded inside the node so that backward gathers stay there.
ALLOCATION = ("default", "topology_aware")
WEIGHT_GATHER = ("none", "int8")  # ZeRO-3's forward gathers, block-quantized (ZeRO++ qwZ)
TOPOLOGY = ("flat", "hierarchical", "auto")
# math: the CPU composite scaled_dot_product_attention falls back to under dropout
# (``device_kernels.py``), which keeps its fp32 scores like an unfused kernel.
ATTENTION = ("auto", "flash", "unfused", "math")
# How attention runs over the context axis (cp > 1). 'ring' and 'ulysses' are mcpar's
# (``parallelism.context_mode``); 'flash_ring' is a published stack's ring (Transformer
# Engine's, under Megatron/NeMo): flash blocks, the key-value heads on the wire, dK/dV passed on
# while the next block computes. docs/cost_model.md ("Context parallelism").
CONTEXT_MODES = ("ring", "ulysses", "flash_ring")
# Which flash-style kernel a published run's attention ran (``compute.FLASH_KERNEL_SPEED``):
# FlashAttention-2 (or a kernel as fast: cuDNN's, torch's SDPA), FlashAttention-1, or the
# Triton port of FlashAttention that 2023 stacks (llm-foundry's ``attn_impl: triton``) used.
FLASH_KERNELS = ("fa2", "fa1", "triton")
# The cross-entropy's kernels (``compute.CE_BYTES``): fused, one pass each way over fp32 logits
# (mcpar's price), or Megatron's vocab-parallel cross-entropy, unfused (its default before
# --cross-entropy-loss-fusion).
CROSS_ENTROPY = ("fused", "megatron")
DEVICES = ("cuda", "cpu")


@dataclass(frozen=True)
class Layout:
    """Degrees (tp x pp x cp x dp = GPUs; ep is carved out of dp x cp) and step settings."""

    tp: int = 1
    pp: int = 1
    vp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    cp: int = 1
    context_mode: str = "flash_ring"  # see CONTEXT_MODES; only read when cp > 1
    dp: int = 1
    ep: int = 1
    zero_stage: int = 0
    seq_parallel: bool = False
    global_batch: int = 1  # sequences per optimizer step
    micro_batch: int = 1  # sequences per micro-batch per data-parallel rank
    recompute: str = "none"
    precision: str = "bf16"
    schedule: str = ""  # a registered pipeline schedule; '': 1f1b, or interleaved when vp > 1
    compression: str = "none"
    topology: str = "auto"  # flat ring, hierarchical, or the faster of the two per collective
    attention: str = "auto"  # flash | unfused | math; auto: unfused for fp16 (see costmodel docs)
    flash_kernel: str = "fa2"  # see FLASH_KERNELS; only read where the attention is flash
    cross_entropy: str = "fused"  # see CROSS_ENTROPY
    # Whose kernels the run uses where they keep different tensors (``device_kernels.py``):
    # dropout masks, and attention under dropout (a config's layout resolves the kernel).
    device: str = "cuda"
    powersgd_rank: int = 4
    allocation: str = "default"  # see ALLOCATION
    weight_gather: str = "none"  # see WEIGHT_GATHER
    # ZeRO-3: the MiB one parameter gather reaches with consecutive blocks (``gather_span``);
    # 0, the published stacks: one layer (one FSDP unit) per gather.
    gather_mb: float = 0.0
    # Gradient bucket, one collective call each. None: Megatron's rule, max(40M, 1M x dp)
    # elements, which keeps calls few on large data-parallel groups.
    bucket_mb: float | None = None
    # Pipeline sends carry 1/tp of the activation, all-gathered over NVLink at the receiver
    # (Megatron's scatter-gather); False: the whole activation crosses.
    p2p_split: bool = True
    # Tensor-parallel collectives split into chunks and pipelined with the GEMMs they feed or
    # drain (Transformer Engine's userbuffers, Megatron's --tp-comm-overlap; needs sequence
    # parallelism). mcpar's runtime does not do it: only published rows that ran it set it.
    tp_comm_overlap: bool = False
    # Besides ``recompute``'s policy, the backward reruns every second matrix product of a
    # block's forward and all its element-wise work, keeping the attention core's and the other
    # products' outputs: torchtitan's op-level selective checkpointing ('selective' with
    # selective_ac_option 'op'). A published stack's policy, priced only (mcpar does not run it;
    # memory is estimated as under ``recompute``'s policy).
    alternate_mm_recompute: bool = False
    # Data-parallel collectives overlapped with compute (gradients with the backward, gathers
    # with the forward) by the ``overlap`` share. False: the run's stack exchanges them between
    # the last backward and the optimizer step (DeepSpeed's pipeline engine, whose ReduceGrads
    # follows the schedule's last backward), all of it on the critical path.
    dp_overlap: bool = True
    # ZeRO-1 whose gradients are all-reduced whole, each rank then updating its shard of the
    # optimizer state and gathering the weights (DeepSpeed's BF16 optimizer, which its engine
    # hands to an all-reduce); False: reduce-scattered.
    grad_all_reduce: bool = False
    # Mixed precision by autocast (PyTorch AMP, mcpar's bfloat16): fp32 weights, gradients and
    # residual stream, 16-bit matmul inputs and outputs. False: 16-bit weight copies beside fp32
    # master weights (Megatron, DeepSpeed), the residual stream in 16 bits.
    autocast: bool = False
    # Layers of each of the pp x vp pipeline stages, first to last (stage s on rank s % pp);
    # empty: the even split of ``stage_blocks``.
    stages: tuple[int, ...] = ()
    # ``optimization.post_validation``: each pipeline rank steps its optimizer as soon as its
    # gradients are final, so steps overlap (``overlapped_steps``) and the update keeps a copy
    # of the rank's weights, gradients and optimizer state to redo a step guessed wrong.
    post_validation: bool = False

    def __post_init__(self) -> None:
        if not self.schedule:  # frozen: the default is filled in once, here
            object.__setattr__(self, "schedule", default_schedule(self.vp))

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def num_microbatches(self) -> int:
        return self.global_batch // (self.dp * self.micro_batch)

    @property
    def overlapped_steps(self) -> bool:
        """Each pipeline rank starts its next step as soon as its own update is done
        (``steps_overlap``): a step costs its schedule's steady period, not its span."""
        return steps_overlap(self.pp, self.post_validation)

    @property
    def reduces_every_backward(self) -> bool:
        """ZeRO 2/3 reduce-scatter the gradients after every backward (else once per step,
        the gradients held whole meanwhile): the stage entry's rule, which the runtime asks."""
        return zero_stage(self.zero_stage).reduces_every_backward(ZeroFacts(
            self.dp, pp=self.pp, vp=self.vp, cp=self.cp,
            splits_backward=splits_backward(self.schedule, self.pp)))

    @property
    def attention_kind(self) -> str:
        """Flash attention unless the run is fp16 without context parallelism: fp16 runs are the
        2020-22 Megatron generation, whose attention materialized the s x s scores (fused
        scale-mask-softmax, then dropout); bf16/fp8 stacks use fused flash-style kernels, and
        ring attention (cp > 1) needs them."""
        if self.attention != "auto":
            return self.attention
        return "unfused" if self.precision == "fp16" and self.cp == 1 else "flash"

    def with_(self, **changes: object) -> Layout:
        if "vp" in changes and "schedule" not in changes and \
                self.schedule == default_schedule(self.vp):
            changes["schedule"] = ""  # the default schedule follows the chunks per rank
        return replace(self, **changes)  # type: ignore[arg-type]

    def describe(self) -> str:
        text = f"tp{self.tp} pp{self.pp}"
        if self.vp > 1:
            text += f" vp{self.vp}"
        if self.cp > 1:
            text += f" cp{self.cp}" + ("-ulysses" if self.context_mode == "ulysses" else "")
        text += f" dp{self.dp}"
        if self.ep > 1:
            text += f" ep{self.ep}"
        return text


def stage_blocks(m: ModelShape, lay: Layout) -> list[int]:
    """Layers of each pipeline stage (pp x vp of them, first to last): ``lay.stages`` when the
    layout gives the cut (mcpar's cost-balanced one, see ``stages``), else Megatron's even split;
    when the count does not divide (DeepSpeed-style runs) the spare layers go to the middle
    stages, since the end stages also carry the embedding and the head."""
    if lay.stages:
        return list(lay.stages)
    return list(_even_split(m.layers, lay.pp * lay.vp))


# Cached: the planner and the calibration's fits price the same few splits millions of times.
@lru_cache(maxsize=4096)
def _even_split(layers: int, stages: int) -> tuple[int, ...]:
    base, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))
    counts = [base] * stages
    for i in order[:extra]:
        counts[i] += 1
    return tuple(counts)


def rank_layers(m: ModelShape, lay: Layout) -> list[float]:
    """Layers held by each pipeline rank (all its vp stages, placed as its schedule does)."""
    return list(_per_rank(tuple(stage_blocks(m, lay)), lay.pp,
                          schedule_placement(lay.schedule)))


@lru_cache(maxsize=4096)
def _per_rank(counts: tuple[int, ...], pp: int, placement: str) -> tuple[float, ...]:
    out = [0.0] * pp
    for stage, n in enumerate(counts):
        out[stage_rank(stage, pp, placement)] += n
    return tuple(out)


def model_problems(m: ModelShape, where: str) -> list[str]:
    out = []
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
        if getattr(m, key) < 1:
            out.append(problem(f"{where}.{key}", f"must be at least 1, got {getattr(m, key)}"))
    if out:
        return out
    if m.hidden % m.heads:
        out.append(problem(f"{where}.heads", f"{m.heads} heads do not divide hidden {m.hidden}"))
    if m.heads % m.kv_heads:
        out.append(problem(f"{where}.kv_heads",
                           f"{m.kv_heads} key/value heads do not divide {m.heads} heads"))
    if m.ffn_kind not in FFN_KINDS:
        out.append(problem(f"{where}.ffn_kind", f"{m.ffn_kind!r} is not one of {FFN_KINDS}"))
    if m.experts < 0 or (m.experts > 0 and not 1 <= m.top_k <= m.experts):
        out.append(problem(f"{where}.top_k", f"top_k {m.top_k} must be in 1..experts "
                                             f"({m.experts}) for an MoE model"))
    return out


def layout_problems(m: ModelShape, lay: Layout, num_gpus: int, gpus_per_node: int,
                    where: str, names: dict[str, str] | None = None) -> list[str]:
    """Every reason `lay` cannot run `m` on `num_gpus` GPUs (in nodes of `gpus_per_node`), each
    naming `where`.key (or, for keys in `names`, the name given there, e.g. a config key)."""
    out: list[str] = []

    def bad(key: str, msg: str) -> None:
        out.append(problem((names or {}).get(key, f"{where}.{key}"), msg))

    for key in ("tp", "pp", "vp", "cp", "dp", "ep", "global_batch", "micro_batch"):
        if getattr(lay, key) < 1:
            bad(key, f"must be at least 1, got {getattr(lay, key)}")
    if out:
        return out
    if lay.num_gpus != num_gpus:
        bad("num_gpus", f"tp {lay.tp} x pp {lay.pp} x cp {lay.cp} x dp {lay.dp} = "
                        f"{lay.num_gpus}, not {num_gpus}; change the degrees or the GPU count")
    if m.heads % lay.tp or m.kv_heads % lay.tp and lay.tp % m.kv_heads:
        bad("tp", f"tensor degree {lay.tp} does not split {m.heads} heads / {m.kv_heads} "
                  "key-value heads")
    # A tensor group spanning nodes, or an ffn that tp does not divide (frameworks pad it), is
    # priced rather than refused here: published runs may do either. The planner avoids both.
    if m.layers < lay.pp * lay.vp:
        bad("pp", f"{m.layers} layers cannot fill pp {lay.pp} x vp {lay.vp} stages")
    if lay.stages and (len(lay.stages) != lay.pp * lay.vp or sum(lay.stages) != m.layers
                       or min(lay.stages) < 1):
        bad("pp", f"stage cut {list(lay.stages)} does not place {m.layers} layers on pp "
                  f"{lay.pp} x vp {lay.vp} stages of at least one layer")
    if lay.seq_parallel and lay.tp == 1:
        bad("seq_parallel", "sequence parallelism shards over tensor ranks; it needs tp > 1")
    if m.seq_len % lay.cp or (m.seq_len // lay.cp) % (lay.tp if lay.seq_parallel else 1):
        bad("cp", f"seq_len {m.seq_len} does not split over cp {lay.cp}"
                  + (f" x tp {lay.tp}" if lay.seq_parallel else ""))
    if lay.cp > 1 and lay.context_mode not in CONTEXT_MODES:
        bad("context_mode", f"{lay.context_mode!r} is not one of {CONTEXT_MODES}")
    elif lay.cp > 1 and lay.context_mode == "flash_ring" and lay.attention in ("unfused",
                                                                                "math"):
        # mcpar's ring runs its own blocks and Ulysses the local kernel: only the published
        # ring needs a flash-style kernel.
        bad("cp", "a published stack's ring exchanges key/value blocks inside a flash-style "
                  "kernel")
    if (lay.dp * lay.cp) % lay.ep:
        bad("ep", f"expert degree {lay.ep} does not divide dp x cp = {lay.dp * lay.cp}")
    if lay.ep > 1 and not m.is_moe:
        bad("ep", "expert parallelism needs an MoE model (experts > 0)")
    if m.is_moe and m.experts % lay.ep:
        bad("ep", f"expert degree {lay.ep} does not divide {m.experts} experts")
    if lay.global_batch % (lay.dp * lay.micro_batch):
        bad("global_batch", f"{lay.global_batch} is not a multiple of dp {lay.dp} x "
                            f"micro_batch {lay.micro_batch}")
    if lay.vp > 1 and lay.pp == 1:
        bad("vp", "virtual stages need pp > 1")
    if str(lay.zero_stage) not in ZERO_STAGES:
        bad("zero_stage", ZERO_STAGES.unknown(str(lay.zero_stage)))
    if lay.recompute not in RECOMPUTE_POLICIES:
        bad("recompute", RECOMPUTE_POLICIES.unknown(lay.recompute))
    else:  # the policy's own rules (its registry entry)
        for field, text in RECOMPUTE_POLICIES.get(lay.recompute).problems(
                RecomputeFacts(is_moe=m.is_moe)):
            bad(field, text)
    for key, allowed in (("precision", PRECISIONS),
                         ("topology", TOPOLOGY),
                         ("attention", ATTENTION), ("flash_kernel", FLASH_KERNELS),
                         ("cross_entropy", CROSS_ENTROPY),
                         ("device", DEVICES),
                         ("allocation", ALLOCATION), ("weight_gather", WEIGHT_GATHER)):
        if getattr(lay, key) not in allowed:
            bad(key, f"{getattr(lay, key)!r} is not one of {allowed}")
    if lay.schedule not in SCHEDULES:
        bad("schedule", SCHEDULES.unknown(lay.schedule))
    elif lay.pp > 1 and (found := SCHEDULES.get(lay.schedule).problem(
            lay.pp, lay.num_microbatches, lay.vp)):
        bad(*found)
    # The codec's own rules (its registry entry): priced only where it runs.
    for field, text in codec_problems(lay.compression, exchange_facts(lay)):
        bad(field, text)
    # The store and the quantized gathers exist only where parameters are gathered (ZeRO-3);
    # int8 gradients only on the store's inter-node stage: nothing else would price them.
    if lay.allocation == "topology_aware" and lay.zero_stage != 3:
        bad("allocation", "'topology_aware' (the hierarchical parameter store) keeps a copy of "
                          "gathered parameters, which needs zero_stage 3")
    if lay.grad_all_reduce and lay.zero_stage != 1:
        bad("grad_all_reduce", "all-reducing whole gradients beside sharded optimizer state "
                               "describes ZeRO-1; it needs zero_stage 1")
    if lay.weight_gather != "none" and lay.zero_stage != 3:
        bad("weight_gather", f"{lay.weight_gather!r} quantizes ZeRO-3's parameter gathers; it "
                             "needs zero_stage 3")
    return out


# --- presets ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelPreset:
    shape: ModelShape
    global_batch: int  # sequences per step, as the model was trained
    precision: str
    note: str


def _preset(name: str, row: PublishedModel) -> ModelPreset:
    """The row's model as its family builds it, with the published stacks' flags (no linear
    biases, rotary positions, untied head, no shared expert, dropout masks kept)."""
    shape = MODEL_FAMILIES.get(row.kind).shape(ModelConfig(**row.model_keys()))
    shape = replace(shape, name=name, bias=False, learned_positions=False,
                    tied_embeddings=False, shared_expert=False, dropout=True)
    return ModelPreset(shape, row.global_batch, row.precision, row.note)


class _Presets(Mapping[str, ModelPreset]):
    """The published shapes of the config's table (``model.preset`` reads the same rows), made
    on the first lookup: the families are registered entries, loaded after this module."""

    def __init__(self) -> None:
        self._table: dict[str, ModelPreset] | None = None

    def _rows(self) -> dict[str, ModelPreset]:
        if self._table is None:
            self._table = {name: _preset(name, row) for name, row in PUBLISHED_MODELS.items()}
        return self._table

    def __getitem__(self, name: str) -> ModelPreset:
        return self._rows()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(PUBLISHED_MODELS)

    def __len__(self) -> int:
        return len(PUBLISHED_MODELS)

    def __contains__(self, name: object) -> bool:
        return name in PUBLISHED_MODELS


MODEL_PRESETS: Mapping[str, ModelPreset] = _Presets()


def model_preset(name: str, key: str = "--model") -> ModelPreset:
    from mcpar.errors import UserError

    if name not in MODEL_PRESETS:
        raise UserError(problem(key, f"unknown model preset {name!r}; known: "
                                     + ", ".join(MODEL_PRESETS)))
    return MODEL_PRESETS[name]


# The simulator's topology names as the config spells them ('auto' is mcpar's 'hybrid').
CONFIG_TOPOLOGY = {"flat": "flat", "hierarchical": "hierarchical", "auto": "hybrid"}


def exchange_facts(lay: Layout) -> ExchangeFacts:
    """What a codec's rules look at in `lay` (the same facts a config gives them)."""
    return ExchangeFacts(dp=lay.dp, ep=lay.ep, zero_stage=lay.zero_stage,
                         topology=CONFIG_TOPOLOGY.get(lay.topology, lay.topology),
                         allocation=lay.allocation)
