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
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mcpar.comm.communicator import CommHandle
from mcpar.parallel.expert import is_expert_sharded


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


class DataParallelGradSync:
    """Bucketed gradient synchronization over the data-parallel axis; what a bucket's
    reduction is belongs to the exchange strategy (``set_exchange``)."""

    def __init__(self, params: list[torch.nn.Parameter], bucket_size_mb: float = 25.0,
                 overlap: bool = True):
        self.overlap = overlap
        self.exchange: BucketExchange | None = None
        self.buckets = self._make_buckets([p for p in params if p.requires_grad],
                                          int(bucket_size_mb * 2**20))
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
    def _make_buckets(params: list[torch.nn.Parameter], bucket_bytes: int) -> list[GradBucket]:
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
        buckets = []
        for index, group in enumerate(groups):
            total = sum(p.numel() for p in group)
            buffer = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                p.grad = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            buckets.append(GradBucket(group, buffer, index, param_ids={id(p) for p in group},
                                      expert=is_expert_sharded(group[0])))
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
            bucket.buffer.zero_()

    def arm(self, params: list[torch.nn.Parameter]) -> None:
        """Count these parameters' next gradient: their last backward of the step is next."""
        if not self._idle:
            self._armed.update(id(p) for p in params if id(p) in self._bucket_of)

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
        bucket.handle = self.exchange.launch(bucket)
        bucket.launched = True

    def finish(self) -> None:
        """Launch whatever the hooks did not (unused parameters, overlap off) and wait for all."""
        self._armed.clear()
        if self._idle:
            return
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
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
