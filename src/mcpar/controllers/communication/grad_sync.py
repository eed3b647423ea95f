"""Data parallelism: bucketed gradient all-reduce overlapped with the backward pass.

Written here rather than wrapping the model in ``DistributedDataParallel`` because the
CommunicationController must own every collective (to count bytes and time per axis and codec, and,
in later stages, to compress or run them hierarchically), which DDP's C++ reducer does not allow.

Mechanism (the one DDP uses, kept small):
- Parameters are grouped into buckets of about ``bucket_size_mb``, in reverse registration order,
  because the backward pass produces the gradients of the last layers first. (A small first
  bucket, as DDP makes, was measured 5% slower on 2 CPU workers: one more gloo collective whose
  thread competes with the backward for the same core. Lower ``bucket_size_mb`` where compute
  and communication have their own engines.)
- Each parameter's ``.grad`` is a view into its bucket's flat buffer, so autograd accumulates
  straight into the buffer and no copy is needed before or after the all-reduce.
- A post-accumulate-grad hook counts ready parameters; when a bucket is full it is launched
  asynchronously. Buckets are launched strictly in bucket order on every rank, because collectives
  on a process group must be issued in the same order everywhere.
- Only armed parameters count (``arm``): the ComputeController arms a chunk's parameters right
  before that chunk's last backward of the step, so gradient accumulation never synchronizes
  and, under a pipeline, each chunk's buckets start reducing while the schedule goes on.
- What a full bucket's reduction is belongs to the job's gradient-exchange strategy
  (``grad_exchange.py``): an all-reduce (flat, hierarchical or hybrid; fp16/bf16 on the wire),
  PowerSGD on the communication thread, or 1-bit Adam's momentum exchange.
- Expert-parallel parameters (parallel/expert.py) differ between the ranks of an expert group:
  they have buckets of their own, summed over the 'edp' axis (their replicas) and divided by the
  data degree like every other gradient.

With ZeRO (``controllers/memory/zero.py``) each bucket is padded to a multiple of its reduction
degree and reduce-scattered: this rank keeps the averaged gradient of its shard only
(``GradBucket.shard``). Stage 1 keeps the bucket's full buffer as ``.grad`` views, as above.
Stage 2 releases it (``release_grads``): autograd writes each parameter's ``.grad`` afresh; once
a bucket's parameters are all ready, their gradients are copied into a buffer of the bucket,
freed, and the buffer is reduce-scattered and freed in turn, so the full gradient never exists
at once. That happens in every backward pass ("round"; the ComputeController arms each one):
with gradient accumulation a stage-2 step reduce-scatters once per micro-batch (M times the
bytes of stage 1, which reduces once per step) and sums the shards. Every round launches every
bucket exactly once, in bucket order (from the hooks when complete, else when the round ends),
so the collectives match on every rank whatever the hooks saw. Where the MemoryController's plan
says so (a schedule that splits the backward, or several chunks per rank: the stage entry's
``reduces_every_backward``), the step is one round: the fresh gradients accumulate whole over
the micro-batches and each bucket is reduce-scattered once, as stage 1 does, then freed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mcpar.comm.communicator import CommHandle
from mcpar.parallel.expert import is_expert_sharded

# Under ZeRO: (axis, degree, this rank's position) of the dense and of the expert
# reduce-scatter (the MemoryController's plan decides the dense axis: 'dp', or 'dp_cp').
ShardSpec = tuple[tuple[str, int, int], tuple[str, int, int]]


class BucketExchange(Protocol):
    """What a gradient-exchange strategy offers the bucketed sync (see ``grad_exchange.py``)."""

    @property
    def active(self) -> bool:
        """Whether buckets are launched this step (False: the strategy moves the gradients
        itself, after the backward pass)."""
        ...

    def launch(self, bucket: GradBucket) -> CommHandle | None:
        """Start the reduction of a full bucket; a handle to wait for, or None."""
        ...


@dataclass
class GradBucket:
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    index: int = 0
    num_ready: int = 0
    handle: CommHandle | None = None
    launched: bool = False
    param_ids: set[int] = field(default_factory=set)
    expert: bool = False  # expert-parallel parameters: reduced over 'edp', not 'dp'
    dense_axis: str = "dp"  # ZeRO's axis of a dense bucket ('dp_cp' under context parallelism)
    offsets: list[int] = field(default_factory=list)  # each parameter's place in the buffer
    numel: int = 0  # the buffer's length, padded to a multiple of ``degree``
    degree: int = 1  # ranks the bucket is reduce-scattered over (ZeRO), else 1
    shard: torch.Tensor | None = None  # ZeRO: this rank's averaged gradient shard
    # ZeRO: where the reduce-scatter writes (the shard itself, or a round's part to add to it)
    scatter_out: torch.Tensor | None = None
    pending: list[tuple[CommHandle | None, torch.Tensor]] = field(default_factory=list)

    @property
    def axis(self) -> str:
        return "edp" if self.expert else self.dense_axis


class DataParallelGradSync:
    """Bucketed gradient synchronization over the data-parallel axis; what a bucket's
    reduction is belongs to the exchange strategy (``set_exchange``)."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_size_mb: float = 25.0,
                 overlap: bool = True, shards: ShardSpec | None = None,
                 release_grads: bool = False,
                 groups: list[list[torch.nn.Parameter]] | None = None,
                 reduce_every_backward: bool = True):
        """``shards``: under ZeRO, the (axis, degree, this rank's position) of the dense
        buckets' reduce-scatter and of the expert buckets'; None for all-reduce. ``release_grads``:
        ZeRO stages 2 and 3 (see the module's docstring). ``groups``: the buckets' parameters,
        in launch order (stage 3: one per layer and kind); default: cut by size.
        ``reduce_every_backward``: with ``release_grads``, whether every backward is a round
        (the MemoryController's plan decides it); False: one round per step, armed before each
        chunk's last backward, the gradients accumulating whole until then."""
        self.overlap = overlap
        self.exchange: BucketExchange | None = None
        self.release_grads = release_grads
        self.reduce_every_backward = reduce_every_backward
        self.buckets = self._make_buckets([p for p in params if p.requires_grad],
                                          int(bucket_size_mb * 2**20), shards,
                                          views=not release_grads, groups=groups)
        self._round_open = False
        self._next_launch = 0
        self._bucket_of: dict[int, GradBucket] = {}
        self._armed: set[int] = set()
        # Called with each bucket's index when its reduction starts (the ComputeController's
        # task log).
        self.on_launch: Callable[[int], None] | None = None
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def set_exchange(self, exchange: BucketExchange) -> None:
        self.exchange = exchange

    @staticmethod
    def _size_groups(params: list[torch.nn.Parameter],
                     bucket_bytes: int) -> list[list[torch.nn.Parameter]]:
        """Buckets of about ``bucket_bytes``, in reverse registration order (backward order)."""
        groups: list[list[torch.nn.Parameter]] = []
        size = 0
        for p in reversed(params):
            nbytes = p.numel() * p.element_size()
            # A new bucket starts when this one is full or the dtype/device changes.
            if (not groups or size + nbytes > bucket_bytes and groups[-1]
                    or groups[-1][0].dtype != p.dtype or groups[-1][0].device != p.device
                    or is_expert_sharded(groups[-1][0]) != is_expert_sharded(p)):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        return groups

    @staticmethod
    def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int,
                      shards: ShardSpec | None = None, views: bool = True,
                      groups: list[list[torch.nn.Parameter]] | None = None,
                      ) -> list[GradBucket]:
        if groups is None:
            groups = DataParallelGradSync._size_groups(params, bucket_bytes)
        buckets = []
        for index, group in enumerate(groups):
            expert = is_expert_sharded(group[0])
            axis, degree, rank = ("dp", 1, 0) if shards is None else shards[1 if expert else 0]
            offsets = [0]
            for p in group:
                offsets.append(offsets[-1] + p.numel())
            numel = -(-offsets[-1] // degree) * degree  # padded: equal shards
            kind = {"dtype": group[0].dtype, "device": group[0].device}
            buffer = torch.zeros(numel if views else 0, **kind)
            if views:
                for p, offset in zip(group, offsets, strict=False):
                    p.grad = buffer[offset:offset + p.numel()].view_as(p)
            shard = None
            if shards is not None:
                # Stage 1: the shard is this rank's slice of the full buffer (no second copy);
                # stage 2: a tensor of its own, the only gradient kept between rounds.
                size = numel // degree
                shard = (buffer.view(degree, size)[rank] if views else
                         torch.zeros(size, **kind))
            buckets.append(GradBucket(group, buffer, index, param_ids={id(p) for p in group},
                                      expert=expert, dense_axis="dp" if expert else axis,
                                      offsets=offsets[:-1], numel=numel,
                                      degree=degree, shard=shard))
        return buckets

    @property
    def _idle(self) -> bool:
        """No bucket is launched this step."""
        return self.exchange is None or not self.exchange.active

    @property
    def grad_bytes(self) -> int:
        """Bytes of all gradients this rank synchronizes per step."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            if self.release_grads:
                for p in bucket.params:
                    p.grad = None
            else:
                bucket.buffer.zero_()
            if bucket.shard is not None:
                bucket.shard.zero_()

    def arm(self, params: list[torch.nn.Parameter]) -> None:
        """Count these parameters' next gradient: their last backward of the step is next
        (under ZeRO stage 2 reducing every backward: every backward, and the previous round ends
        here; reducing once per step, the step is the round)."""
        if self._idle:
            return
        if self.release_grads:
            if self.reduce_every_backward or not self._round_open:
                self._end_round()
            self._round_open = True
        self._armed.update(id(p) for p in params if id(p) in self._bucket_of)

    def _end_round(self) -> None:
        """Stage 2: launch, in order, every bucket the hooks did not launch this round."""
        if self._round_open:
            for bucket in self.buckets[self._next_launch:]:
                self._launch(bucket)
        self._round_open = False
        self._next_launch = 0
        for bucket in self.buckets:
            bucket.num_ready = 0
            bucket.launched = False

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if id(param) not in self._armed:
            return
        self._armed.discard(id(param))
        if not self.overlap:
            return
        bucket = self._bucket_of[id(param)]
        bucket.num_ready += 1
        # Launch every leading bucket that is complete, in bucket order.
        while (self._next_launch < len(self.buckets)
               and self.buckets[self._next_launch].num_ready
               == len(self.buckets[self._next_launch].params)):
            self._launch(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch(self, bucket: GradBucket) -> None:
        assert self.exchange is not None
        if self.on_launch is not None:
            self.on_launch(bucket.index)
        if self.release_grads:
            self._gather_released(bucket)
        if bucket.shard is not None:
            bucket.scatter_out = torch.empty_like(bucket.shard)
        bucket.handle = self.exchange.launch(bucket)
        bucket.launched = True
        if bucket.scatter_out is not None:
            # The reduced part lands in the shard once it has arrived (stage 1: copied over
            # this rank's slice; stage 2: added, one part per round).
            bucket.pending.append((bucket.handle, bucket.scatter_out))
            bucket.handle, bucket.scatter_out = None, None

    @staticmethod
    def _gather_released(bucket: GradBucket) -> None:
        """Stage 2: move the bucket's fresh gradients into a buffer of its own and free them."""
        assert bucket.shard is not None
        grads = [p.grad for p in bucket.params]
        if all(g is not None and g.dtype == bucket.shard.dtype for g in grads):
            # One concatenation (a layer has a dozen parameters: one call, not a dozen copies),
            # then the padding, zeroed.
            used = bucket.offsets[-1] + bucket.params[-1].numel()
            bucket.buffer = torch.empty(bucket.numel, dtype=bucket.shard.dtype,
                                        device=bucket.shard.device)
            torch.cat([g.reshape(-1) for g in grads], out=bucket.buffer[:used])  # type: ignore[union-attr]
            bucket.buffer[used:].zero_()
        else:
            bucket.buffer = torch.zeros(bucket.numel, dtype=bucket.shard.dtype,
                                        device=bucket.shard.device)
            for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                if p.grad is not None:
                    bucket.buffer[offset:offset + p.numel()].copy_(p.grad.reshape(-1))
        for p in bucket.params:
            p.grad = None

    def finish(self) -> None:
        """Launch whatever the hooks did not (unused parameters, overlap off) and wait for all."""
        self._armed.clear()
        if self._idle:
            return
        if self.release_grads:
            self._end_round()
        else:
            for bucket in self.buckets:
                if not bucket.launched:
                    self._launch(bucket)
        for bucket in self.buckets:
            for handle, part in bucket.pending:
                if handle is not None:
                    handle.wait()
                assert bucket.shard is not None
                if self.release_grads:
                    bucket.shard.add_(part)
                else:
                    bucket.shard.copy_(part)
            bucket.pending.clear()
            if self.release_grads:
                bucket.buffer = bucket.buffer.new_empty(0)  # the last round's buffer
        if self.release_grads:
            return
        # A momentum exchange returns no handle: the optimizer's step waits and commits, so
        # the step's bookkeeping (gradient norm, the trainer's world collective, on a group
        # of its own) runs while the last exchange is still on the wire.
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle = None
            bucket.launched = False
            bucket.num_ready = 0
        self._next_launch = 0
