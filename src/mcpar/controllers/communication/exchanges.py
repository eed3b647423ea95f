"""Gradient-exchange strategies: how the data-parallel replicas agree on a step's gradient.

A strategy drives the bucketed gradient sync through one small interface (``active`` and
``launch`` for each full bucket, ``after_clip`` and ``discard_step`` around the update); nothing
outside sets flags on the sync, and the trainer never asks which optimizer it runs. Which one a
job runs is planned in ``grad_exchange.py``; each codec's entry (``codecs.py``) builds its own.

- ``AllReduceExchange``: each bucket averaged by the controller's data-parallel all-reduce, with
  the planned algorithm (flat, hierarchical, hybrid) and an optional fp16/bf16 cast on the wire;
  expert-parallel buckets over their replicas ('edp').
- ``ReduceScatterExchange``: ZeRO 1/2/3: each bucket reduce-scattered so that each rank receives
  its own shard's gradient only (the sharded optimizer then all-gathers the parameters).
- ``PowerSGDExchange``: low rank with error feedback, on the controller's communication thread,
  flat over the whole data axis.
- ``OneBitExchange``: 1-bit Adam: all-reduce before its freeze step, then its own compressed
  momentum exchange, bucket by bucket from the backward pass when the step allows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from mcpar.comm.communicator import CommHandle
from mcpar.comm.powersgd import PowerSGDCompressor
from mcpar.config import JobConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_sync import DataParallelGradSync, GradBucket
from mcpar.optim.onebit_adam import OneBitAdam


class AllReduceExchange:
    """Average each bucket with the controller's data-parallel all-reduce."""

    name = "allreduce"
    compressor: PowerSGDCompressor | None = None  # per-rank state a checkpoint keeps

    def __init__(self, comm: CommunicationController, codec: str = "none"):
        self.comm = comm
        self.codec = codec
        # The replicas a dense gradient is averaged over: data x context ranks.
        self.degree = comm.axis_size(comm.dims.grad_axis)

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




def onebit_exchange(cfg: JobConfig, overlap: bool, comm: CommunicationController,
                    sync: DataParallelGradSync, optimizer: OneBitAdam,
                    ) -> tuple[OneBitExchange, str]:
    """Exchange 1-bit Adam's momentum per gradient bucket from the backward pass where the
    step allows it; otherwise in one exchange after the backward pass."""
    why_not = None
    has_expert_buckets = any(b.expert for b in sync.buckets)
    if not overlap:
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
