"""The tasks an optimizer step is made of, as plain data.

The ComputeController (``mcpar.controllers.compute``) decides the order of a step's tasks (its
pipeline schedules are generators of these lists) and runs them; the stage executor
(``parallel/pipeline.py``) knows how to run one stage task; the gradient synchronization and the
optimizer step are run by the controller itself. The types live here, below both, so that the
executor needs nothing from the controllers.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class TaskKind(str, Enum):
    # Stage tasks (run by the stage executor), in the order one micro-batch meets them.
    RECV_ACTIVATION = "recv_activation"  # blocking receive from the previous stage
    FORWARD = "forward"  # forward of a chunk (and the loss on the last stage)
    SEND_ACTIVATION = "send_activation"  # non-blocking send to the next stage
    RECV_GRAD = "recv_grad"  # blocking receive of the output's gradient from the next stage
    BACKWARD = "backward"  # the whole backward, or under a split schedule its input part (B)
    SEND_GRAD = "send_grad"  # non-blocking send of the input's gradient to the previous stage
    WEIGHT_GRAD = "weight_grad"  # a split schedule's W: the weight gradients its B deferred
    WAIT_SENDS = "wait_sends"  # every send of the step has completed
    # Step tasks (run by the ComputeController).
    SYNC_GRADS = "sync_grads"  # arm the chunk's gradient buckets: each starts its data-parallel
    # reduction as soon as its gradients are complete, during the backward that follows (under
    # a split schedule: the parameters whose gradients B computes)
    SYNC_WEIGHT_GRADS = "sync_weight_grads"  # a split schedule: arm the chunk's deferred
    # parameters (the linear weights) before its last W
    WAIT_GRADS = "wait_grads"  # launch what is left and wait for every reduction
    OPTIMIZER_STEP = "optimizer_step"


STAGE_TASKS = frozenset({TaskKind.RECV_ACTIVATION, TaskKind.FORWARD, TaskKind.SEND_ACTIVATION,
                         TaskKind.RECV_GRAD, TaskKind.BACKWARD, TaskKind.SEND_GRAD,
                         TaskKind.WEIGHT_GRAD, TaskKind.WAIT_SENDS})


@dataclass(frozen=True)
class Task:
    """One task of a step: ``kind`` on local chunk ``chunk`` for micro-batch ``micro``."""

    kind: TaskKind
    chunk: int = 0
    micro: int = 0

    def __str__(self) -> str:
        return f"{self.kind.value}(chunk {self.chunk}, micro {self.micro})"
