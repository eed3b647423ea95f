"""ComputeController: owns the schedule of work within an optimizer step.

Three decisions live here:

- **Partitioning**: how the model is cut into pipeline stages. Stages are balanced by the modelled
  cost of each piece (the embedding and the output head included, since a large vocabulary makes
  the head cost as much as several blocks), not by counting layers.
- **Batch splitting**: how many micro-batches a step is cut into. ``fixed`` takes the config;
  ``dynamic`` measures this model's forward+backward time at two micro-batch sizes and picks the
  count that minimizes the modelled step time (pipeline bubble included) within the memory budget.
- **The task queue** (the seed's ``submit_task`` / ``schedule_tasks``): without a pipeline a task
  is the forward and backward of one micro-batch and only the last one lets the gradient
  all-reduce fire; with a pipeline the queue holds one task per step that runs the pipeline
  schedule (GPipe, 1F1B or interleaved 1F1B) through the PipelineExecutor, and the gradient
  all-reduce runs once the schedule has drained.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from mcpar.config import JobConfig
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.errors import problem
from mcpar.parallel.pipeline import schedule_problem


def schedule_problems(cfg: JobConfig) -> list[str]:
    """Problems of the pipeline schedule with this layout and micro-batch count (resolved)."""
    par = cfg.parallelism
    if par.pipeline == 1:
        if par.virtual_stages > 1:
            return [problem("parallelism.virtual_stages",
                            f"{par.virtual_stages} virtual stages need parallelism.pipeline > 1")]
        return []
    if par.virtual_stages > 1 and par.schedule != "interleaved_1f1b":
        return [problem("parallelism.schedule",
                        f"'{par.schedule}' runs one stage per rank; use 'interleaved_1f1b' with "
                        f"virtual_stages {par.virtual_stages}")]
    if par.schedule == "interleaved_1f1b" and par.virtual_stages == 1:
        return [problem("parallelism.virtual_stages",
                        "interleaved_1f1b needs at least 2 virtual stages per rank")]
    if cfg.controllers.compute.batch_splitting == "dynamic":
        return []  # the controller only considers micro-batch counts the schedule accepts
    num_micro = cfg.optimization.gradient_accumulation or 1
    reason = schedule_problem(par.schedule, par.pipeline, num_micro, par.virtual_stages)
    if reason:
        return [problem("optimization.gradient_accumulation",
                        f"{num_micro} micro-batches per step: {reason}")]
    return []


@dataclass(frozen=True)
class MicroBatchTask:
    step: int
    micro_index: int
    is_last: bool  # the last micro-batch of the step: gradients are synchronized after it


class ComputeController:
    """Runs the tasks of a step and returns the step's micro-batch losses (where known)."""

    def __init__(self, num_microbatches: int, grad_sync: DataParallelGradSync,
                 forward_backward: Callable[[MicroBatchTask], float] | None = None,
                 pipeline_step: Callable[[int], list[float]] | None = None):
        if (forward_backward is None) == (pipeline_step is None):
            raise ValueError("give exactly one of forward_backward and pipeline_step")
        self.num_microbatches = num_microbatches
        self._forward_backward = forward_backward
        self._pipeline_step = pipeline_step
        self._grad_sync = grad_sync
        self._queue: deque[MicroBatchTask] = deque()

    def submit_task(self, task: MicroBatchTask) -> None:
        self._queue.append(task)

    def schedule_tasks(self) -> list[float]:
        """Run the queued tasks in order; returns each micro-batch's (unscaled) loss."""
        losses: list[float] = []
        while self._queue:
            task = self._queue.popleft()
            if self._pipeline_step is not None:
                # The whole pipeline schedule is one task: gradients are complete only at its end.
                self._grad_sync.sync_enabled = False
                losses += self._pipeline_step(task.step)
            else:
                assert self._forward_backward is not None
                self._grad_sync.sync_enabled = task.is_last
                losses.append(self._forward_backward(task))
        self._grad_sync.sync_enabled = True
        return losses

    def run_step(self, step: int) -> list[float]:
        """Forward/backward of every micro-batch of `step`; gradients end averaged over data."""
        self._grad_sync.zero_grad()
        if self._pipeline_step is not None:
            self.submit_task(MicroBatchTask(step, 0, True))
        else:
            for i in range(self.num_microbatches):
                self.submit_task(MicroBatchTask(step, i, i == self.num_microbatches - 1))
        losses = self.schedule_tasks()
        self._grad_sync.finish()
        return losses
