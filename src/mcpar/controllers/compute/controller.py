"""ComputeController: owns every task of an optimizer step, and their order.

Every layout's step is a list of tasks (``mcpar.parallel.tasks``) that this controller runs, in
the order its schedule generator gives (``schedules.step_tasks``): receive, forward and send of
each (stage chunk, micro-batch); receive, backward and send of its gradient; the arming of each
chunk's gradient buckets right before that chunk's last backward, so that their data-parallel
reduction starts as soon as each bucket is full and overlaps the rest of the schedule; waiting
for the sends and the reductions; the optimizer step. Under a schedule that splits the backward
(the zero-bubble schedules), a chunk's B and W tasks each arm the parameters whose gradients
they produce, before the chunk's last of each. Without a pipeline the step is the same list
with one stage. This is the seed's ``submit_task`` / ``schedule_tasks``.

Each task's start and end are kept in :attr:`ComputeController.task_log` (and the start of each
bucket's reduction, which the backward triggers), so a step's timeline can be read afterwards:
the tests read it to show the overlap, the benches to measure the exposed communication.

The other decisions of this controller live beside it: the stage cut (``stage_cut.py``), the
number of micro-batches (``batch_split.py``), the pipeline schedules (``schedules.py``) and the
expert load-balancing policy (``load_balance.py``, ``expert_balance.py``).
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from mcpar.parallel.pipeline import PipelineExecutor
from mcpar.parallel.tasks import STAGE_TASKS, Task, TaskKind


class GradientSync(Protocol):
    """What the controller needs of the CommunicationController's gradient sync."""

    on_launch: Callable[[int], None] | None

    def zero_grad(self) -> None: ...

    def arm(self, params: list[torch.nn.Parameter]) -> None: ...

    def finish(self) -> None: ...


@dataclass(frozen=True)
class TaskRecord:
    """One entry of the task log: seconds since the step started."""

    name: str  # a task kind's value, or 'reduce_start' for a bucket's reduction
    chunk: int
    micro: int  # the bucket's index for 'reduce_start'
    start: float
    end: float


StepBatch = tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]


class ComputeController:
    """Runs the tasks of each step through the stage executor, the gradient sync and the
    optimizer step it is given, and keeps the step's task log."""

    def __init__(self, tasks: list[Task], executor: PipelineExecutor,
                 chunk_params: list[list[torch.nn.Parameter]], grad_sync: GradientSync,
                 optimizer_step: Callable[[int, list[float]], object],
                 chunk_deferred: list[list[torch.nn.Parameter]] | None = None):
        """``tasks``: one step's tasks (the same every step); ``chunk_params[c]``: the
        parameters of local chunk c whose gradients its backward (B) computes,
        ``chunk_deferred[c]`` those its W tasks compute (a schedule that splits the backward);
        ``optimizer_step(step, losses)``: the update, run as the step's OPTIMIZER_STEP task; its
        result is what :meth:`run_step` returns."""
        self.tasks = tasks
        self.executor = executor
        self.chunk_params = chunk_params
        self.chunk_deferred = chunk_deferred or [[] for _ in chunk_params]
        self.grad_sync = grad_sync
        self.optimizer_step = optimizer_step
        self.num_microbatches = executor.num_microbatches
        self.task_log: list[TaskRecord] = []
        self._queue: deque[Task] = deque()
        self._step = 0
        self._losses: list[float] = []
        self._result: object = None
        self._start = 0.0
        self.trace_ranges = False  # set by the profiler: each task a named range of its trace
        # Called with the chunk after each of its backward (B) tasks: ZeRO-3's store frees the
        # chunk's gathered weights there.
        self.after_backward: Callable[[int], None] | None = None
        grad_sync.on_launch = self._log_reduce_start

    def submit_task(self, task: Task) -> None:
        self._queue.append(task)

    def schedule_tasks(self) -> None:
        """Run the queued tasks in order, logging each."""
        while self._queue:
            task = self._queue.popleft()
            begin = time.perf_counter() - self._start
            with (torch.profiler.record_function(f"mcpar.{task}") if self.trace_ranges
                  else contextlib.nullcontext()):
                self._run(task)
            self.task_log.append(TaskRecord(task.kind.value, task.chunk, task.micro, begin,
                                            time.perf_counter() - self._start))

    def _run(self, task: Task) -> None:
        if task.kind in STAGE_TASKS:
            self.executor.run_task(task)
            if task.kind is TaskKind.BACKWARD and self.after_backward is not None:
                self.after_backward(task.chunk)
        elif task.kind is TaskKind.SYNC_GRADS:
            self.grad_sync.arm(self.chunk_params[task.chunk])
        elif task.kind is TaskKind.SYNC_WEIGHT_GRADS:
            self.grad_sync.arm(self.chunk_deferred[task.chunk])
        elif task.kind is TaskKind.WAIT_GRADS:
            # The step's losses are read back here, once its compute is done.
            self._losses = self.executor.end()
            self.grad_sync.finish()
        elif task.kind is TaskKind.OPTIMIZER_STEP:
            self._result = self.optimizer_step(self._step, self._losses)
        else:
            raise ValueError(f"unknown task {task}")

    def _log_reduce_start(self, bucket_index: int) -> None:
        now = time.perf_counter() - self._start
        self.task_log.append(TaskRecord("reduce_start", 0, bucket_index, now, now))

    def run_step(self, step: int, batch: StepBatch) -> object:
        """Run every task of ``step`` on ``batch`` (the inputs of the first stage and the
        targets of the last, per micro-batch); returns the optimizer step's result."""
        self._step, self._losses, self._result = step, [], None
        self.task_log = []
        self.grad_sync.zero_grad()
        self._start = time.perf_counter()
        self.executor.begin(*batch)
        for task in self.tasks:
            self.submit_task(task)
        try:
            self.schedule_tasks()
        except BaseException:
            self._queue.clear()
            self.executor.abort()
            raise
        return self._result

    @property
    def step_start(self) -> float:
        """perf_counter() when the last step's first task began (the task log's zero)."""
        return self._start

    def grad_wait_start_s(self) -> float:
        """Seconds from the last step's start to its WAIT_GRADS task: when this rank had done
        its compute and came to wait for the gradient reductions (0 if the step had none)."""
        return next((r.start for r in self.task_log if r.name == TaskKind.WAIT_GRADS.value),
                    0.0)

    def exposed_comm_s(self) -> float:
        """Seconds of the last step spent waiting for gradient reductions after the compute
        (the WAIT_GRADS task): the communication the schedule did not hide."""
        return sum(r.end - r.start for r in self.task_log if r.name == TaskKind.WAIT_GRADS.value)
