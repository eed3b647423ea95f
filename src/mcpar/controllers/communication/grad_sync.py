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
- During gradient accumulation only the last micro-batch synchronizes.
- The reduction itself is the CommunicationController's: flat or hierarchical (by its topology),
  fp16/bf16 on the wire, or a bucket reducer such as PowerSGD run on its communication thread.
  With 1-bit Adam past its freeze step the optimizer exchanges the momentum itself, and the
  trainer switches the all-reduce off (``skip_step``); when the optimizer exchanges per bucket
  (``set_momentum_exchange``), each full bucket starts its 1-bit exchange from the backward
  pass instead, in the same bucket order.
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
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.parallel.expert import is_expert_sharded


class MomentumExchange(Protocol):
    """What 1-bit Adam offers to exchange bucket by bucket (mcpar.optim.onebit_adam); its
    ``step`` waits for the exchanges and commits them."""

    def launch_exchange(self, index: int, grad: torch.Tensor) -> None: ...


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
    """Averages gradients over the data-parallel axis through the CommunicationController."""

    def __init__(self, params: list[torch.nn.Parameter], comm: CommunicationController,
                 bucket_size_mb: float = 25.0, overlap: bool = True, codec: str = "none"):
        """``codec``: 'none', 'fp16' or 'bf16' (cast on the wire); a bucket reducer set with
        ``set_bucket_reducer`` replaces the all-reduce altogether."""
        self.comm = comm
        self.degree = comm.axis_size("dp")
        self.overlap = overlap
        self.codec = codec
        # Off for the micro-batches that only accumulate (set by the ComputeController).
        self.sync_enabled = True
        # Off for a whole step whose optimizer synchronizes by itself (1-bit Adam).
        self.skip_step = False
        self.bucket_reducer: Callable[[int, list[torch.Tensor]], None] | None = None
        # Started per bucket instead of the all-reduce in a skipped step (1-bit Adam).
        self.momentum_exchange: MomentumExchange | None = None
        self.buckets = self._make_buckets([p for p in params if p.requires_grad],
                                          int(bucket_size_mb * 2**20))
        self._next_launch = 0
        self._bucket_of: dict[int, GradBucket] = {}
        for bucket in self.buckets:
            for p in bucket.params:
                self._bucket_of[id(p)] = bucket
                p.register_post_accumulate_grad_hook(self._on_grad_ready)

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

    def set_bucket_reducer(self, reducer: Callable[[int, list[torch.Tensor]], None]) -> None:
        """Average each bucket's gradients with ``reducer(bucket_index, grads)`` (in place)
        instead of the all-reduce, e.g. PowerSGD; it runs on the controller's communication
        thread."""
        self.bucket_reducer = reducer

    def set_momentum_exchange(self, exchange: MomentumExchange) -> None:
        """In steps with ``skip_step`` set, hand each full bucket's gradient buffer to
        ``exchange.launch_exchange(bucket_index, buffer)`` (its parameters, in bucket order,
        are those of :attr:`buckets`); the optimizer's step waits for the exchanges."""
        if any(b.expert for b in self.buckets):
            raise ValueError("a per-bucket momentum exchange cannot cover expert-parallel "
                             "buckets")
        self.momentum_exchange = exchange

    @property
    def _idle(self) -> bool:
        """No synchronization this micro-batch."""
        return not self.sync_enabled or (self.skip_step and self.momentum_exchange is None)

    @property
    def grad_bytes(self) -> int:
        """Bytes of all gradients this rank synchronizes per step."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if self._idle or not self.overlap:
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
        if self.skip_step:
            assert self.momentum_exchange is not None
            self.momentum_exchange.launch_exchange(bucket.index, bucket.buffer)
        elif bucket.expert:
            if self.degree > 1:
                bucket.buffer.div_(self.degree)
            bucket.handle = self.comm.all_reduce(bucket.buffer, axis="edp", async_op=True)
        elif self.bucket_reducer is not None:
            reducer, grads = self.bucket_reducer, [p.grad for p in bucket.params]
            index = bucket.index
            bucket.handle = self.comm.run_async(
                lambda: reducer(index, grads))  # type: ignore[arg-type]
        else:
            if self.degree > 1:
                # Divide first: the sum of averages stays in range for low-precision buffers.
                bucket.buffer.div_(self.degree)
            bucket.handle = self.comm.dp_all_reduce(bucket.buffer, codec=self.codec,
                                                    async_op=True)
        bucket.launched = True

    def finish(self) -> None:
        """Launch whatever the hooks did not (unused parameters, overlap off) and wait for all."""
        if self._idle:
            return
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        # A momentum exchange is not waited for here: the optimizer's step waits and commits,
        # so the step's bookkeeping (gradient norm, the trainer's world collective, on a group
        # of its own) runs while the last exchange is still on the wire.
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
            bucket.handle = None
            bucket.launched = False
            bucket.num_ready = 0
        self._next_launch = 0
