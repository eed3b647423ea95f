"""ComputeController: owns the schedule of micro-batch tasks within an optimizer step.

Each step is a queue of tasks (the seed's ``submit_task`` / ``schedule_tasks``). With data
parallelism alone a task is the forward and backward of one micro-batch, run in order, and only the
last one of the step lets the gradient all-reduce fire, so accumulation costs no extra
communication. Pipeline schedules extend the same queue with per-stage forward/backward tasks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mcpar.parallel.data import DataParallelGradSync


@dataclass(frozen=True)
class MicroBatchTask:
    step: int
    micro_index: int
    is_last: bool  # the last micro-batch of the step: gradients are synchronized after it


class ComputeController:
    """Runs the micro-batch tasks of a step and returns their losses."""

    def __init__(self, num_microbatches: int,
                 forward_backward: Callable[[MicroBatchTask], float],
                 grad_sync: DataParallelGradSync):
        self.num_microbatches = num_microbatches
        self._forward_backward = forward_backward
        self._grad_sync = grad_sync
        self._queue: deque[MicroBatchTask] = deque()

    def submit_task(self, task: MicroBatchTask) -> None:
        self._queue.append(task)

    def schedule_tasks(self) -> list[float]:
        """Run queued tasks in order; returns each task's (unscaled) micro-batch loss."""
        losses = []
        while self._queue:
            task = self._queue.popleft()
            self._grad_sync.sync_enabled = task.is_last
            losses.append(self._forward_backward(task))
        self._grad_sync.sync_enabled = True
        return losses

    def run_step(self, step: int) -> list[float]:
        """Forward/backward every micro-batch of `step`; gradients end averaged over data."""
        self._grad_sync.zero_grad()
        for i in range(self.num_microbatches):
            self.submit_task(MicroBatchTask(step, i, i == self.num_microbatches - 1))
        losses = self.schedule_tasks()
        self._grad_sync.finish()
        return losses
