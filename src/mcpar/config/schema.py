"""The job configuration's typed schema: one section per part of a job, a description and
bounds on every field. Names of registered decisions (pipeline schedules, gradient codecs) are
checked against their registries (``mcpar.registry``), plug-ins included.

Cross-field checks that need the world size (degrees multiply to it, batch divisibility) live in
``mcpar.plan.resolve_plan`` so that ``mcpar check``, ``mcpar train`` and ``mcpar simulate`` run
the same rules.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mcpar.config.model import (
    MAX_HIDDEN,
    MAX_LAYERS,
    ModelConfig,
)
from mcpar.registry import RegisteredName
from mcpar.registry.codec import CODECS
from mcpar.registry.recompute import RECOMPUTE_POLICIES
from mcpar.registry.schedule import DEFAULT_SCHEDULE, SCHEDULES

# The smallest streamed group of offloaded state (MiB): 10 KiB, below which each group's fixed
# cost (a read, a write, an update call) swamps the work it carries.
MIN_OFFLOAD_BUFFER_MB = 0.01


class _Section(BaseModel):
    # Unknown keys are errors (with a suggestion), never silently ignored. Frozen: once
    # validated a config is never written to; what a run derives from it lives in its JobPlan
    # (mcpar.plan), and a changed config is a new object (model_copy).
    # NaN and infinity are refused in every float field (they would pass `gt`/`le` bounds
    # vacuously or poison the run), and every number has an upper bound that a run can reach.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


# Upper bounds of the numeric fields. Generous: each is far above any model or cluster built
# today (GPT-3 175B is 96 layers, hidden 12288, sequence 2048; Llama 3 405B hidden 16384,
# vocabulary 128256; the seed runs on 1024 GPUs), and far below what overflows an index, a
# timedelta or an allocation. The model section's bounds are in mcpar.config.model.
MAX_DEGREE = 1 << 20  # a parallel degree: a million ranks
MAX_BATCH = 1 << 20  # sequences in one micro-batch, or micro-batches in one step
MAX_GLOBAL_BATCH = 1 << 30
MAX_STEPS = 10**9  # steps, intervals and step counts
MAX_COUNT = 10**6  # checkpoints kept, restarts, evaluation batches
MAX_SEED = 2**63 - 1  # torch.manual_seed takes a 64-bit integer
MAX_TIMEOUT_S = 30 * 86400.0  # 30 days; a datetime.timedelta overflows near 8.6e13 s


class DataConfig(_Section):
    source: str = Field(
        "stdlib",
        description="'stdlib' (this Python's standard-library sources), a text file, directory "
        "or glob, a pre-tokenized .bin file, a directory written by `mcpar prepare` (read "
        "shard by shard, streaming), or a weighted blend of such directories written as "
        "weight/directory pairs, e.g. '0.7 DIR1 0.3 DIR2' (each sequence comes from one source, "
        "in those proportions).",
        max_length=4096,
    )
    tokenizer: str = Field(
        "bytes", description="'bytes' (vocab 256), 'bpe' (trained on the training split), or a "
        "Hugging Face tokenizer.json (or a directory holding one): its vocabulary size is a "
        "floor that model.vocab_size must reach (it is not filled in), and its own "
        "end-of-document token (e.g. <|endoftext|>, </s>) separates documents; for a tokenizer "
        "without one, run `mcpar prepare --eos-token` and train on its output. With a prepared "
        "source it may be left at its default, or must name the tokenizer the shards used.",
        min_length=1, max_length=4096,
    )
    token_dtype: Literal["uint16", "uint32"] | None = Field(
        None, description="Element type of a pre-tokenized .bin source."
    )
    val_fraction: float = Field(
        0.01, gt=0.0, lt=0.5, description="Trailing fraction of the corpus held out for "
        "validation; for prepared shards, the last fraction (at least one) of each source's "
        "seq_len windows in shard order."
    )
    cache_dir: str | None = Field(
        None, description="Where a trained BPE tokenizer and its tokens are cached."
    )


class ParallelismConfig(_Section):
    auto: bool = Field(
        False, description="Let the planner choose the degrees, schedule, micro-batch, ZeRO "
        "stage, recompute and codec the cost model predicts fastest on this machine within the "
        "memory budget; keys set by hand stay as set (mcpar check prints the ranking).")
    data: int | None = Field(
        None, ge=1, le=MAX_DEGREE,
        description="Data-parallel degree; default: what the world size leaves.",
    )
    tensor: int = Field(1, ge=1, le=MAX_DEGREE,
                        description="Tensor-parallel degree (innermost, intra-node).")
    pipeline: int = Field(1, ge=1, le=MAX_DEGREE,
                          description="Pipeline-parallel degree (outermost).")
    experts: int = Field(
        1, ge=1, le=MAX_DEGREE, description="Expert-parallel degree, carved out of the data axis."
    )
    context: int = Field(
        1, ge=1, le=MAX_DEGREE,
        description="Context-parallel degree: each rank of a context group holds 1/N of every "
        "sequence (a balanced zigzag of 2N chunks: rank i holds chunks i and 2N-1-i), between "
        "the data and tensor axes; the parameters are replicated over it.")
    context_mode: Literal["ring", "ulysses"] = Field(
        "ring", description="Context parallelism's attention: 'ring' passes K/V blocks around "
        "the context group (online-softmax merge, dK/dV back around the ring); 'ulysses' "
        "trades sequence shards for head shards by all-to-all (heads must divide by context).")
    virtual_stages: int = Field(1, ge=1, le=MAX_LAYERS,
                                description="Pipeline stages per rank (interleaving).")
    sequence_parallel: bool = Field(False, description="Shard norms/dropout along the sequence.")
    schedule: Annotated[str, RegisteredName(SCHEDULES)] = Field(
        DEFAULT_SCHEDULE,
        description="Pipeline schedule (a registered one: mcpar.registry.schedule).")


class ComputeControllerConfig(_Section):
    scheduler: Literal["static", "greedy", "reinforcement"] = Field(
        "static", description="Expert load balancing under expert parallelism: 'static' "
        "keeps experts where they start; 'greedy' and 'reinforcement' move hot experts between "
        "expert-axis ranks (parameters and optimizer state) to even out the tokens per rank.",
    )
    balance_interval: int = Field(
        10, ge=1, le=MAX_STEPS, description="Steps between the load balancer's decisions.",
    )
    migration_cost: float = Field(
        0.02, ge=0.0, le=1000.0,
        description="Load balancer: the fraction of a step that moving one "
        "expert (parameters and optimizer state) is assumed to cost, weighed against the "
        "imbalance it removes (greedy's fixed price; reinforcement's until one is measured).",
    )
    balance_costs: Literal["measured", "modeled"] = Field("measured", description="Load "
        "balancer's costs: 'measured' times (expert compute per rank, all-to-all, migrations), "
        "or 'modeled' from token counts and migration_cost (bitwise reproducible on resume).")
    batch_splitting: Literal["fixed", "dynamic"] = Field(
        "fixed", description="'dynamic' lets the controller choose the number of micro-batches."
    )


class MemoryControllerConfig(_Section):
    allocation: Literal["default", "topology_aware"] = Field(
        "default", description="'topology_aware' (ZeRO-3): the hierarchical parameter "
        "store, a node-local copy of each gathered layer so backward gathers stay in the node.")
    offload: Literal["none", "cpu", "nvme"] = Field(
        "none", description="Where the AdamW state lives, streamed through the update group by "
        "group: 'cpu' host memory (CUDA only), 'nvme' files under offload_dir. fp32: the two "
        "moments move (8 B/param); bfloat16 without ZeRO: the model keeps bf16 copies and the "
        "offloaded state also holds the fp32 master weights (12 B/param).")
    offload_dir: str | None = Field(
        None, description="offload 'nvme': directory of the state files (one per rank, "
        "unlinked once open); default <run dir>/offload.")
    offload_buffer_mb: float = Field(
        64.0, gt=0.0, le=1e6, description="Offload: state per streamed group (MiB, at least "
        f"{MIN_OFFLOAD_BUFFER_MB}; below about 1 each group's fixed cost slows the step); nvme "
        "keeps two such buffers in host memory.")
    zero_stage: int = Field(0, ge=0, le=3, description="ZeRO sharding over the data axis (data "
                            "x context under context parallelism): 0 none, 1 optimizer state, "
                            "2 also gradients, 3 also parameters.")
    gather_mb: float = Field(1.0, ge=0.0, le=1e6, description="ZeRO-3: one parameter gather "
        "carries the fewest consecutive blocks holding this many MiB (small blocks: fewer, "
        "larger collectives; that many blocks plus one gathered at once). 0: one block each.")
    activation_checkpointing: Annotated[str, RegisteredName(RECOMPUTE_POLICIES)] = Field(
        "none", description="Activation recompute in the backward pass: 'selective' rebuilds "
        "each attention core (softmax(qk^T)v and its dropout), 'full' each block."
    )
    recompute_blocks: list[int] | None = Field(
        None, min_length=3, max_length=3, description="Blocks per recompute mode, [none, "
        "selective, full], summing to model.num_layers; the first blocks of the model recompute "
        "the most. Set by the MemoryController's placement to a memory budget when it mixes "
        "modes; none: every block follows activation_checkpointing.")
    consistency_interval: int = Field(
        100, ge=0, le=MAX_STEPS, description="Steps between checks that replicated tensors "
        "(data, tensor, expert replicas) still agree bit for bit; a mismatch restarts from the "
        "last valid checkpoint. 0: off.")
    memory_budget_gb: float | None = Field(
        None, gt=0.0, le=1e6,
        description="Memory per rank that plans may use; default 90% of a GPU, "
        "or the worker's share of 80% of host RAM. The MemoryController places to it: per "
        "block recompute, offload and the ZeRO stage (those not set) of the cheapest plan that "
        "fits (mcpar check prints the choice); dynamic batch splitting sizes micro-batches to it.",
    )

    @field_validator("offload_buffer_mb")
    @classmethod
    def _offload_buffer_floor(cls, mb: float) -> float:
        # Each streamed group costs a fixed round of Python work, a file read and a file write:
        # groups of a few bytes make the update hundreds of times slower for nothing.
        if mb < MIN_OFFLOAD_BUFFER_MB:
            raise ValueError(
                f"must be at least {MIN_OFFLOAD_BUFFER_MB} MiB, got {mb:g}: every streamed group "
                "costs a fixed overhead (a read, a write and an update call), so tiny groups "
                "make the optimizer step thousands of times slower; the default 64 streams at "
                "full speed (below about 1 MiB the overhead shows)")
        return mb


class CommunicationControllerConfig(_Section):
    compression: Annotated[str, RegisteredName(CODECS)] = Field(
        "none", description="Gradient compression codec (int8: the parameter store's inter-node "
        "reduce-scatter, with error feedback)."
    )
    weight_gather: Literal["none", "int8"] = Field(
        "none", description="ZeRO-3 forward parameter gathers: int8 block-quantized or not.")
    topology: Literal["flat", "hierarchical", "hybrid"] = Field(
        "flat", description="Collective algorithm: flat ring, hierarchical, or chosen per size."
    )
    bucket_size_mb: float = Field(
        25.0, gt=0.0, le=float(1 << 16),
        description="Gradient bucket size (MiB) for the bucketed all-reduce; "
        "under 1-bit Adam, also the unit of its compressed momentum exchange (one exchange per "
        "bucket; after the backward pass they are pipelined over the link)."
    )
    overlap: bool = Field(
        True, description="Launch bucket all-reduces during the backward pass. 1-bit Adam: "
        "exchange the momentum bucket by bucket from the backward pass (needs "
        "optimization.grad_clip 0, no sequence parallelism, no experts; else every bucket's "
        "exchange after it, pipelined, as the log says at start).")
    powersgd_rank: int = Field(
        8, ge=1, le=MAX_HIDDEN,
        description="PowerSGD: rank of the low-rank gradient approximation.",
    )
    powersgd_start_step: int = Field(
        10, ge=1, le=MAX_STEPS,
        description="PowerSGD: steps of plain all-reduce before compression starts.",
    )


class ClusterConfig(_Section):
    """What the CommunicationController knows of the machines (None = detected or measured)."""

    ranks_per_node: int | None = Field(
        None, ge=1, le=MAX_DEGREE,
        description="Ranks per node; default: detected (torchrun's GROUP_RANK, "
        "SLURM_NODEID, else the hostname). Setting it on one host emulates nodes.",
    )
    intra_node_bandwidth_gbps: float | None = Field(
        None, gt=0.0, le=1e6,
        description="Link model for topology 'hybrid': bandwidth inside a node "
        "(Gbit/s); default: measured at start.",
    )
    intra_node_latency_us: float | None = Field(
        None, ge=0.0, le=1e7,
        description="Link model: latency inside a node (microseconds); default: "
        "measured at start.",
    )
    inter_node_bandwidth_gbps: float | None = Field(
        None, gt=0.0, le=1e6, description="Link model: bandwidth between nodes (Gbit/s), one "
        "link per node shared by its ranks; also what parallelism.auto ranks a CPU job over "
        "nodes on; default: measured at start.",
    )
    inter_node_latency_us: float | None = Field(
        None, ge=0.0, le=1e7,
        description="Link model: latency between nodes (microseconds); default: "
        "measured at start.",
    )


class ControllersConfig(_Section):
    compute: ComputeControllerConfig = Field(default_factory=ComputeControllerConfig)
    memory: MemoryControllerConfig = Field(default_factory=MemoryControllerConfig)
    communication: CommunicationControllerConfig = Field(
        default_factory=CommunicationControllerConfig
    )


class CheckpointConfig(_Section):
    interval: int = Field(0, ge=0, le=MAX_STEPS, description="Save every N steps; 0 = off.")
    strategy: Literal["full", "selective"] = Field(
        "full",
        description="'full': every rank writes its parameters and optimizer state; 'selective': "
        "only data-parallel rank 0 of each (pipeline, tensor) shard writes them (replicas are "
        "identical). RNG states of every rank are saved either way.",
    )
    keep: int = Field(3, ge=1, le=MAX_COUNT, description="How many recent checkpoints to keep.")
    dir: str | None = Field(
        None, description="Checkpoint directory (shared by all ranks); default "
        "<run_dir>/checkpoints."
    )
    max_restarts: int | None = Field(
        None, ge=0, le=MAX_COUNT,
        description="Automatic restarts of a local job after a worker dies, each "
        "resuming from the newest valid checkpoint; default 3 when interval > 0, else 0.",
    )
    async_save: bool = Field(
        True, description="Save in the background: the state is copied to CPU memory before "
        "the next optimizer step and written and committed by a thread while training goes on; "
        "the next save, and the end of the run, wait for it. false: training waits for each "
        "save to be written and committed.",
    )
    load_from: str | None = Field(
        None, description="Start this run from a checkpoint of another run: its run directory "
        "(its newest valid checkpoint) or one of its checkpoints/step-N folders, resharded onto "
        "this run's layout. The state it holds is saved at once as this run's first "
        "checkpoint, so `mcpar checkpoint verify` can compare the two. Read only while this "
        "run's own checkpoint folder has no valid checkpoint: a restart resumes from its own.",
    )
    compression: Literal["none", "zstd"] = Field(
        "none", description="'zstd': compress the checkpoint's tensor files as they are written "
        "(needs the zstandard package); loading detects it. Checksums are of the files as "
        "written.",
    )

    @property
    def restarts(self) -> int:
        """``max_restarts`` with its default resolved."""
        if self.max_restarts is not None:
            return self.max_restarts
        return 3 if self.interval > 0 else 0


class OptimizationConfig(_Section):
    optimizer: Literal["adamw", "onebit_adam"] = Field("adamw", description="Optimizer.")
    lr: float = Field(
        3e-3, gt=0.0, le=1.0, description="Peak learning rate; at most 1: Adam moves every "
        "weight by about lr per step and weights start near 0.02, so a larger one can only "
        "diverge (1e300 overflows the update itself).",
    )
    min_lr_ratio: float = Field(
        0.1, ge=0.0, le=1.0, description="Final LR of the cosine decay, as a fraction of lr."
    )
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS, description="Linear LR warmup steps.")
    weight_decay: float = Field(
        0.1, ge=0.0, le=1e6, description="Weight decay: decoupled under adamw, where each step "
        "multiplies the weights by 1 - lr x weight_decay, so lr x weight_decay must be below 1 "
        "(at 1 or more the weights are zeroed or flip sign and grow until the loss is NaN); "
        "added to the gradient under onebit_adam.",
    )
    beta1: float = Field(0.9, ge=0.0, lt=1.0, description="Adam beta1.")
    beta2: float = Field(0.95, ge=0.0, lt=1.0, description="Adam beta2.")
    grad_clip: float = Field(
        1.0, ge=0.0, le=1e6, description="Global gradient-norm clip; 0 = off."
    )
    post_validation: bool = Field(
        False, description="Pipeline: each rank steps its optimizer as soon as its own "
        "gradients are final, assuming every gradient finite and the global norm under "
        "grad_clip, and checks that one step later, redoing both steps where it was wrong; "
        "steps then overlap, and a schedule built for it (zbv) loses no fill per step. Keeps a "
        "copy of the rank's parameters, gradients and optimizer state.",
    )
    freeze_step: int = Field(
        50, ge=1, le=MAX_STEPS,
        description="onebit_adam: steps of full Adam (uncompressed gradients) before "
        "the variance is frozen and the momentum is exchanged in 1 bit per element; 15-25% of "
        "training.steps is the usual choice.",
    )
    micro_batch_size: int = Field(
        16, ge=1, le=MAX_BATCH, description="Sequences per micro-batch per data-parallel rank."
    )
    gradient_accumulation: int | None = Field(
        None,
        ge=1,
        le=MAX_BATCH,
        description="Micro-batches per step; default 1, or derived from global_batch_size.",
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        le=MAX_GLOBAL_BATCH,
        description="Sequences per optimizer step; must equal micro_batch_size x "
        "gradient_accumulation x data. Lets one config keep its batch across layouts.",
    )
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)


class ProfileConfig(_Section):  # a profiled window of a run: <run_dir>/profile/ (mcpar.profiler)
    enabled: bool = Field(False, description="Profile `steps` steps from `start_step` on.")
    start_step: int = Field(2, ge=1, le=MAX_STEPS, description="First profiled step (1-based).")
    steps: int = Field(3, ge=1, le=MAX_STEPS, description="Steps in the profiled window.")
    trace: bool = Field(True, description="A torch.profiler trace per rank (+ CUDA snapshot).")
    trace_detail: Literal["steps", "kernels", "ops"] = Field(
        "steps", description="What each trace file keeps. steps: the ranges mcpar opens (every "
        "step, task and collective) and torch's own annotations, the smallest file; kernels: "
        "those and the device's kernels and copies (CUDA; on CPU the same as steps); ops: "
        "everything torch.profiler records, every host operator, allocation and kernel launch "
        "too (hundreds of times larger for a small model). The report's figures are the same "
        "at every level.")


class WandbConfig(_Section):  # Weights & Biases sink of metrics.jsonl (the 'wandb' extra)
    enabled: bool = Field(False, description="Log every metrics field to Weights & Biases.")
    project: str = Field("mcpar", min_length=1, max_length=128, description="W&B project.")
    mode: Literal["offline", "online"] = Field("offline", description="offline: no network.")


class ElasticConfig(_Section):  # training.elastic: a job that goes on with fewer nodes
    min_world: int = Field(
        ..., ge=1, le=MAX_DEGREE * MAX_DEGREE,
        description="The fewest workers the job may go on with. When the launcher starts the "
        "workers on a smaller world than the layout asks (torchrun --nnodes MIN:MAX after a "
        "node is lost), the data degree shrinks to what the world holds (tensor, pipeline, "
        "context and expert degrees kept) and the micro-batches per step grow so that the "
        "global batch stays the same; the job resumes from its newest valid checkpoint, "
        "resharded. Fewer workers, or a world the other degrees do not divide, is refused.",
    )
    wait_s: float = Field(
        30.0, ge=1.0, le=MAX_TIMEOUT_S,
        description="How long a collective waits for a peer before the peer counts as lost "
        "(the process groups' timeout, when shorter than training.collective_timeout_s): the "
        "failed workers exit and the launcher restarts them on the nodes that are left.",
    )
    grow: bool = Field(
        True, description="Take a node that comes back into the running job. Under torchrun "
        "--nnodes MIN:MAX the agents answer a returning node with a new rendezvous round on "
        "the larger world; the workers stop with a checkpoint of the step they were in, and "
        "the larger world resumes it resharded onto the asked layout (an elastic record, "
        "direction grow); start the agents with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without "
        "which a returning node waits for a store address torch's rank-0 agent never writes. "
        "false is refused: the agents take a returning node whatever the job says; restart "
        "torchrun with --nnodes MIN:<nodes left> to keep it out.",
    )

    @field_validator("grow")
    @classmethod
    def _grow_is_the_agents(cls, grow: bool) -> bool:
        if not grow:
            raise ValueError(
                "cannot be kept: torchrun's agents take a node that comes back (up to --nnodes "
                "MAX) whatever the job says; remove the key, and restart torchrun with "
                "--nnodes MIN:<nodes left> to keep returning nodes out")
        return grow


class TrainingConfig(_Section):
    steps: int = Field(300, ge=1, le=MAX_STEPS, description="Optimizer steps to run.")
    seed: int = Field(
        1234, ge=0, le=MAX_SEED, description="Seed of the model init and of the data order; "
        "at most 2**63 - 1 (torch takes a 64-bit seed).",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="'auto' takes CUDA when present, else CPU, and logs the choice."
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32", description="Compute dtype; bfloat16 is autocast mixed precision."
    )
    eval_interval: int = Field(
        50, ge=0, le=MAX_STEPS, description="Validation every N steps; 0 = only at end."
    )
    collective_timeout_s: float = Field(
        300.0, ge=1.0, le=MAX_TIMEOUT_S, description="A collective that does not complete "
        "within this time (1 s to 30 days) fails "
        "the job (naming the operation, the axis and the ranks that never timed out, i.e. the "
        "stalled ones), which then restarts from its last checkpoint like after a crash.",
    )
    max_nonfinite_steps: int = Field(
        5, ge=1, le=MAX_STEPS,
        description="A step whose loss or gradients are NaN/Inf on any rank is skipped "
        "(no update, counted as 'skipped' in metrics.jsonl); this many in a row stop the run "
        "with an error.",
    )
    eval_batches: int = Field(
        4, ge=1, le=MAX_COUNT,
        description="Validation global batches per evaluation (the same ones each time)."
    )
    log_interval: int = Field(1, ge=1, le=MAX_STEPS, description="Write metrics every N steps.")
    tensorboard: bool = Field(False, description="Also log scalars to <run_dir>/tensorboard.")
    progress: bool = Field(True, description="Show a progress bar on rank 0.")
    compile: bool = Field(
        False, description="torch.compile each transformer block (after the parallelisms and "
        "recompute; CPU: inductor's C++ backend, which needs a C++ compiler). The first step's "
        "compile time is logged as compile_s, apart from step_time_s.",
    )
    elastic: ElasticConfig | None = Field(
        None, description="Go on with fewer workers when a node is lost (off when unset); "
        "e.g. {min_world: 2}.")
    profile: ProfileConfig = Field(default_factory=ProfileConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)


class JobConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    parallelism: ParallelismConfig = Field(default_factory=ParallelismConfig)
    controllers: ControllersConfig = Field(default_factory=ControllersConfig)
    optimization: OptimizationConfig = Field(default_factory=OptimizationConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)


# --- the seed's French keys and values ------------------------------------------------------

# Per section path, French key -> canonical key.
