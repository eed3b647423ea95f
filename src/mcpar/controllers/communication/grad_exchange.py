"""Gradient-exchange strategies: how the data-parallel replicas agree on a step's gradient.

The CommunicationController chooses ONE strategy when the job is planned
(:func:`plan_grad_exchange`, recorded in the run's ``plan.json``) and builds it with the job
(:func:`build_grad_exchange`). The strategy drives the bucketed gradient sync through one small
interface (``active`` and ``launch`` for each full bucket, ``after_clip`` and ``discard_step``
around the update); nothing outside sets flags on the sync, and the trainer never asks which
optimizer it runs.

- ``allreduce``: each bucket is averaged by the controller's data-parallel all-reduce, with the
  planned algorithm (flat, hierarchical, or per bucket size: hybrid) and an optional fp16/bf16
  cast on the wire. Expert-parallel buckets are reduced over their replicas ('edp').
- ``powersgd``: each bucket is compressed to low rank with error feedback, on the controller's
  communication thread, over the whole data axis (flat only: see ``grad_exchange_problems``).
- ``reduce_scatter``: ZeRO (``controllers.memory.zero_stage`` 1 or 2): each bucket is averaged
  by a reduce-scatter over its replicas, so that each rank receives the gradient of its own
  shard of the bucket only; the MemoryController's sharded optimizer then steps that shard and
  all-gathers the parameters (together the bytes of one all-reduce).
- ``onebit``: 1-bit Adam. Before its freeze step it is ``allreduce``; past it the optimizer
  exchanges its momentum in 1 bit, bucket by bucket from the backward pass when the step allows,
  otherwise all together right after clipping, and the sync launches nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Protocol

import torch

from mcpar.comm.communicator import CommHandle
from mcpar.comm.powersgd import PowerSGDCompressor
from mcpar.config import JobConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_sync import DataParallelGradSync, GradBucket
from mcpar.errors import problem
from mcpar.optim.onebit_adam import OneBitAdam


@dataclass(frozen=True)
class GradExchangePlan:
    """The planned gradient exchange of a job."""

    strategy: str  # 'none', 'allreduce', 'reduce_scatter' (ZeRO), 'powersgd' or 'onebit'
    topology: str  # the data axis' algorithm: 'flat', 'hierarchical' or 'hybrid'
    codec: str  # what crosses the wire: 'none', 'fp16', 'bf16', 'powersgd' or '1bit'
    bucket_size_mb: float
    overlap: bool  # buckets start reducing from the backward pass

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def uses_onebit_adam(cfg: JobConfig) -> bool:
    """1-bit Adam runs when either key asks for it: it is AdamW whose momentum is exchanged
    in 1 bit past the freeze step."""
    return (cfg.controllers.communication.compression == "1bit"
            or cfg.optimization.optimizer == "onebit_adam")


def plan_grad_exchange(cfg: JobConfig, dp: int) -> GradExchangePlan:
    """The controller's choice of gradient exchange for this config and data degree."""
    comm = cfg.controllers.communication
    if cfg.controllers.memory.zero_stage > 0:
        strategy, codec = "reduce_scatter", "none"
    elif uses_onebit_adam(cfg):
        strategy, codec = "onebit", "1bit"
    elif comm.compression == "powersgd":
        strategy, codec = "powersgd", "powersgd"
    else:
        strategy, codec = "allreduce", comm.compression
    if dp == 1:
        strategy, codec = "none", "none"
    topology = comm.topology if dp > 1 else "flat"
    return GradExchangePlan(strategy, topology, codec, comm.bucket_size_mb, comm.overlap)


def grad_exchange_problems(cfg: JobConfig) -> list[str]:
    """Gradient-exchange settings that cannot work as described."""
    comm = cfg.controllers.communication
    problems = []
    if comm.compression == "powersgd" and comm.topology != "flat":
        # PowerSGD's factors are all-reduced over one group; a hierarchical run would have to
        # reduce inside the node first and compress only what crosses nodes. That path does
        # not exist, so the combination is refused rather than silently run flat.
        problems.append(problem(
            "controllers.communication.topology",
            f"{comm.topology!r} cannot be combined with compression 'powersgd', which runs "
            "over the whole data axis in one group; use topology 'flat' with PowerSGD, or "
            "compression '1bit' / 'fp16' / 'bf16' with a hierarchical topology",
        ))
    return problems


class AllReduceExchange:
    """Average each bucket with the controller's data-parallel all-reduce."""

    name = "allreduce"
    compressor: PowerSGDCompressor | None = None  # per-rank state a checkpoint keeps

    def __init__(self, comm: CommunicationController, codec: str = "none"):
        self.comm = comm
        self.codec = codec
        self.degree = comm.axis_size("dp")

    @property
    def active(self) -> bool:
        return True

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        if self.degree > 1:
            # Divide first: the sum of averages stays in range for low-precision buffers.
            bucket.buffer.div_(self.degree)
        if bucket.expert:
            return self.comm.all_reduce(bucket.buffer, axis="edp", async_op=True)
        return self.comm.dp_all_reduce(bucket.buffer, codec=self.codec, async_op=True)

    def after_clip(self) -> None:
        """Called once the gradients are final and clipped, before the update."""

    def discard_step(self) -> None:
        """Called when the step is skipped (non-finite values somewhere)."""


class ReduceScatterExchange(AllReduceExchange):
    """ZeRO: average each bucket into this rank's shard with a reduce-scatter over its
    replicas ('dp', or 'edp' for expert buckets); the sync says where the shard goes."""

    name = "reduce_scatter"
    # ZeRO-3: the MemoryController's parameter store reduces (flat or node by node) and frees
    # the layer's parameters; None: a reduce-scatter over the bucket's axis.
    reducer: Callable[[GradBucket], CommHandle] | None = None

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        assert bucket.scatter_out is not None, "ZeRO buckets carry their shard"
        if self.reducer is not None:
            return self.reducer(bucket)
        if self.degree > 1:
            bucket.buffer.div_(self.degree)  # the data degree, as for an all-reduce
        return self.comm.reduce_scatter_into(bucket.scatter_out, bucket.buffer, axis=bucket.axis,
                                             async_op=True)


class PowerSGDExchange(AllReduceExchange):
    """Low-rank compression with error feedback, bucket by bucket on the communication thread."""

    name = "powersgd"

    def __init__(self, comm: CommunicationController, compressor: PowerSGDCompressor):
        super().__init__(comm)
        self.compressor = compressor

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        if bucket.expert:
            return super().launch(bucket)
        grads = [p.grad for p in bucket.params]
        index, compressor, comm = bucket.index, self.compressor, self.comm
        return comm.run_async(lambda: compressor.reduce(grads, comm, "dp", key=index))


class OneBitExchange(AllReduceExchange):
    """1-bit Adam: all-reduce during its warm-up, then its own compressed momentum exchange."""

    name = "onebit"

    def __init__(self, comm: CommunicationController, optimizer: OneBitAdam,
                 from_backward: bool):
        super().__init__(comm)
        self.optimizer = optimizer
        self.from_backward = from_backward

    @property
    def active(self) -> bool:
        # Past the freeze step the buckets go to the momentum exchange, and only when it is
        # started from the backward pass.
        return not self.optimizer.compressing or self.from_backward

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        if not self.optimizer.compressing:
            return super().launch(bucket)
        # The optimizer's step waits for the exchange and commits it: no handle here.
        self.optimizer.launch_exchange(bucket.index, bucket.buffer)
        return None

    def after_clip(self) -> None:
        if self.optimizer.compressing and not self.from_backward:
            # Start from the clipped gradients now, so that the step's world collective
            # overlaps the exchange.
            self.optimizer.launch_all_exchanges()

    def discard_step(self) -> None:
        if self.optimizer.compressing:
            self.optimizer.discard_exchanges()  # its error feedback stays as it was


class GradExchange(Protocol):
    """The one interface through which a strategy drives the gradient sync and the update."""

    name: str
    compressor: PowerSGDCompressor | None  # per-rank codec state a checkpoint keeps

    @property
    def active(self) -> bool:
        """Whether the sync launches buckets this step."""
        ...

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        """Start reducing a full bucket."""
        ...

    def after_clip(self) -> None:
        """The gradients are final and clipped; the update follows."""
        ...

    def discard_step(self) -> None:
        """The step is skipped (non-finite values somewhere)."""
        ...


def build_grad_exchange(plan: GradExchangePlan, cfg: JobConfig, comm: CommunicationController,
                        sync: DataParallelGradSync, optimizer: torch.optim.Optimizer,
                        seed: int) -> tuple[GradExchange, str]:
    """The planned strategy, wired into ``sync``; and a line for the start-up log saying what
    runs."""
    exchange: GradExchange
    if plan.strategy == "powersgd":
        compressor = PowerSGDCompressor(cfg.controllers.communication.powersgd_rank,
                                        start_iter=cfg.controllers.communication
                                        .powersgd_start_step, seed=seed)
        exchange = PowerSGDExchange(comm, compressor)
        text = (f"gradient exchange: PowerSGD rank {compressor.rank}, flat over "
                f"{comm.axis_size('dp')} data-parallel ranks")
    elif plan.strategy == "onebit":
        if not isinstance(optimizer, OneBitAdam):
            raise ValueError("the onebit gradient exchange needs the OneBitAdam optimizer")
        exchange, text = _onebit_exchange(cfg, comm, sync, optimizer)
    elif plan.strategy == "reduce_scatter":
        exchange = ReduceScatterExchange(comm)
        text = (f"gradient exchange: ZeRO stage {cfg.controllers.memory.zero_stage}, "
                f"reduce-scatter over {comm.axis_size('dp')} data-parallel ranks")
    else:
        exchange = AllReduceExchange(comm, plan.codec if plan.codec in ("fp16", "bf16")
                                     else "none")
        text = f"gradient exchange: {plan.topology} all-reduce" + (
            f", {plan.codec} on the wire" if plan.codec in ("fp16", "bf16") else "")
    sync.set_exchange(exchange)
    return exchange, text


def _onebit_exchange(cfg: JobConfig, comm: CommunicationController, sync: DataParallelGradSync,
                     optimizer: OneBitAdam) -> tuple[OneBitExchange, str]:
    """Exchange 1-bit Adam's momentum per gradient bucket from the backward pass where the
    step allows it; otherwise in one exchange after the backward pass."""
    why_not = None
    has_expert_buckets = any(b.expert for b in sync.buckets)
    if not cfg.controllers.communication.overlap:
        why_not = "controllers.communication.overlap is false"
    elif cfg.optimization.grad_clip > 0:
        why_not = ("optimization.grad_clip > 0 needs the whole gradient's norm before the "
                   "momentum is formed; set it to 0 to overlap")
    elif cfg.parallelism.sequence_parallel:
        why_not = "sequence parallelism synchronizes some gradients after the backward pass"
    elif has_expert_buckets:
        why_not = "expert-parallel buckets are not exchanged per bucket"
    # One exchange per gradient bucket: from the backward pass, or, after it, all started
    # together and pipelined. A single bucket keeps the optimizer's own flat order.
    per_bucket = not has_expert_buckets and (why_not is None or len(sync.buckets) > 1)
    if per_bucket:
        optimizer.set_exchange_buckets([b.params for b in sync.buckets])
    count = len(sync.buckets) if per_bucket else 1
    where = (f"{count} bucket(s), each started from the backward pass" if why_not is None else
             f"{count} exchange(s), pipelined, started after the backward pass ({why_not})")
    return (OneBitExchange(comm, optimizer, from_backward=why_not is None),
            f"1-bit Adam momentum exchange: {where}")
