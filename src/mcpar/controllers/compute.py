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

from mcpar.config import JobConfig, ModelConfig
from mcpar.errors import problem
from mcpar.parallel.data import DataParallelGradSync
from mcpar.parallel.pipeline import schedule_problem


def piece_costs(cfg: ModelConfig) -> tuple[float, list[float], float]:
    """Modelled training cost per token of (embedding, each block, head), in FLOPs.

    Blocks: the matmuls and attention of ``gpt_flops_per_token``. Head: its matmul plus the
    softmax/cross-entropy over the vocabulary. Embedding: no matmul, but reading and writing a
    row per token; counted as the elementwise work it is (a few FLOPs per hidden unit).
    """
    h, f, s, v = cfg.hidden_size, cfg.ffn_size, cfg.seq_len, cfg.vocab_size
    block = 3.0 * (2 * (4 * h * h + 2 * h * f) + 4 * s * h)
    head = 3.0 * (2 * h * v + 5 * v)
    embed = 3.0 * 4 * h
    return embed, [block] * cfg.num_layers, head


def partition_layers(cfg: ModelConfig, num_stages: int) -> list[tuple[int, int]]:
    """Contiguous [start, end) block ranges, one per stage, minimizing the costliest stage.

    Stage 0 also carries the embedding and the last stage the head. Every stage gets at least one
    block: a stage of only an embedding or a head is not a cut this model allows.
    """
    embed, blocks, head = piece_costs(cfg)
    n = len(blocks)
    if num_stages > n:
        raise ValueError(f"{n} layers cannot fill {num_stages} stages")
    prefix = [0.0]
    for cost in blocks:
        prefix.append(prefix[-1] + cost)

    def stage_cost(stage: int, start: int, end: int) -> float:
        cost = prefix[end] - prefix[start]
        if stage == 0:
            cost += embed
        if stage == num_stages - 1:
            cost += head
        return cost

    inf = float("inf")
    # best[k][i]: the smallest max-stage cost placing blocks [0, i) into stages [0, k).
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], stage_cost(k - 1, j, i))
                # Ties go to the later cut, which gives earlier stages (holding more in-flight
                # micro-batches under 1F1B) the lighter share.
                if value <= best[k][i]:
                    best[k][i], cut[k][i] = value, j
    ranges: list[tuple[int, int]] = []
    end = n
    for k in range(num_stages, 0, -1):
        start = cut[k][end]
        ranges.append((start, end))
        end = start
    return ranges[::-1]


def modelled_step_time(num_microbatches: int, micro_time_s: float, pp: int,
                       virtual_stages: int, schedule: str) -> float:
    """Step time of `num_microbatches` micro-batches whose forward+backward on one stage takes
    `micro_time_s`: m slots of work plus the pipeline's fill and drain."""
    if pp == 1:
        return num_microbatches * micro_time_s
    bubble = (pp - 1) / (virtual_stages if schedule == "interleaved_1f1b" else 1)
    return (num_microbatches + bubble) * micro_time_s


@dataclass
class SplitChoice:
    num_microbatches: int
    micro_batch_size: int
    modelled_step_s: float
    table: list[tuple[int, float, float, bool]]  # (m, step seconds, memory bytes, fits)


def choose_num_microbatches(
    rank_batch: int, fixed_cost_s: float, per_sequence_s: float, pp: int, virtual_stages: int,
    schedule: str, memory_bytes: Callable[[int, int], float], budget_bytes: float,
    allowed: Callable[[int], bool],
) -> SplitChoice:
    """The micro-batch count that minimizes the modelled step time within the memory budget.

    A micro-batch of b sequences is modelled as ``fixed_cost_s + per_sequence_s * b`` (measured):
    fewer, larger micro-batches pay the fixed cost less often but lengthen the pipeline's fill and
    drain and hold more activations. ``memory_bytes(m, b)`` is the per-rank estimate.
    """
    table = []
    for m in range(1, rank_batch + 1):
        if rank_batch % m or not allowed(m):
            continue
        b = rank_batch // m
        step = modelled_step_time(m, fixed_cost_s + per_sequence_s * b, pp, virtual_stages,
                                  schedule)
        mem = memory_bytes(m, b)
        table.append((m, step, mem, mem <= budget_bytes))
    fitting = [row for row in table if row[3]]
    if not fitting:
        raise ValueError("no micro-batch split fits the memory budget")
    m, step, _, _ = min(fitting, key=lambda row: (row[1], row[0]))
    return SplitChoice(m, rank_batch // m, step, table)


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
