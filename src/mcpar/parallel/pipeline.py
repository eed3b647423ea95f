"""Pipeline parallelism: schedules of micro-batch tasks and the executor that runs one rank's share.

Why not ``torch.distributed.pipelining``: there the schedule object owns the order of tasks and
issues its own point-to-point operations. In mcpar the ComputeController owns the task schedule
(it decides which forward/backward of which stage runs when, and later balances and re-plans it),
and every activation and activation-gradient must cross the wire through the
CommunicationController, so that the bytes and seconds it reports are true counts. So the
schedule here is plain data (a list of ``Action`` per rank), built by ``build_schedule``, and
``PipelineExecutor`` runs that list with the controller's ``send`` (non-blocking) and ``recv``
(blocking).

Layout: with ``pp`` ranks and ``v`` virtual stages per rank the model is cut into ``pp * v``
global stages; rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` (its local chunks 0..v-1),
Megatron-LM's interleaved layout. With ``v = 1`` this is the plain layout, stage ``r`` on rank
``r``.

Schedules (one optimizer step of ``m`` micro-batches):

- ``gpipe``: every forward, then every backward. Holds all ``m`` micro-batches' activations.
- ``1f1b``: ``pp - rank - 1`` warm-up forwards, then one forward / one backward alternately, then
  the remaining backwards. Same bubble as GPipe, ``(pp-1)/(m+pp-1)`` of the step idle, but at
  most ``pp - rank`` micro-batches in flight. Works for any ``m >= 1`` (the warm-up is capped).
- ``interleaved_1f1b``: Megatron-LM's interleaved schedule over ``v >= 2`` chunks per rank; the
  bubble shrinks to ``(pp-1)/(v m + pp-1)``, paid for with ``v`` times the point-to-point traffic.
  Micro-batches go through the chunks in groups of ``pp``, so ``m`` must be a multiple of ``pp``.

Deadlock freedom: a task waits only for the task it depends on (the forward of the previous
global stage, or the backward of the next), sends never block, and every message has a tag unique
to (kind, sending stage, micro-batch), so a receive can never take another task's message, whatever
order the ranks reach them in. The tests simulate every rank's list together to show each
schedule completes. They also check that, between any two ranks, messages are received in the
order they are sent, so a backend that matches point-to-point messages by order rather than by tag
(NCCL) pairs them the same way.

Timing: ``last_stats`` records host wall-clock time around each task. On CPU that is the compute;
on CUDA the kernels are asynchronous and the figures show only the host side.
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

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    """One task of a rank's schedule: the forward ("F") or backward ("B") of a chunk."""

    kind: str  # "F" or "B"
    chunk: int  # local virtual chunk index on this rank, 0..virtual_stages-1
    micro: int  # micro-batch index


def global_stage(chunk: int, pp_rank: int, pp: int) -> int:
    """The global stage index of local chunk `chunk` on pipeline rank `pp_rank`."""
    return chunk * pp + pp_rank


def schedule_problem(schedule: str, pp: int, num_microbatches: int,
                     virtual_stages: int) -> str | None:
    """None if the schedule can run with these degrees, else a one-line reason with the fix."""
    if schedule not in SCHEDULES:
        return f"unknown pipeline schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}"
    if pp < 1:
        return f"pipeline degree must be at least 1, got {pp}"
    if num_microbatches < 1:
        return f"a pipeline step needs at least 1 micro-batch, got {num_microbatches}"
    if virtual_stages < 1:
        return f"virtual_stages must be at least 1, got {virtual_stages}"
    if schedule != "interleaved_1f1b":
        if virtual_stages != 1:
            return (f"schedule {schedule} runs one stage per rank, but virtual_stages is "
                    f"{virtual_stages}; use schedule interleaved_1f1b or virtual_stages 1")
        return None
    if virtual_stages < 2:
        return ("schedule interleaved_1f1b needs virtual_stages >= 2 (stages per rank); "
                "set virtual_stages or use schedule 1f1b")
    if pp < 2:
        return "schedule interleaved_1f1b needs a pipeline of at least 2 ranks; use 1f1b"
    if num_microbatches < pp or num_microbatches % pp:
        # Micro-batches go through the chunks in groups of pp (Megatron-LM's order), and the
        # order cannot express a partial group.
        return (f"schedule interleaved_1f1b needs the number of micro-batches "
                f"({num_microbatches}) to be a multiple of the pipeline degree {pp} (at least "
                f"{pp}); raise gradient_accumulation to a multiple of {pp}")
    return None


def _interleaved_action(kind: str, k: int, pp: int, v: int) -> Action:
    # The k-th forward (or backward) of this rank, in Megatron-LM's order: groups of pp
    # micro-batches sweep the chunks in turn (backwards in reverse chunk order).
    chunk = (k // pp) % v
    if kind == "B":
        chunk = v - 1 - chunk
    return Action(kind, chunk, (k // (pp * v)) * pp + k % pp)


def build_schedule(schedule: str, pp_rank: int, pp: int, num_microbatches: int,
                   virtual_stages: int = 1) -> list[Action]:
    """The ordered tasks of one optimizer step on pipeline rank `pp_rank`."""
    reason = schedule_problem(schedule, pp, num_microbatches, virtual_stages)
    if reason is not None:
        raise ValueError(reason)
    if not 0 <= pp_rank < pp:
        raise ValueError(f"pp_rank {pp_rank} is outside the pipeline of {pp} ranks")
    m = num_microbatches
    if schedule == "gpipe":
        return [Action("F", 0, i) for i in range(m)] + [Action("B", 0, i) for i in range(m)]
    if schedule == "1f1b":
        total, warmup = m, min(pp - pp_rank - 1, m)

        def fwd(k: int) -> Action:
            return Action("F", 0, k)

        def bwd(k: int) -> Action:
            return Action("B", 0, k)
    else:
        v = virtual_stages
        total = m * v
        # Megatron-LM's warm-up: enough forwards that the rank's first backward has arrived by
        # the time it is needed (2 per downstream rank, plus one sweep of the other chunks).
        warmup = min((pp - pp_rank - 1) * 2 + (v - 1) * pp, total)

        def fwd(k: int) -> Action:
            return _interleaved_action("F", k, pp, v)

        def bwd(k: int) -> Action:
            return _interleaved_action("B", k, pp, v)

    actions = [fwd(k) for k in range(warmup)]
    steady = total - warmup
    for k in range(steady):
        actions += [fwd(warmup + k), bwd(k)]
    actions += [bwd(k) for k in range(steady, total)]
    return actions


@dataclass
class PipelineStats:
    """Timings of the last ``run``: seconds, relative to its start."""

    busy_s: float = 0.0  # inside forward/backward compute (the loss included)
    total_s: float = 0.0  # wall time of the whole run on this rank
    # (kind, chunk, micro, start, end) per task, in the order run, for timelines and benches
    actions: list[tuple[str, int, int, float, float]] = field(default_factory=list)

    @property
    def idle_fraction(self) -> float:
        # Against this rank's own wall time. Ranks start and end a step at different moments, so
        # the bubble of a training loop is 1 - busy_s / (the slowest rank's total_s), which is
        # what bench/pipeline_bubble.py reports.
        return 1.0 - self.busy_s / self.total_s if self.total_s > 0 else 0.0


class PipelineExecutor:
    """Runs one pipeline rank's tasks of an optimizer step, following ``build_schedule``.

    ``chunks[c]`` is the module of global stage ``global_stage(c, pp_rank, pp)``. The first global
    stage takes token ids ``[micro_batch, seq]``; every other stage receives activations of
    ``activation_shape`` (dtype ``activation_dtype``) from the previous global stage; the last
    stage's output goes to ``loss_fn(output, targets)``, a scalar mean loss.
    ``forward_context()`` wraps each forward (the trainer passes bf16 autocast).
    ``before_last_backward(chunk)`` is called just before the last backward of each chunk in the
    step, so that gradient all-reduces can be armed to overlap with it.
    """

    def __init__(self, chunks: list[nn.Module], pp_rank: int, pp: int,
                 comm: Communicator, schedule: str, num_microbatches: int,
                 activation_shape: tuple[int, ...],
                 loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                 device: torch.device, activation_dtype: torch.dtype = torch.float32,
                 forward_context: Callable[[], AbstractContextManager] = contextlib.nullcontext,
                 before_last_backward: Callable[[int], None] | None = None):
        self.chunks = chunks
        self.pp_rank = pp_rank
        self.pp = pp
        self.virtual_stages = len(chunks)
        self.num_stages = pp * self.virtual_stages
        self.comm = comm
        self.schedule = schedule
        self.num_microbatches = num_microbatches
        self.activation_shape = tuple(activation_shape)
        self.loss_fn = loss_fn
        self.device = device
        self.activation_dtype = activation_dtype
        self.forward_context = forward_context
        self.before_last_backward = before_last_backward
        # Raises the schedule's own error (e.g. too few micro-batches for interleaving).
        self.actions = build_schedule(schedule, pp_rank, pp, num_microbatches,
                                      self.virtual_stages)
        self._last_backward_index = {a.chunk: i for i, a in enumerate(self.actions)
                                     if a.kind == "B"}
        self.last_stats = PipelineStats()
        # Per-run state, set by run() and cleared when it ends.
        self._inputs: list[torch.Tensor] | None = None
        self._targets: list[torch.Tensor] | None = None
        # (chunk, micro) -> (received input or None, stage output or scaled loss)
        self._saved: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._sends: list[tuple[CommHandle, torch.Tensor]] = []
        self._losses: dict[int, torch.Tensor] = {}
        self._start = 0.0

    # -- layout helpers -------------------------------------------------------------------------

    def stage_of(self, chunk: int) -> int:
        return global_stage(chunk, self.pp_rank, self.pp)

    @property
    def holds_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def holds_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def _rank_of_stage(self, stage: int) -> int:
        return stage % self.pp

    def _tag(self, kind: str, sending_stage: int, micro: int) -> int:
        # Unique per (kind, sending stage, micro-batch) within a step; every message of a step
        # is received before run() returns, so reusing tags across steps cannot mix them up.
        return (sending_stage * self.num_microbatches + micro) * 2 + (kind == "B")

    # -- the step -------------------------------------------------------------------------------

    def run(self, inputs: list[torch.Tensor] | None,
            targets: list[torch.Tensor] | None) -> list[float]:
        """Forward and backward of every micro-batch of one step; gradients accumulate in .grad.

        `inputs` (token micro-batches) is needed only on the rank holding the first stage,
        `targets` only on the rank holding the last. Returns the unscaled per-micro-batch losses
        on the last-stage rank, [] elsewhere.
        """
        m = self.num_microbatches
        for name, batches, needed in (("inputs", inputs, self.holds_first_stage),
                                      ("targets", targets, self.holds_last_stage)):
            if needed and (batches is None or len(batches) != m):
                got = "none" if batches is None else len(batches)
                raise ValueError(f"pipeline rank {self.pp_rank} needs {m} micro-batches of "
                                 f"{name}, got {got}")
        self._inputs, self._targets = inputs, targets
        self._saved, self._sends, self._losses = {}, [], {}
        stats = PipelineStats()
        self._start = time.perf_counter()
        try:
            with torch.enable_grad():
                for index, action in enumerate(self.actions):
                    if action.kind == "F":
                        begin, end = self._forward(action.chunk, action.micro)
                    else:
                        begin, end = self._backward(action.chunk, action.micro, index)
                    stats.busy_s += end - begin
                    stats.actions.append((action.kind, action.chunk, action.micro, begin, end))
            # A send's buffer must outlive it, and the peer has received everything of this
            # step once these complete.
            for handle, _tensor in self._sends:
                handle.wait()
            # Read back once, at the end: .item() per micro-batch would stall a GPU's queue.
            losses = [float(self._losses[i]) for i in range(m)] if self._losses else []
        finally:
            self._saved, self._sends, self._losses = {}, [], {}
            self._inputs = self._targets = None
        stats.total_s = time.perf_counter() - self._start
        self.last_stats = stats
        return losses

    def _now(self) -> float:
        return time.perf_counter() - self._start

    def _forward(self, chunk: int, micro: int) -> tuple[float, float]:
        stage = self.stage_of(chunk)
        received: torch.Tensor | None = None
        if stage == 0:
            assert self._inputs is not None
            x = self._inputs[micro].to(self.device)
        else:
            received = torch.empty(self.activation_shape, dtype=self.activation_dtype,
                                   device=self.device)
            self.comm.recv(received, self._rank_of_stage(stage - 1), axis="pp",
                           tag=self._tag("F", stage - 1, micro))
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
        self._send(out.detach().to(self.activation_dtype), stage + 1, "F", stage, micro)
        return begin, end

    def _backward(self, chunk: int, micro: int, index: int) -> tuple[float, float]:
        stage = self.stage_of(chunk)
        received, out = self._saved.pop((chunk, micro))
        grad_out: torch.Tensor | None = None
        if stage != self.num_stages - 1:
            grad = torch.empty(self.activation_shape, dtype=self.activation_dtype,
                               device=self.device)
            self.comm.recv(grad, self._rank_of_stage(stage + 1), axis="pp",
                           tag=self._tag("B", stage + 1, micro))
            grad_out = grad.to(out.dtype)
        if self.before_last_backward is not None and self._last_backward_index[chunk] == index:
            self.before_last_backward(chunk)
        begin = self._now()
        torch.autograd.backward(out, grad_out)
        end = self._now()
        if stage > 0:
            assert received is not None
            # A stage that ignores its input still owes the previous stage a gradient message.
            grad_in = received.grad if received.grad is not None else torch.zeros_like(received)
            self._send(grad_in, stage - 1, "B", stage, micro)
        return begin, end

    def _send(self, tensor: torch.Tensor, to_stage: int, kind: str, from_stage: int,
              micro: int) -> None:
        handle = self.comm.send(tensor, self._rank_of_stage(to_stage), axis="pp",
                                tag=self._tag(kind, from_stage, micro))
        self._sends.append((handle, tensor))
