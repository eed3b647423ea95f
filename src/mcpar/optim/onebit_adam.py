"""1-bit Adam: Adam whose data-parallel communication is cut to about one bit per parameter.

Algorithm (algorithms.md §1.2; Tang et al., ICML 2021; DeepSpeed's ``OnebitAdam``):

- Warm-up, steps 1..freeze_step: plain Adam on the gradient the caller has already averaged
  over the data-parallel axis, as DeepSpeed runs it: no bias correction, decoupled weight decay
  added to the update, ``x -= lr * (m / (sqrt(v) + eps) + wd * x)``.
- Compression stage, from step freeze_step + 1: the variance v is frozen. The caller does NOT
  all-reduce the gradients; each rank forms its local momentum ``b1 * m + (1 - b1) * g_local``
  and the optimizer averages it with the error-compensated 1-bit all-reduce
  (:func:`mcpar.comm.compression.onebit_compressed_allreduce`), which leaves m bit-identical on
  every rank. Then ``x -= lr * (m / (sqrt(v_frozen) + eps) + wd * x)``.

Why it is written here: DeepSpeed's optimizer calls its own communication backend, and every
collective of this framework has to go through the Communicator to be counted.

All parameters of all groups share one flat float32 momentum and one flat variance buffer (a
parameter's ``state[p]['exp_avg']`` / ``['exp_avg_sq']`` are views into them), and the frozen
denominator ``sqrt(v) + eps`` is computed once. The flat order is the order of the parameter
groups and of the parameters within them; the groups' ranges are contiguous, so per-group
hyperparameters apply to a slice. Every parameter is stepped every step: a missing gradient
counts as zero (the exchange needs the same layout on every rank).

Exchange segments. By default the compression stage runs ONE compressed all-reduce per step over
the whole flat momentum, after the backward pass. :meth:`set_exchange_buckets` splits it into one
exchange per data-parallel gradient bucket instead (each with its own error buffers and scales),
so that the trainer can start a bucket's exchange from the backward pass as soon as its
gradients are final (:meth:`launch_exchange`): the 1-bit traffic then overlaps with the rest of
the backward, as DDP's all-reduce does (segments: ``onebit_segments.py``). Segments exchanged
together (:meth:`launch_all_exchanges` after clipping, or :meth:`step` itself) are pipelined:
segment k+1 is compressed while segment k's signs cross the link, and :meth:`step` updates
segment k's parameters as soon as its average lands (``onebit_launch.py``). Errors are double
buffered: an exchange reads the current storage and writes the other, which :meth:`step`
makes current, so a step that is skipped (non-finite gradients) leaves the error feedback as
it was.

Step count, moments and both error buffers are optimizer state: ``state_dict()`` carries them
(the error buffers differ per rank), and ``load_state_dict()`` restores them so that training
resumes bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from typing import Any

import torch

from mcpar.comm.communicator import Communicator
from mcpar.comm.compression import (
    OneBitErrorBuffers,
    OneBitJob,
    onebit_compressed_allreduce,
    onebit_compressed_allreduce_many,
)
from mcpar.optim.onebit_launch import ExchangeFeed
from mcpar.optim.onebit_segments import (
    Segment,
    apply_update,
    bucket_ranges,
    copy_grads,
    param_views,
    plan_segment_views,
    plan_segments,
)
from mcpar.optim.onebit_state import OneBitState, check_hyperparameters


class OneBitAdam(OneBitState, torch.optim.Optimizer):
    """Adam with a frozen variance and 1-bit compressed momentum after ``freeze_step`` steps.

    The caller's contract, per step: read :attr:`compressing` before the step's gradient
    synchronization. When it is False, average the gradients over ``axis`` as for any optimizer;
    when it is True, leave each rank's local gradient as it is (the optimizer communicates).
    The learning rate (and weight decay) are read from ``param_groups`` at every step.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter] | Iterable[dict[str, Any]],
                 comm: Communicator, axis: str = "dp", lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, freeze_step: int = 100_000,
                 dp_algorithm: Callable[[int], str] | None = None):
        """``dp_algorithm(nbytes)``: the data axis' reduction algorithm for a buffer of that
        size ('flat' or 'hierarchical'), as the CommunicationController decides it; None is
        flat."""
        if not isinstance(freeze_step, int) or freeze_step < 1:
            # At least one warm-up step: freezing a variance that was never estimated (zero)
            # would divide the momentum by eps.
            raise ValueError(f"freeze_step must be an integer >= 1, got {freeze_step!r}")
        self._initialized = False
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        for group in self.param_groups:
            check_hyperparameters(group)
        self.comm = comm
        self.axis = axis
        self.freeze_step = freeze_step

        # Flat layout: (param, offset, numel) in group order; each group a contiguous range.
        self._layout: list[tuple[torch.nn.Parameter, int, int]] = []
        self._group_ranges: list[tuple[int, int]] = []
        offset = 0
        for group in self.param_groups:
            start = offset
            for p in group["params"]:
                if not p.requires_grad:
                    raise ValueError("OneBitAdam steps every parameter it holds; pass only "
                                     "trainable ones (requires_grad=True)")
                if not p.is_floating_point():
                    raise ValueError(f"cannot optimize a {p.dtype} parameter")
                self._layout.append((p, offset, p.numel()))
                offset += p.numel()
            self._group_ranges.append((start, offset))
        if not self._layout:
            raise ValueError("OneBitAdam got no parameters")
        devices = {p.device for p, _, _ in self._layout}
        if len(devices) > 1:
            raise ValueError("all parameters must be on one device, got "
                             f"{sorted(map(str, devices))}")
        self.numel = offset
        self.device = devices.pop()

        self._exp_avg = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._exp_avg_sq = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._flat_grad = torch.zeros(self.numel, dtype=torch.float32, device=self.device)
        self._step_count = 0
        # Shared by every parameter's state; it mirrors _step_count for per-parameter readers
        # (checkpoint code that looks for AdamW's 'step').
        self._step_tensor = torch.zeros((), dtype=torch.float32)
        # Under a hierarchical data axis the momentum is averaged inside the node in fp32 (fast
        # links) and only the 1/k shard crosses nodes, compressed: the errors are the shard's.
        self._intra = (comm.axis_size("dp_intra") if axis == "dp"
                       and dp_algorithm is not None
                       and dp_algorithm(4 * self.numel) == "hierarchical" else 1)
        self._exchange_axis = "dp_inter" if self._intra > 1 else axis
        self._world = comm.axis_size(axis)
        self._update = torch.empty_like(self._exp_avg)  # scratch of the compressed update
        self._segments: list[Segment] = []
        # Two error storages: the exchanges of a step read the current one and write their new
        # errors to the other, which becomes current when the step commits (a skipped step
        # just leaves it): nothing is copied.
        self._storages: tuple[OneBitErrorBuffers, OneBitErrorBuffers] = self._plan_segments(
            [[(0, self.numel)]])
        self._current = 0
        self._launched: dict[int, Future[torch.Tensor]] = {}
        self._feed: ExchangeFeed | None = None  # the step's exchange job, once launched
        self._denom: torch.Tensor | None = None  # sqrt(v_frozen) + eps, built at first use
        self._bind_state()
        self._initialized = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        if getattr(self, "_initialized", False):
            raise RuntimeError("OneBitAdam's flat buffers are fixed at construction; "
                               "pass every parameter group to the constructor")
        super().add_param_group(param_group)

    # --- exchange segments ------------------------------------------------------------------
    def _plan_segments(self, segments: list[list[tuple[int, int]]]
                       ) -> tuple[OneBitErrorBuffers, OneBitErrorBuffers]:
        """Set the exchange segments; returns the two error storages."""
        group_betas = [(start, end, float(group["betas"][0])) for group, (start, end)
                       in zip(self.param_groups, self._group_ranges, strict=True)]
        self._segments, storages = plan_segments(
            segments, group_betas, self.comm.axis_size(self._exchange_axis), self._intra,
            self.device)
        group_of = {id(p): index for index, group in enumerate(self.param_groups)
                    for p in group["params"]}
        self._views = plan_segment_views(self._segments, self._layout, group_of,
                                         self._flat_grad, self._update)
        return storages

    @property
    def _errors(self) -> OneBitErrorBuffers:
        """The current error storage (what the state dict carries)."""
        return self._storages[self._current]

    def set_exchange_buckets(self, buckets: list[list[torch.nn.Parameter]]) -> None:
        """One compressed exchange per bucket (each bucket's parameters in the bucket's order,
        which is that of its flat gradient buffer) instead of one over everything.

        Only before the first compression-stage step: the error buffers are re-planned (zero).
        """
        if self._step_count > self.freeze_step:
            raise RuntimeError("exchange buckets must be set before the compression stage")
        segments = bucket_ranges(buckets, self._layout)
        self._storages = self._plan_segments(segments)
        self._current = 0

    @property
    def num_segments(self) -> int:
        return len(self._segments)

    def segment_numel(self, index: int) -> int:
        """Elements segment ``index`` exchanges over the compressed axis (per node's shard
        under a hierarchical data axis): the size its error buffers are made for."""
        return -(-self._segments[index].numel // self._intra)

    def gather_segment(self, flat: torch.Tensor, index: int) -> torch.Tensor:
        """Segment ``index`` of a flat tensor in the optimizer's order (a view when it is one
        range)."""
        ranges = self._segments[index].ranges
        if len(ranges) == 1:
            return flat[ranges[0][0]:ranges[0][1]]
        return torch.cat([flat[start:end] for start, end in ranges])

    def scatter_segment(self, flat: torch.Tensor, index: int, values: torch.Tensor) -> None:
        at = 0
        for start, end in self._segments[index].ranges:
            flat[start:end].copy_(values[at:at + end - start])
            at += end - start

    @torch.no_grad()
    def segment_momentum(self, index: int, grad: torch.Tensor) -> torch.Tensor:
        """This rank's momentum before averaging, b1 * m + (1 - b1) * g, for segment ``index``
        from its gradient ``grad`` (flat, in the segment's order); a new tensor."""
        seg = self._segments[index]
        m = self.gather_segment(self._exp_avg, index)
        out = torch.empty(seg.numel, dtype=torch.float32, device=self.device)
        grad = grad.reshape(-1)
        for start, end, beta1 in seg.beta_runs:
            torch.mul(m[start:end], beta1, out=out[start:end])
            out[start:end].add_(grad[start:end], alpha=1 - beta1)
        return out

    def _segment_grad(self, index: int) -> torch.Tensor:
        """Segment ``index``'s ``.grad`` fields, flat in its order (missing ones are zero)."""
        views = self._views[index]
        copy_grads(views.params, views.grads)
        return views.grad

    def _run_exchanges(self, fed: Iterable[tuple[int, torch.Tensor]],
                       on_result: Callable[[int, torch.Tensor], None],
                       jobs_spread_out: bool = False) -> None:
        """The compressed averages of (segment index, local momentum) pairs, each reported by
        ``on_result(index, averaged)`` as it lands; pipelined (segment k+1 is compressed while
        segment k crosses the link), one by one under a hierarchical data axis (each is
        already three stages). Errors: read from the current storage, written to the other."""
        def errors(index: int) -> tuple[OneBitErrorBuffers, OneBitErrorBuffers]:
            pair = self._segments[index].errors
            return pair[self._current], pair[1 - self._current]

        if self._intra > 1:
            for index, local in fed:
                on_result(index, self._hierarchical_exchange(local, *errors(index)))
            return
        order: list[int] = []

        def jobs() -> Iterator[OneBitJob]:
            for index, local in fed:
                order.append(index)
                current, after = errors(index)
                yield OneBitJob(local, current.worker, current.server, after)

        onebit_compressed_allreduce_many(jobs(), self.comm, self.axis,
                                         on_result=lambda k, avg: on_result(order[k], avg),
                                         jobs_spread_out=jobs_spread_out)

    @torch.no_grad()
    def launch_exchange(self, index: int, grad: torch.Tensor) -> None:
        """Start segment ``index``'s exchange on the communication thread from its final local
        gradient (flat, in the segment's order), e.g. from a backward hook. Segments must be
        launched in the same order on every rank. :meth:`step` waits and commits."""
        self._check_launch(index)
        self._hand_over(index, self.segment_momentum(index, grad), spread_out=True)

    @torch.no_grad()
    def launch_all_exchanges(self) -> None:
        """Start every segment's exchange from the parameters' current ``.grad`` (final, e.g.
        clipped), so that what the caller does before :meth:`step` overlaps the exchange."""
        indices = list(range(len(self._segments)))
        for index in indices:
            self._check_launch(index)
        try:
            for index in indices:
                self._hand_over(index, self.segment_momentum(index, self._segment_grad(index)),
                                spread_out=False)
        except BaseException:
            self._abandon_feed()
            raise

    def _hand_over(self, index: int, local: torch.Tensor, spread_out: bool) -> None:
        """Give segment ``index``'s local momentum to the step's one exchange job, started at
        the step's first launch: all of a step's segments are pipelined in launch order
        (``spread_out``: launched one by one from the backward pass, not all at once)."""
        if self._feed is None:
            def run(fed: Iterator[tuple[int, torch.Tensor]],
                    on_result: Callable[[int, torch.Tensor], None]) -> None:
                self._run_exchanges(fed, on_result, jobs_spread_out=spread_out)

            self._feed = ExchangeFeed(list(range(len(self._segments))), run, self.comm)
        self._feed.put(index, local)
        self._launched[index] = self._feed.results[index]

    def _abandon_feed(self) -> None:
        """End a step's exchange job that will not get all its segments (the caller failed),
        so that it does not hold the communication thread."""
        if self._feed is not None and len(self._launched) < len(self._segments):
            self._feed.abandon()
        self._feed = None

    def _check_launch(self, index: int) -> None:
        if self._step_count < self.freeze_step:  # (not self.compressing: no per-call scan)
            raise RuntimeError("launch_exchange is for compression-stage steps")
        if index in self._launched:
            raise RuntimeError(f"exchange segment {index} was already launched this step")

    def discard_exchanges(self) -> None:
        """Forget this step's launched exchanges (the step is skipped): errors unchanged."""
        self._abandon_feed()
        launched, self._launched = self._launched, {}
        for result in launched.values():
            result.result()  # finished (or its error raised) before it is dropped

    # --- state ------------------------------------------------------------------------------
    @property
    def compressing(self) -> bool:
        """True when the NEXT ``step()`` is a compression-stage step (the caller must then skip
        its gradient all-reduce)."""
        self._adopt_external_state()  # a checkpoint loaded in place may have moved the step
        return self._step_count >= self.freeze_step

    @property
    def steps_done(self) -> int:
        self._adopt_external_state()
        return self._step_count

    @property
    def error_buffers(self) -> OneBitErrorBuffers:
        """This rank's worker and server error buffers (live tensors; they differ per rank)."""
        return self._errors

    # --- math -------------------------------------------------------------------------------
    def _gather_grad(self) -> torch.Tensor:
        """Every parameter's gradient in the flat fp32 scratch buffer (None counts as zero)."""
        copy_grads([p for p, _, _ in self._layout],
                   [self._flat_grad[offset:offset + numel] for _, offset, numel in self._layout])
        return self._flat_grad

    def _apply_update(self, group: dict[str, Any], update: torch.Tensor) -> None:
        """x -= lr * (update + wd * x) for the parameters of one group; ``update`` is the
        group's flat slice (consumed)."""
        params = group["params"]
        if params:
            apply_update(group, params, param_views(update, params))

    def _warmup_step(self) -> None:
        grad = self._gather_grad()
        for group, (start, end) in zip(self.param_groups, self._group_ranges, strict=True):
            beta1, beta2 = group["betas"]
            m, v, g = self._exp_avg[start:end], self._exp_avg_sq[start:end], grad[start:end]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            self._apply_update(group, m / v.sqrt().add_(group["eps"]))
        self._count_step()

    @torch.no_grad()
    def local_momentum(self) -> torch.Tensor:
        """This rank's momentum before averaging, b1 * m + (1 - b1) * g, from the parameters'
        current ``.grad`` (a new flat fp32 tensor; the state is not modified).

        Public so that a single-process simulation of p workers can drive exactly the
        arithmetic of :meth:`step` (see tests/test_onebit_adam.py).
        """
        if len(self._segments) == 1 and self._segments[0].ranges == [(0, self.numel)]:
            return self.segment_momentum(0, self._segment_grad(0))  # already in flat order
        local = torch.empty_like(self._exp_avg)
        for index in range(len(self._segments)):
            self.scatter_segment(local, index,
                                 self.segment_momentum(index, self._segment_grad(index)))
        return local

    @torch.no_grad()
    def apply_compressed_momentum(self, averaged: torch.Tensor) -> None:
        """Compression-stage update from the averaged momentum: m <- averaged, then
        x -= lr * (m / (sqrt(v_frozen) + eps) + wd * x) per group, and count the step."""
        if not self.compressing:
            raise RuntimeError(f"step {self._step_count + 1} is a warm-up step "
                               f"(freeze_step {self.freeze_step})")
        if averaged.numel() != self.numel:
            raise ValueError(f"averaged momentum has {averaged.numel()} elements, "
                             f"expected {self.numel}")
        self._exp_avg.copy_(averaged.reshape(-1))
        self._frozen_variance_update()

    def _frozen_variance_update(self) -> None:
        """x -= lr * (m / (sqrt(v_frozen) + eps) + wd * x) from the averaged m; count the step."""
        for index in range(len(self._segments)):
            self._update_segment(index)
        self._count_step()

    def _count_step(self) -> None:
        self._step_count += 1
        self._step_tensor.fill_(float(self._step_count))

    def _update_segment(self, index: int) -> None:
        """The frozen-variance update of segment ``index``'s parameters from the averaged m.
        Element by element, so a step updated segment by segment (as each exchange lands)
        gives the same bits as one over the whole buffer."""
        if self._denom is None:
            self._denom = torch.empty_like(self._exp_avg_sq)
            for group, (start, end) in zip(self.param_groups, self._group_ranges, strict=True):
                torch.sqrt(self._exp_avg_sq[start:end], out=self._denom[start:end])
                self._denom[start:end].add_(group["eps"])
        # DeepSpeed's order of operations, kept exactly: a fused x (1 - lr wd) - lr m / d is the
        # same update but rounds differently, and measured 1.030 of AdamW's validation loss on
        # the default task against 1.027 (bench/compression_convergence.py).
        for start, end in self._segments[index].ranges:
            torch.div(self._exp_avg[start:end], self._denom[start:end],
                      out=self._update[start:end])
        for group_index, params, views in self._views[index].update_runs:
            apply_update(self.param_groups[group_index], params, views)

    def _hierarchical_exchange(self, local: torch.Tensor, errors: OneBitErrorBuffers,
                               errors_out: OneBitErrorBuffers) -> torch.Tensor:
        """Mean of the node's momenta by an fp32 reduce-scatter inside the node, 1-bit exchange
        of this rank's shard with its peers on the other nodes, all-gather inside the node."""
        k = self._intra
        pad = (-local.numel()) % k
        padded = torch.cat([local, local.new_zeros(pad)]) if pad else local
        shard = self.comm.reduce_scatter_along(padded, dim=0, axis="dp_intra").div_(k)
        averaged_shard = onebit_compressed_allreduce(shard, errors.worker, errors.server,
                                                     self.comm, self._exchange_axis,
                                                     errors_out=errors_out)
        self.comm.all_gather_into(padded, averaged_shard, axis="dp_intra")
        return padded[:local.numel()]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """One optimizer step: warm-up Adam, or the compressed momentum exchange and update.

        In the compression stage every rank of ``axis`` must call it (it is a collective).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._adopt_external_state()
        if not self.compressing:
            self._warmup_step()
            return loss
        world = self.comm.axis_size(self.axis)
        if world != self._world:
            raise RuntimeError(f"OneBitAdam was built for {self._world} ranks on axis "
                               f"'{self.axis}' but it now has {world}; build the optimizer "
                               "after the process group")
        def land(index: int, averaged: torch.Tensor) -> None:
            # m <- the averaged momentum of the segment, in place, and its parameters' update:
            # segment k's update runs while the later segments are still on the wire.
            self.scatter_segment(self._exp_avg, index, averaged)
            self._update_segment(index)

        indices = list(range(len(self._segments)))
        if self._launched:
            # Exchanges started earlier (from the backward pass, or after clipping): every
            # segment must have been launched. Each is used as soon as it lands.
            if len(self._launched) != len(self._segments):
                missing = sorted(set(indices) - set(self._launched))
                self._abandon_feed()
                self._launched.clear()
                raise RuntimeError(f"exchange segments {missing} were not launched this step")
            launched, self._launched, self._feed = self._launched, {}, None
            for index in indices:
                land(index, launched[index].result())
        else:
            self._run_exchanges(((index, self.segment_momentum(index, self._segment_grad(index)))
                                 for index in indices), land)
        self._current = 1 - self._current  # commit this step's errors
        self._count_step()
        return loss

