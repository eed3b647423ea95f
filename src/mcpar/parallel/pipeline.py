"""The stage executor: runs one rank's stage tasks of a step (forward, backward, sends, receives).

Why not ``torch.distributed.pipelining``: there the schedule object owns the order of tasks and
issues its own point-to-point operations. In mcpar the ComputeController owns the order (its
schedules, ``mcpar.controllers.compute.schedules``, generate each step's task list, and it runs
that list), and every activation and activation-gradient must cross the wire through the
Communicator, so that the bytes and seconds it reports are true counts. So this executor only
knows how to run ONE task (``run_task``), with the Communicator's ``send`` (non-blocking) and
``recv`` (blocking) or ``irecv``; the same executor runs a step without a pipeline (one stage that
is both first and last).

Receives: given each peer's messages in its send order (``send_order``, the ComputeController's
plan), the executor posts its receives in that order, and keeps ``receives_ahead`` of them
posted per peer before their tasks come round, where the backend lets it
(``mcpar.device_kernels.pipeline_receives_ahead`` says where, and why not on NCCL): a message
then lands while the rank computes, instead of starting to move when the rank asks for it.

Layout: by default rank ``r`` of ``pp`` holds global stages ``r, r + pp, ...`` (its local chunks
0..v-1); a schedule may place them otherwise (the V of ``zbv``), and then the executor is given
the placement (``stages``: this rank's chunks' global stages; ``stage_ranks``: the rank of every
global stage).

Timing: ``last_stats`` records host wall-clock time around each compute task. On CPU that is the
compute; on CUDA the kernels are asynchronous and the figures show only the host side.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch
from torch import nn

from mcpar.comm.communicator import CommHandle, Communicator
from mcpar.parallel.tasks import STAGE_TASKS, Task, TaskKind
from mcpar.parallel.weight_grad import WeightGradStore
from mcpar.registry.schedule import placed_stage


def global_stage(chunk: int, pp_rank: int, pp: int, placement: str = "round_robin") -> int:
    """The global stage index of local chunk `chunk` on pipeline rank `pp_rank` (the rule:
    ``mcpar.registry.schedule.placed_stage``)."""
    return placed_stage(chunk, pp_rank, pp, placement)


def _not_counted(_tensor: torch.Tensor | None) -> AbstractContextManager[object]:
    return contextlib.nullcontext()


@dataclass
class PipelineStats:
    """Timings of the last ``run``: seconds, relative to its start."""

    # ``time.perf_counter()`` at the run's start: the clock is the host's monotonic one, so
    # the ranks of one host can lay their actions on one timeline (a bench's trace replay)
    started_at: float = 0.0
    busy_s: float = 0.0  # inside forward/backward compute (the loss included)
    total_s: float = 0.0  # wall time of the whole run on this rank
    # (kind, chunk, micro, start, end) per task, in the order run, for timelines and benches
    actions: list[tuple[str, int, int, float, float]] = field(default_factory=list)
    # The most bytes of receive buffers posted and not yet read at once (receives posted ahead)
    posted_peak_bytes: int = 0


class PipelineExecutor:
    """Runs one pipeline rank's stage tasks (``mcpar.parallel.tasks``) of an optimizer step.

    ``chunks[c]`` is the module of global stage ``global_stage(c, pp_rank, pp)``. The first global
    stage takes token ids ``[micro_batch, seq]``; every other stage receives activations of
    ``activation_shape`` (dtype ``activation_dtype``) from the previous global stage; the last
    stage's output goes to ``loss_fn(output, targets)``, a scalar mean loss.
    ``forward_context()`` wraps each forward (the trainer passes bf16 autocast).
    ``weight_grads``: under a schedule that splits the backward, the store the chunks' linear
    layers defer their weight gradients to (``split_weight_grads``): a BACKWARD task is then B,
    and a WEIGHT_GRAD task the W of the same (chunk, micro-batch).

    A step is ``begin(inputs, targets)``, ``run_task(task)`` for each of its stage tasks in the
    order the ComputeController gives, then ``end()``; ``run(inputs, targets, tasks)`` does all
    three.
    """

    def __init__(self, chunks: list[nn.Module], pp_rank: int, pp: int,
                 comm: Communicator, num_microbatches: int,
                 activation_shape: tuple[int, ...],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, activation_dtype: torch.dtype = torch.float32,
                 forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 weight_grads: WeightGradStore | None = None,
                 stages: list[int] | None = None, stage_ranks: list[int] | None = None,
                 send_order: dict[int, list[tuple[str, int, int]]] | None = None,
                 receives_ahead: int = 0):
        self.chunks = chunks
        self.weight_grads = weight_grads
        self.pp_rank = pp_rank
        self.pp = pp
        self.virtual_stages = len(chunks)
        self.num_stages = pp * self.virtual_stages
        self.stages = stages if stages is not None else [
            global_stage(c, pp_rank, pp) for c in range(self.virtual_stages)]
        self.stage_ranks = stage_ranks if stage_ranks is not None else [
            s % pp for s in range(self.num_stages)]
        # Peer -> its messages to this rank, (kind, sending stage, micro-batch), in its send
        # order (None: each receive is a blocking one when its task comes). Receives are posted
        # in that order, so that a backend matching point-to-point messages by order, not tag
        # (NCCL), pairs them right where a rank reads a peer's messages in another order (a V).
        self.send_order = send_order
        # Receives kept posted per peer ahead of their tasks (with ``send_order`` only).
        self.receives_ahead = receives_ahead if send_order is not None else 0
        self._posted: dict[tuple[str, int, int], tuple[CommHandle, torch.Tensor]] = {}
        self._posted_upto: dict[int, int] = {}
        self._unread: dict[int, int] = {}  # peer -> receives posted and not read yet
        self.comm = comm
        self.num_microbatches = num_microbatches
        self.activation_shape = tuple(activation_shape)
        self.loss_fn = loss_fn
        self.device = device
        self.activation_dtype = activation_dtype
        self.forward_context = forward_context
        self.last_stats = PipelineStats()
        # What holds the gradient a backward receives while that backward runs: a memory
        # meter's ``holding`` counts it with the activations (the trainer sets it).
        self.hold_received: Callable[[torch.Tensor | None], AbstractContextManager[object]] = \
            _not_counted
        # Per-step state, set by begin() and cleared by end().
        self._inputs: list[torch.Tensor] | None = None
        self._targets: list[torch.Tensor] | None = None
        self._received: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, micro) -> input
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, micro) -> output
        self._grads: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, micro) -> output grad
        # (chunk, micro) -> (received input or None, stage output or scaled loss)
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._sends: list[tuple[CommHandle, torch.Tensor]] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._stats = PipelineStats()
        self._start = 0.0

    def forward_only_loss(self, inputs: torch.Tensor, targets: torch.Tensor,
                          loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                          tag_base: int) -> float | None:
        """Forward-only pass of one micro-batch through every stage in order (validation);
        the loss on the rank holding the last stage, None elsewhere. ``tag_base`` keeps its
        messages apart from the training steps'."""
        pending: list[CommHandle] = []
        loss = None
        shape = (inputs.shape[0], *self.activation_shape[1:])
        carried: torch.Tensor | None = None  # the previous stage's output, when it is ours
        for stage in range(self.num_stages):
            if stage not in self.stages:
                continue
            if stage == 0:
                x = inputs
            elif self._rank_of_stage(stage - 1) == self.pp_rank:
                assert carried is not None
                x = carried
            else:
                x = torch.empty(shape, dtype=self.activation_dtype, device=self.device)
                self.comm.recv(x, self._rank_of_stage(stage - 1), axis="pp",
                               tag=tag_base + stage)
            with self.forward_context():
                out = self.chunks[self.stages.index(stage)](x)
            if stage == self.num_stages - 1:
                loss = loss_fn(out, targets).item()
            elif self._rank_of_stage(stage + 1) == self.pp_rank:
                carried = out.to(self.activation_dtype)
            else:
                out = out.to(self.activation_dtype)
                pending.append(self.comm.send(out, self._rank_of_stage(stage + 1), axis="pp",
                                              tag=tag_base + stage + 1))
        for handle in pending:
            handle.wait()
        return loss

    # -- layout helpers -------------------------------------------------------------------------

    def stage_of(self, chunk: int) -> int:
        return self.stages[chunk]

    @property
    def holds_first_stage(self) -> bool:
        return 0 in self.stages

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    def _rank_of_stage(self, stage: int) -> int:
        return self.stage_ranks[stage]

    def _tag(self, kind: str, sending_stage: int, micro: int) -> int:
        # Unique per (kind, sending stage, micro-batch) within a step; every message of a step
        # is received before the step ends, so reusing tags across steps cannot mix them up.
        return (sending_stage * self.num_microbatches + micro) * 2 + (kind == "B")

    # -- the step -------------------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor] | None, targets: list[torch.Tensor] | None,
            tasks: list[Task]) -> list[float]:
        """Run the stage tasks of ``tasks`` (others are skipped) as one step; see ``end``."""
        self.begin(inputs, targets)
        try:
            for task in tasks:
                if task.kind in STAGE_TASKS:
                    self.run_task(task)
        except BaseException:
            self.abort()
            raise
        return self.end()

    def begin(self, inputs: list[torch.Tensor] | None,
              targets: list[torch.Tensor] | None) -> None:
        """Start a step. `inputs` (token micro-batches) is needed only on the rank holding the
        first stage, `targets` only on the rank holding the last."""
        m = self.num_microbatches
        for name, batches, needed in (("inputs", inputs, self.holds_first_stage),
                                      ("targets", targets, self.holds_last_stage)):
            if needed and (batches is None or len(batches) != m):
                got = "none" if batches is None else len(batches)
                raise ValueError(f"pipeline rank {self.pp_rank} needs {m} micro-batches of "
                                 f"{name}, got {got}")
        self._inputs, self._targets = inputs, targets
        self._start = time.perf_counter()
        self._stats = PipelineStats(started_at=self._start)
        for src in self.send_order or {}:
            self._post_ahead(src)

    def run_task(self, task: Task) -> None:
        """Run one stage task (gradients accumulate in .grad)."""
        kind, chunk, micro = task.kind, task.chunk, task.micro
        with torch.enable_grad():
            if kind is TaskKind.RECV_ACTIVATION:
                self._recv_activation(chunk, micro)
            elif kind is TaskKind.FORWARD:
                self._timed("F", chunk, micro, self._forward)
            elif kind is TaskKind.SEND_ACTIVATION:
                self._send_activation(chunk, micro)
            elif kind is TaskKind.RECV_GRAD:
                self._recv_grad(chunk, micro)
            elif kind is TaskKind.BACKWARD:
                self._timed("B", chunk, micro, self._backward)
            elif kind is TaskKind.SEND_GRAD:
                self._send_grad(chunk, micro)
            elif kind is TaskKind.WEIGHT_GRAD:
                self._timed("W", chunk, micro, self._weight_grad)
            elif kind is TaskKind.WAIT_SENDS:
                # A send's buffer must outlive it, and the peer has received everything of
                # this step once these complete.
                for handle, _tensor in self._sends:
                    handle.wait()
                self._sends = []
            else:
                raise ValueError(f"{task} is not a stage task")

    def end(self) -> list[float]:
        """Finish the step: the unscaled per-micro-batch losses on the last-stage rank, []
        elsewhere."""
        try:
            for handle, _tensor in self._sends:
                handle.wait()
            # Read back once, at the end: .item() per micro-batch would stall a GPU's queue.
            m = self.num_microbatches
            losses = [float(self._losses[i]) for i in range(m)] if self._losses else []
        finally:
            self.abort()
        self._stats.total_s = time.perf_counter() - self._start
        self.last_stats = self._stats
        return losses

    def abort(self) -> None:
        """Drop the step's state (after a failure, or at its end). After a failure, receives
        still posted are dropped unread: the failure ends the worker, and the job restarts."""
        self._received, self._outputs, self._grads, self._saved = {}, {}, {}, {}
        self._sends, self._losses = [], {}
        self._posted, self._posted_upto, self._unread = {}, {}, {}
        self._inputs = self._targets = None
        if self.weight_grads is not None:
            self.weight_grads.clear()

    def _now(self) -> float:
        return time.perf_counter() - self._start

    def _timed(self, kind: str, chunk: int, micro: int,
               fn: Callable[[int, int], tuple[float, float]]) -> None:
        begin, end = fn(chunk, micro)
        self._stats.busy_s += end - begin
        self._stats.actions.append((kind, chunk, micro, begin, end))

    def _recv_activation(self, chunk: int, micro: int) -> None:
        stage = self.stage_of(chunk)
        if self._rank_of_stage(stage - 1) == self.pp_rank:
            return  # the previous stage is this rank's too (a V's turn): handed over by _send
        self._received[(chunk, micro)] = self._receive("F", stage - 1, micro)

    def _receive(self, kind: str, from_stage: int, micro: int) -> torch.Tensor:
        """The message of ``from_stage``'s task ``kind`` for ``micro`` (blocks until it is in)."""
        src = self._rank_of_stage(from_stage)
        if self.send_order is None:
            tensor = torch.empty(self.activation_shape, dtype=self.activation_dtype,
                                 device=self.device)
            self.comm.recv(tensor, src, axis="pp", tag=self._tag(kind, from_stage, micro))
            return tensor
        key = (kind, from_stage, micro)
        while key not in self._posted:  # post the peer's earlier messages first, in order
            self._post_next(src)
        handle, tensor = self._posted.pop(key)
        self._unread[src] -= 1
        self._post_ahead(src)
        handle.wait()
        return tensor

    def _post_next(self, src: int) -> None:
        """Post the receive of ``src``'s next message in its send order."""
        position = self._posted_upto.get(src, 0)
        message = self.send_order[src][position]  # type: ignore[index]
        self._posted_upto[src] = position + 1
        self._unread[src] = self._unread.get(src, 0) + 1
        tensor = torch.empty(self.activation_shape, dtype=self.activation_dtype,
                             device=self.device)
        self._posted[message] = (self.comm.irecv(tensor, src, axis="pp",
                                                 tag=self._tag(*message)), tensor)
        # Every buffer is one activation's: the posted bytes are their count times its size.
        posted = len(self._posted) * tensor.untyped_storage().nbytes()
        self._stats.posted_peak_bytes = max(self._stats.posted_peak_bytes, posted)

    def _post_ahead(self, src: int) -> None:
        """Keep ``receives_ahead`` of ``src``'s messages posted (while it has more this step)."""
        total = len(self.send_order[src])  # type: ignore[index]
        while (self._unread.get(src, 0) < self.receives_ahead
               and self._posted_upto.get(src, 0) < total):
            self._post_next(src)

    def _forward(self, chunk: int, micro: int) -> tuple[float, float]:
        stage = self.stage_of(chunk)
        received: torch.Tensor | None = None
        if stage == 0:
            assert self._inputs is not None
            x = self._inputs[micro].to(self.device)
        else:
            received = self._received.pop((chunk, micro))
            # A leaf of this rank's graph: its .grad is what goes back to the previous stage.
            x = received.requires_grad_()
        begin = self._now()
        with self.forward_context():
            out = self.chunks[chunk](x)
        if stage == self.num_stages - 1:
            assert self._targets is not None
            loss = self.loss_fn(out, self._targets[micro].to(self.device))
            self._losses[micro] = loss.detach()
            # Mean over micro-batches, as the single-process run with accumulation computes it.
            self._saved[(chunk, micro)] = (received, loss / self.num_microbatches)
            return begin, self._now()
        self._saved[(chunk, micro)] = (received, out)
        end = self._now()
        if tuple(out.shape) != self.activation_shape:
            raise ValueError(f"stage {stage} produced activations of shape {tuple(out.shape)}, "
                             f"but the pipeline was set up for {self.activation_shape}")
        self._outputs[(chunk, micro)] = out
        return begin, end

    def _send_activation(self, chunk: int, micro: int) -> None:
        stage = self.stage_of(chunk)
        out = self._outputs.pop((chunk, micro))
        self._send(out.detach().to(self.activation_dtype), stage + 1, "F", stage, micro)

    def _recv_grad(self, chunk: int, micro: int) -> None:
        stage = self.stage_of(chunk)
        if self._rank_of_stage(stage + 1) == self.pp_rank:
            return  # handed over by _send, as for activations
        self._grads[(chunk, micro)] = self._receive("B", stage + 1, micro)

    def _backward(self, chunk: int, micro: int) -> tuple[float, float]:
        received, out = self._saved[(chunk, micro)]
        grad = self._grads.pop((chunk, micro), None)
        grad_out = grad.to(out.dtype) if grad is not None else None
        begin = self._now()
        if self.weight_grads is not None:
            # B: the linear layers keep their weight-gradient work under this key for W.
            self.weight_grads.capturing = (chunk, micro)
        try:
            with self.hold_received(grad_out):
                torch.autograd.backward(out, grad_out)
        finally:
            if self.weight_grads is not None:
                self.weight_grads.capturing = None
        end = self._now()
        if received is None:
            del self._saved[(chunk, micro)]
        return begin, end

    def _weight_grad(self, chunk: int, micro: int) -> tuple[float, float]:
        if self.weight_grads is None:
            raise ValueError(f"a weight-gradient task (chunk {chunk}, micro-batch {micro}) "
                             "under a schedule that does not split the backward")
        begin = self._now()
        self.weight_grads.run((chunk, micro))
        return begin, self._now()

    def _send_grad(self, chunk: int, micro: int) -> None:
        stage = self.stage_of(chunk)
        received, _out = self._saved.pop((chunk, micro))
        assert received is not None
        # A stage that ignores its input still owes the previous stage a gradient message.
        grad_in = received.grad if received.grad is not None else torch.zeros_like(received)
        self._send(grad_in, stage - 1, "B", stage, micro)

    def _send(self, tensor: torch.Tensor, to_stage: int, kind: str, from_stage: int,
              micro: int) -> None:
        if self._rank_of_stage(to_stage) == self.pp_rank:
            # Both stages are this rank's: the tensor changes hands without the wire (a copy,
            # so that the next stage's input is a leaf of its own, as a received one is).
            local = self.stages.index(to_stage)
            into = self._received if kind == "F" else self._grads
            into[(local, micro)] = tensor.detach().clone()
            return
        handle = self.comm.send(tensor, self._rank_of_stage(to_stage), axis="pp",
                                tag=self._tag(kind, from_stage, micro))
        self._sends.append((handle, tensor))
