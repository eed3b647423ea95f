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
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from mcpar.controllers.communication import CommHandle, CommunicationController


@dataclass
class GradBucket:
    params: list[torch.nn.Parameter]
    buffer: torch.Tensor
    num_ready: int = 0
    handle: CommHandle | None = None
    launched: bool = False
    param_ids: set[int] = field(default_factory=set)


class DataParallelGradSync:
    """Averages gradients over the data-parallel axis through the CommunicationController."""

    def __init__(self, params: list[torch.nn.Parameter], comm: CommunicationController,
                 bucket_size_mb: float = 25.0, overlap: bool = True, axis: str = "dp"):
        self.comm = comm
        self.axis = axis
        self.degree = comm.axis_size(axis)
        self.overlap = overlap
        self.sync_enabled = True
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
                    or groups[-1][0].dtype != p.dtype or groups[-1][0].device != p.device):
                groups.append([])
                size = 0
            groups[-1].append(p)
            size += nbytes
        buckets = []
        for group in groups:
            total = sum(p.numel() for p in group)
            buffer = torch.zeros(total, dtype=group[0].dtype, device=group[0].device)
            offset = 0
            for p in group:
                p.grad = buffer[offset:offset + p.numel()].view_as(p)
                offset += p.numel()
            buckets.append(GradBucket(group, buffer, param_ids={id(p) for p in group}))
        return buckets

    @property
    def grad_bytes(self) -> int:
        """Bytes of all gradients this rank synchronizes per step."""
        return sum(b.buffer.numel() * b.buffer.element_size() for b in self.buckets)

    def zero_grad(self) -> None:
        for bucket in self.buckets:
            bucket.buffer.zero_()

    def _on_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not (self.sync_enabled and self.overlap):
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
        if self.degree > 1:
            # Divide first: the sum of averages stays in range for low-precision buffers.
            bucket.buffer.div_(self.degree)
        bucket.handle = self.comm.all_reduce(bucket.buffer, axis=self.axis, async_op=True)
        bucket.launched = True

    def finish(self) -> None:
        """Launch whatever the hooks did not (unused parameters, overlap off) and wait for all."""
        if not self.sync_enabled:
            return
        for bucket in self.buckets:
            if not bucket.launched:
                self._launch(bucket)
        for bucket in self.buckets:
            assert bucket.handle is not None
            bucket.handle.wait()
            bucket.handle = None
            bucket.launched = False
            bucket.num_ready = 0
        self._next_launch = 0
