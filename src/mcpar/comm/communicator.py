"""The accounted wire: every collective of the job goes through a ``Communicator``, and is counted.

The CommunicationController (``mcpar.controllers.communication``) is a Communicator that also
decides how the data axis reduces (flat, hierarchical, hybrid) and how gradients are exchanged;
the layers below the controllers (tensor, pipeline and expert parallelism, the codecs, the
optimizers) take a Communicator, so every byte they send is in the same books.

A Communicator issues collectives over the process groups that ``ParallelDims`` owns (one per mesh
axis) and keeps the books: bytes this rank sent and time spent, per operation, mesh axis and codec,
per step and in total. The byte counts are those of the algorithm the backend runs, computed from
the exact tensor shapes (gloo and NCCL do not report wire bytes):

- all-reduce (ring: reduce-scatter then all-gather): each rank sends 2(n-1)/n of the buffer;
- all-gather (ring): each rank sends its own part n-1 times, i.e. (n-1)/n of the output;
- reduce-scatter: each rank sends (n-1)/n of its input (NCCL's ring; on gloo an all-to-all of
  the chunks and a local sum, because gloo's own reduce-scatter runs a whole all-reduce: it put
  2(n-1)/n of the buffer on the loopback wire per rank at 2 and 4 ranks, twice the
  all-to-all's bytes, in 2-4x its time; ``bench/gloo_collectives.py``);
- broadcast (pipelined chain): each rank forwards the buffer once, except the last; counted as
  (n-1)/n of the buffer per rank, the average over ranks;
- all-to-all: the chunks or rows that leave this rank (its own part stays);
- an exchange (reduce-scatters and all-gathers carried by one all-to-all, ``exchange_async``):
  each part as the collective it stands for, which are the bytes the all-to-all moves;
- point to point: the sender counts the whole tensor, the receiver nothing.

Mesh axes are 'dp', 'tp', 'pp' (groups from ParallelDims), 'dp_intra' and 'dp_inter' (the data axis
split by node, for hierarchical collectives), 'ep' and 'edp' (the data axis split for experts)
and 'world' (every rank, in a group apart from the default one: see ``ParallelDims.world_group``).

Times: a blocking call is timed around the call; an asynchronous one from its launch to its
completion, observed through the work's future, so overlap with compute does not hide or inflate
it.
"""

from __future__ import annotations

import contextlib
import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from mcpar.all_to_all_reduce_scatter import all_to_all_reduce_scatter, sum_rows
from mcpar.topology import ParallelDims


@dataclass
class CommCounter:
    bytes: float = 0.0
    time_s: float = 0.0
    calls: int = 0


@dataclass
class CommStats:
    """Byte/time accounting, keyed by (operation, mesh axis, codec); the profiler reads this."""

    total: dict[tuple[str, str, str], CommCounter] = field(
        default_factory=lambda: defaultdict(CommCounter)
    )
    step: dict[tuple[str, str, str], CommCounter] = field(
        default_factory=lambda: defaultdict(CommCounter)
    )
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)
    # The profiler's (mcpar.profiler): this step's blocking collectives on the main thread,
    # (op, axis, start, end) on perf_counter's clock; None (not kept) unless it is profiling.
    waits: list[tuple[str, str, float, float]] | None = None

    def record(self, key: tuple[str, str, str], nbytes: float, seconds: float) -> None:
        # Completion callbacks of async work run on the backend's thread.
        with self._lock:
            for table in (self.total, self.step):
                counter = table[key]
                counter.bytes += nbytes
                counter.time_s += seconds
                counter.calls += 1

    def step_bytes(self) -> float:
        with self._lock:
            return sum(c.bytes for c in self.step.values())

    def step_time_s(self) -> float:
        with self._lock:
            return sum(c.time_s for c in self.step.values())

    def step_bytes_by_axis(self) -> dict[str, float]:
        """This step's bytes per mesh axis (e.g. 'dp_intra' vs 'dp_inter' under hierarchical)."""
        out: dict[str, float] = {}
        with self._lock:
            for (_, axis, _), c in self.step.items():
                out[axis] = out.get(axis, 0.0) + c.bytes
        return out

    def reset_step(self) -> None:
        with self._lock:
            self.step = defaultdict(CommCounter)
        if self.waits is not None:
            self.waits = []

    def breakdown(self, which: str = "total") -> list[dict[str, object]]:
        """Rows {op, axis, codec, bytes, time_s, calls} for reports."""
        table = self.total if which == "total" else self.step
        with self._lock:
            return [
                {"op": op, "axis": axis, "codec": codec, "bytes": c.bytes, "time_s": c.time_s,
                 "calls": c.calls}
                for (op, axis, codec), c in sorted(table.items())
            ]


class CommHandle:
    """An in-flight asynchronous collective; ``wait()`` blocks until it is done (and raises what
    a collective run on the controller's communication thread raised). ``then``: what makes the
    received bytes usable (an exchange's unpacking), run once by the first ``wait()``."""

    def __init__(self, work: dist.Work | Future | None, op: str = "", axis: str = "",
                 ranks: Callable[[], list[int]] | None = None,
                 then: Callable[[], None] | None = None):
        """``ranks``: the group's ranks, for an error's message (looked up only then)."""
        self._work = work
        self._name = (op, axis, ranks)
        self._then = then

    def wait(self) -> None:
        if isinstance(self._work, Future):
            self._work.result()
        elif self._work is not None:
            try:
                self._work.wait()
            except RuntimeError as err:
                op, axis, ranks = self._name
                raise collective_error(op, axis, ranks() if ranks else [], err) from err
        if self._then is not None:
            then, self._then = self._then, None
            then()


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the operation, axis and ranks."""


def collective_error(op: str, axis: str, ranks: list[int], err: BaseException) -> BaseException:
    """The error to raise for a failed collective (an already-named one passes through)."""
    if isinstance(err, CollectiveError):
        return err
    detail = str(err).splitlines()[0] if str(err) else type(err).__name__
    detail = detail.split("] ", 1)[-1]  # drop the backend's source-file prefix
    # gloo says "Timed out waiting ..." or "Application timeout caused pair closure".
    kind = "timed out" if re.search(r"timed out|timeout", detail, re.IGNORECASE) else "failed"
    return CollectiveError(f"{op} on axis '{axis}' (ranks {ranks}) {kind}: {detail}")


def ring_all_reduce_bytes(nbytes: int, n: int) -> float:
    return 2.0 * (n - 1) / n * nbytes if n > 1 else 0.0


def ring_all_gather_bytes(input_nbytes: int, n: int) -> float:
    return float((n - 1) * input_nbytes)


def broadcast_bytes(nbytes: int, n: int) -> float:
    return (n - 1) / n * nbytes if n > 1 else 0.0


class Communicator:
    """Issues collectives along mesh axes and accounts for every byte and second."""

    def __init__(self, dims: ParallelDims):
        self.dims = dims
        self.stats = CommStats()
        self._thread: ThreadPoolExecutor | None = None
        self._backend_of: dict[str, str] = {}  # mesh axis -> its group's backend
        # (operation, mesh axis) whose asynchronous work has no future on the axis' backend
        # (gloo's sends and receives): their completion is known only by wait().
        self._futureless: set[tuple[str, str]] = set()
        # Set by the profiler: each collective is a named range of the torch.profiler trace.
        self.trace_ranges = False

    def run_async(self, fn: Callable[[], object]) -> CommHandle:
        """Run `fn` (a sequence of blocking collectives) on the controller's one communication
        thread, in submission order, so a multi-stage collective overlaps with compute like a
        native asynchronous one. Only groups that the main thread is not using at the same time
        may be used there (the data-parallel groups during the backward pass)."""
        if self._thread is None:
            # A new thread starts with OpenMP's default team (every core): give it the
            # worker's own share, or its kernels oversubscribe the cores the ranks share.
            self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mcpar-comm",
                                              initializer=torch.set_num_threads,
                                              initargs=(torch.get_num_threads(),))
        return CommHandle(self._thread.submit(fn))

    def axis_size(self, axis: str) -> int:
        if not dist.is_initialized():
            return 1
        return self.dims.world_size if axis == "world" else getattr(self.dims, axis)

    def _group(self, axis: str) -> dist.ProcessGroup | None:
        return self.dims.world_group if axis == "world" else self.dims.group(axis)

    @contextlib.contextmanager
    def _named(self, op: str, axis: str) -> Iterator[None]:
        """Turn a backend failure into one that names the operation, the mesh axis and the
        group's ranks (a timeout means a peer of this group stalled or died)."""
        try:
            if self.trace_ranges:
                with torch.profiler.record_function(f"mcpar.{op}[{axis}]"):
                    yield
            else:
                yield
        except RuntimeError as err:
            raise collective_error(op, axis, self._group_ranks(axis), err) from err

    def group_ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's group along ``axis``, in axis-rank order."""
        return self._group_ranks(axis)

    def _group_ranks(self, axis: str) -> list[int]:
        group = self._group(axis)
        if group is not None:
            return dist.get_process_group_ranks(group)
        if not dist.is_initialized():
            return [0]
        # No group: the world itself, or an axis of size 1, whose group is this rank alone (as
        # ``all_gather`` along it returns this rank's tensor alone).
        if axis == "world" or self.axis_size(axis) > 1:
            return list(range(dist.get_world_size()))
        return [dist.get_rank()]

    def _timed(self, key: tuple[str, str, str], nbytes: float, work: dist.Work | None,
               start: float, async_op: bool, then: Callable[[], None] | None = None
               ) -> CommHandle:
        """Record the collective; ``then`` makes its result usable: run now when it was
        blocking, by the handle's first ``wait()`` otherwise."""
        if async_op and work is not None:
            def done(_fut: torch.futures.Future) -> None:
                self.stats.record(key, nbytes, time.perf_counter() - start)

            future = None
            if key[:2] not in self._futureless:
                try:
                    future = work.get_future()
                except RuntimeError:
                    # Asked once per operation: the failed ask costs more than the send.
                    self._futureless.add(key[:2])
            if future is None:
                # gloo's point-to-point work has no future and reports completion only through
                # wait(), which the pipeline calls late (end of step). Count the bytes now with
                # the launch time; the receiver's blocking recv records the exposed wait.
                self.stats.record(key, nbytes, time.perf_counter() - start)
            else:
                future.add_done_callback(done)
            return CommHandle(work, key[0], key[1], lambda: self._group_ranks(key[1]), then=then)
        end = time.perf_counter()
        self.stats.record(key, nbytes, end - start)
        if self.stats.waits is not None and threading.current_thread() is threading.main_thread():
            self.stats.waits.append((key[0], key[1], start, end))
        if then is not None:
            then()
        return CommHandle(None)

    def all_reduce(self, tensor: torch.Tensor, axis: str = "dp", op: str = "sum",
                   async_op: bool = False, codec: str = "none") -> CommHandle:
        """All-reduce `tensor` in place along a mesh axis (op: sum | max | avg-free sum)."""
        n = self.axis_size(axis)
        if n == 1:
            return CommHandle(None)
        reduce_op = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}[op]
        start = time.perf_counter()
        with self._named("all_reduce", axis):
            work = dist.all_reduce(tensor, op=reduce_op, group=self._group(axis),
                                   async_op=async_op)
        nbytes = ring_all_reduce_bytes(tensor.numel() * tensor.element_size(), n)
        return self._timed(("all_reduce", axis, codec), nbytes, work, start, async_op)

    def all_gather(self, tensor: torch.Tensor, axis: str = "dp") -> list[torch.Tensor]:
        """Every rank's `tensor` along an axis, in axis-rank order (blocking)."""
        n = self.axis_size(axis)
        if n == 1:
            return [tensor]
        out = [torch.empty_like(tensor) for _ in range(n)]
        start = time.perf_counter()
        with self._named("all_gather", axis):
            dist.all_gather(out, tensor, group=self._group(axis))
        nbytes = ring_all_gather_bytes(tensor.numel() * tensor.element_size(), n)
        self._timed(("all_gather", axis, "none"), nbytes, None, start, False)
        return out

    def broadcast(self, tensor: torch.Tensor, axis: str = "dp", src_axis_rank: int = 0) -> None:
        """Broadcast `tensor` in place from the rank at `src_axis_rank` of the axis."""
        n = self.axis_size(axis)
        if n == 1:
            return
        group = self._group(axis)
        src = src_axis_rank if group is None else dist.get_global_rank(group, src_axis_rank)
        start = time.perf_counter()
        with self._named("broadcast", axis):
            dist.broadcast(tensor, src=src, group=group)
        nbytes = broadcast_bytes(tensor.numel() * tensor.element_size(), n)
        self._timed(("broadcast", axis, "none"), nbytes, None, start, False)

    def all_gather_along(self, tensor: torch.Tensor, dim: int, axis: str = "tp") -> torch.Tensor:
        """Concatenate every axis rank's `tensor` along `dim` (blocking, autograd-free)."""
        n = self.axis_size(axis)
        if n == 1:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        out = torch.empty((n * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype,
                          device=moved.device)
        start = time.perf_counter()
        with self._named("all_gather", axis):
            dist.all_gather_single(out, moved, group=self._group(axis))
        nbytes = ring_all_gather_bytes(moved.numel() * moved.element_size(), n)
        self._timed(("all_gather", axis, "none"), nbytes, None, start, False)
        return out.movedim(0, dim)

    def reduce_scatter_along(self, tensor: torch.Tensor, dim: int,
                             axis: str = "tp") -> torch.Tensor:
        """Sum over the axis and keep this rank's 1/n slice along `dim` (blocking)."""
        n = self.axis_size(axis)
        if n == 1:
            return tensor
        moved = tensor.movedim(dim, 0).contiguous()
        if moved.shape[0] % n:
            raise ValueError(f"dim {dim} of size {moved.shape[0]} is not divisible by {n}")
        out = torch.empty((moved.shape[0] // n, *moved.shape[1:]), dtype=moved.dtype,
                          device=moved.device)
        self.reduce_scatter_into(out, moved, axis=axis)
        return out.movedim(0, dim)

    def all_to_all_single(self, output: torch.Tensor, tensor: torch.Tensor, axis: str = "dp",
                          codec: str = "none") -> torch.Tensor:
        """Split `tensor` (1-D) into n equal chunks, send chunk j to axis rank j, and receive
        every rank's chunk for this rank into `output`, in axis-rank order (blocking)."""
        self._all_to_all(output, tensor, axis, codec, async_op=False)
        return output

    def all_to_all_single_async(self, output: torch.Tensor, tensor: torch.Tensor,
                                axis: str = "dp", codec: str = "none") -> CommHandle:
        """:meth:`all_to_all_single` started in the background; ``output`` is complete once the
        handle's ``wait()`` returns. Several may be in flight on one group (issued in the same
        order on every rank): the backend moves one's bytes while the caller computes the next
        one's, which the pipelined 1-bit exchange relies on."""
        return self._all_to_all(output, tensor, axis, codec, async_op=True)

    def _all_to_all(self, output: torch.Tensor, tensor: torch.Tensor, axis: str, codec: str,
                    async_op: bool) -> CommHandle:
        n = self.axis_size(axis)
        if n == 1:
            output.copy_(tensor)
            return CommHandle(None)
        if tensor.numel() % n:
            raise ValueError(f"all_to_all of {tensor.numel()} elements over {n} ranks")
        start = time.perf_counter()
        with self._named("all_to_all", axis):
            work = dist.all_to_all_single(output, tensor, group=self._group(axis),
                                          async_op=async_op)
        # Each rank keeps its own chunk and sends the other n - 1.
        nbytes = (n - 1) / n * tensor.numel() * tensor.element_size()
        return self._timed(("all_to_all", axis, codec), nbytes, work, start, async_op)

    def all_to_all_rows(self, tensor: torch.Tensor, send_counts: list[int],
                        recv_counts: list[int], axis: str = "ep") -> torch.Tensor:
        """Send the rows of `tensor` [N, ...], split by `send_counts`, to the axis ranks in
        order, and return the rows received, by source rank (blocking). Uneven splits: the
        token exchange of expert parallelism. The bytes are the rows that leave this rank."""
        n = self.axis_size(axis)
        if n == 1:
            return tensor.clone()
        out = tensor.new_empty((sum(recv_counts), *tensor.shape[1:]))
        start = time.perf_counter()
        with self._named("all_to_all", axis):
            dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes=recv_counts,
                                   input_split_sizes=send_counts, group=self._group(axis))
        row_bytes = math.prod(tensor.shape[1:]) * tensor.element_size()
        nbytes = (sum(send_counts) - send_counts[self.axis_rank(axis)]) * row_bytes
        self._timed(("all_to_all", axis, "none"), nbytes, None, start, False)
        return out

    def all_gather_into(self, output: torch.Tensor, tensor: torch.Tensor, axis: str = "dp",
                        codec: str = "none") -> torch.Tensor:
        """Concatenate every axis rank's `tensor` (flat) into `output`, in axis-rank order
        (blocking)."""
        n = self.axis_size(axis)
        if n == 1:
            output.copy_(tensor.reshape(output.shape))
            return output
        start = time.perf_counter()
        with self._named("all_gather", axis):
            dist.all_gather_single(output, tensor, group=self._group(axis))
        nbytes = ring_all_gather_bytes(tensor.numel() * tensor.element_size(), n)
        self._timed(("all_gather", axis, codec), nbytes, None, start, False)
        return output

    def all_gather_into_async(self, output: torch.Tensor, tensor: torch.Tensor,
                              axis: str = "dp") -> CommHandle:
        """:meth:`all_gather_into` run by the backend in the background (its own threads or
        streams): ``output`` is complete once the handle's ``wait()`` returns."""
        n = self.axis_size(axis)
        if n == 1:
            output.copy_(tensor.reshape(output.shape))
            return CommHandle(None)
        start = time.perf_counter()
        with self._named("all_gather", axis):
            work = dist.all_gather_single(output, tensor, group=self._group(axis),
                                          async_op=True)
        nbytes = ring_all_gather_bytes(tensor.numel() * tensor.element_size(), n)
        return self._timed(("all_gather", axis, "none"), nbytes, work, start, True)

    def exchange_async(self, reduce_scatters: list[tuple[torch.Tensor, torch.Tensor]],
                       all_gathers: list[tuple[torch.Tensor, torch.Tensor]],
                       axis: str = "dp") -> CommHandle:
        """Several reduce-scatters ``(output, tensor)`` and all-gathers ``(output, shard)``
        over one axis, carried by one all-to-all: what rank j gets from this rank is chunk j of
        every reduce-scatter's input and this rank's shard of every all-gather. ``wait()`` sums
        the reduce-scatters' chunks (in axis-rank order) into their outputs and lays out the
        gathered shards. The wire carries exactly the parts' bytes; what it saves is the fixed
        cost of each collective (a rendezvous of the ranks, the backend's start-up), which on
        gloo is most of a small collective's time. All tensors flat, of one dtype."""
        n = self.axis_size(axis)
        parts = [(out.numel(), src.view(n, -1) if n > 1 else src.view(1, -1))
                 for out, src in reduce_scatters]
        parts += [(shard.numel(), shard.view(1, -1)) for _, shard in all_gathers]
        width = sum(size for size, _ in parts)
        first = (reduce_scatters or all_gathers)[0][1]
        send = torch.empty(n, width, dtype=first.dtype, device=first.device)
        offset = 0
        for size, rows in parts:
            send[:, offset:offset + size].copy_(rows)  # a shard is broadcast to every row
            offset += size
        received = torch.empty_like(send) if n > 1 else send

        def unpack() -> None:
            at = 0
            for out, _ in reduce_scatters:
                sum_rows(out, received[:, at:at + out.numel()])
                at += out.numel()
            for out, shard in all_gathers:
                out.view(n, -1).copy_(received[:, at:at + shard.numel()])
                at += shard.numel()

        if n == 1:
            unpack()
            return CommHandle(None)
        start = time.perf_counter()
        with self._named("exchange", axis):
            work = dist.all_to_all_single(received, send, group=self._group(axis),
                                          async_op=True)
        size_of = send.element_size()
        counts = [(("reduce_scatter", axis, "none"), (n - 1) / n * src.numel() * size_of)
                  for _, src in reduce_scatters]
        counts += [(("all_gather", axis, "none"), float((n - 1) * shard.numel() * size_of))
                   for _, shard in all_gathers]
        total = sum(nbytes for _, nbytes in counts) or 1.0

        def done(_fut: torch.futures.Future) -> None:
            # One all-to-all's time, shared among its parts by their bytes.
            seconds = time.perf_counter() - start
            for key, nbytes in counts:
                self.stats.record(key, nbytes, seconds * nbytes / total)

        work.get_future().add_done_callback(done)
        return CommHandle(work, "exchange", axis, lambda: self._group_ranks(axis), then=unpack)

    def reduce_scatter_into(self, output: torch.Tensor, tensor: torch.Tensor, axis: str = "dp",
                            async_op: bool = False) -> CommHandle:
        """Sum ``tensor`` (flat, ``n`` equal chunks) over the axis; this rank's chunk of the sum
        lands in ``output``, in axis-rank order (the ring moves (n-1)/n of ``tensor``)."""
        n = self.axis_size(axis)
        if n == 1:
            output.copy_(tensor.reshape(output.shape))
            return CommHandle(None)
        key = ("reduce_scatter", axis, "none")
        nbytes = (n - 1) / n * tensor.numel() * tensor.element_size()
        start = time.perf_counter()
        if self._gloo(axis):
            # The chunks to their owners, summed here in axis-rank order (see the module's
            # docstring: gloo's reduce-scatter sends an all-reduce's bytes).
            with self._named("reduce_scatter", axis):
                work, finish = all_to_all_reduce_scatter(output, tensor, n, self._group(axis),
                                                         async_op)
            return self._timed(key, nbytes, work, start, async_op, then=finish)
        with self._named("reduce_scatter", axis):
            work = dist.reduce_scatter_single(output, tensor, group=self._group(axis),
                                              async_op=async_op)
        return self._timed(key, nbytes, work, start, async_op)

    def _gloo(self, axis: str) -> bool:
        """Whether the axis' collectives run on gloo (looked up once per axis)."""
        if axis not in self._backend_of:
            self._backend_of[axis] = dist.get_backend(self._group(axis))
        return self._backend_of[axis] == "gloo"

    def axis_rank(self, axis: str) -> int:
        """This rank's index along a mesh axis (0 when not distributed)."""
        if not dist.is_initialized():
            return 0
        return dist.get_rank() if axis == "world" else self.dims.axis_rank(axis)

    def send(self, tensor: torch.Tensor, dst_axis_rank: int, axis: str = "pp",
             tag: int = 0) -> CommHandle:
        """Non-blocking point-to-point send to the rank at `dst_axis_rank` of the axis."""
        group = self._group(axis)
        dst = dst_axis_rank if group is None else dist.get_global_rank(group, dst_axis_rank)
        start = time.perf_counter()
        with self._named("send", axis):
            work = dist.isend(tensor.contiguous(), dst=dst, tag=tag)
        nbytes = tensor.numel() * tensor.element_size()
        return self._timed(("send", axis, "none"), nbytes, work, start, True)

    def recv(self, tensor: torch.Tensor, src_axis_rank: int, axis: str = "pp",
             tag: int = 0) -> None:
        """Blocking point-to-point receive into `tensor` from `src_axis_rank` of the axis."""
        group = self._group(axis)
        src = src_axis_rank if group is None else dist.get_global_rank(group, src_axis_rank)
        start = time.perf_counter()
        with self._named("recv", axis):
            dist.recv(tensor, src=src, tag=tag)
        self._timed(("recv", axis, "none"), 0.0, None, start, False)

    def irecv(self, tensor: torch.Tensor, src_axis_rank: int, axis: str = "pp",
              tag: int = 0) -> CommHandle:
        """Non-blocking point-to-point receive into `tensor`; ``wait()`` on the handle."""
        group = self._group(axis)
        src = src_axis_rank if group is None else dist.get_global_rank(group, src_axis_rank)
        start = time.perf_counter()
        with self._named("recv", axis):
            work = dist.irecv(tensor, src=src, tag=tag)
        return self._timed(("recv", axis, "none"), 0.0, work, start, True)

    def barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size() > 1:
            start = time.perf_counter()
            with self._named("barrier", "world"):
                dist.barrier()
            self._timed(("barrier", "world", "none"), 0.0, None, start, False)
