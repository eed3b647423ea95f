"""Pipeline schedules as generators of a step's task list (the ComputeController's order).

Layout: with ``pp`` ranks and ``v`` virtual stages per rank the model is cut into ``pp * v``
global stages; rank ``r`` holds stages ``r, r + pp, r + 2 pp, ...`` (its local chunks 0..v-1),
Megatron-LM's interleaved layout. With ``v = 1`` this is the plain layout, stage ``r`` on rank
``r``; without a pipeline (``pp = 1``) the one stage is the whole model and the step is
forward/backward of each micro-batch in turn.

Schedules (one optimizer step of ``m`` micro-batches), as forward ("F") / backward ("B") actions:

- ``gpipe``: every forward, then every backward. Holds all ``m`` micro-batches' activations.
- ``1f1b``: ``pp - rank - 1`` warm-up forwards, then one forward / one backward alternately, then
  the remaining backwards. Same bubble as GPipe, ``(pp-1)/(m+pp-1)`` of the step idle, but at
  most ``pp - rank`` micro-batches in flight. Works for any ``m >= 1`` (the warm-up is capped).
- ``interleaved_1f1b``: Megatron-LM's interleaved schedule over ``v >= 2`` chunks per rank; the
  bubble shrinks to ``(pp-1)/(v m + pp-1)``, paid for with ``v`` times the point-to-point traffic.
  Micro-batches go through the chunks in groups of ``pp``, so ``m`` must be a multiple of ``pp``.

``step_tasks`` expands the actions into the step's tasks (``mcpar.parallel.tasks``): the
receive, compute and send of each action, the arming of each chunk's gradient buckets right
before that chunk's last backward (so its data-parallel reduction starts while the backward
runs, and overlaps the rest of the schedule), then waiting for the sends and the reductions, and
the optimizer step.

Deadlock freedom: a task waits only for the task it depends on (the forward of the previous
global stage, or the backward of the next), sends never block, and every message has a tag unique
to (kind, sending stage, micro-batch), so a receive can never take another task's message, whatever
order the ranks reach them in. The tests simulate every rank's list together to show each
schedule completes. They also check that, between any two ranks, messages are received in the
order they are sent, so a backend that matches point-to-point messages by order rather than by tag
(NCCL) pairs them the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.config import JobConfig
from mcpar.errors import problem
from mcpar.parallel.pipeline import global_stage
from mcpar.parallel.tasks import Task, TaskKind

SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")


@dataclass(frozen=True)
class Action:
    """One task of a rank's schedule: the forward ("F") or backward ("B") of a chunk."""

    kind: str  # "F" or "B"
    chunk: int  # local virtual chunk index on this rank, 0..virtual_stages-1
    micro: int  # micro-batch index


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


def schedule_problems(cfg: JobConfig, num_microbatches: int) -> list[str]:
    """Problems of the pipeline schedule with this layout and micro-batch count."""
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
    num_micro = num_microbatches
    reason = schedule_problem(par.schedule, par.pipeline, num_micro, par.virtual_stages)
    if reason:
        return [problem("optimization.gradient_accumulation",
                        f"{num_micro} micro-batches per step: {reason}")]
    return []


def step_tasks(schedule: str, pp_rank: int, pp: int, num_microbatches: int,
               virtual_stages: int = 1, reduce_every_backward: bool = False) -> list[Task]:
    """Every task of one optimizer step on pipeline rank ``pp_rank``, in the order to run them.

    Without a pipeline (``pp == 1``) the schedule is forward then backward of each micro-batch
    in turn, whatever ``schedule`` names (1F1B with one stage). ``reduce_every_backward``
    (ZeRO stage 2, which keeps no full gradient between micro-batches) arms the gradient
    buckets before every backward, not only the last of each chunk.
    """
    actions = build_schedule("1f1b" if pp == 1 else schedule, pp_rank, pp, num_microbatches,
                             virtual_stages)
    last_stage = pp * virtual_stages - 1
    last_backward = {a.chunk: i for i, a in enumerate(actions) if a.kind == "B"}
    tasks: list[Task] = []
    for index, action in enumerate(actions):
        chunk, micro = action.chunk, action.micro
        stage = global_stage(chunk, pp_rank, pp)
        if action.kind == "F":
            if stage > 0:
                tasks.append(Task(TaskKind.RECV_ACTIVATION, chunk, micro))
            tasks.append(Task(TaskKind.FORWARD, chunk, micro))
            if stage < last_stage:
                tasks.append(Task(TaskKind.SEND_ACTIVATION, chunk, micro))
        else:
            if stage < last_stage:
                tasks.append(Task(TaskKind.RECV_GRAD, chunk, micro))
            if last_backward[chunk] == index or reduce_every_backward:
                # The chunk's gradients are complete once this backward has run: arm its
                # buckets so each starts reducing as soon as it is full.
                tasks.append(Task(TaskKind.SYNC_GRADS, chunk, micro))
            tasks.append(Task(TaskKind.BACKWARD, chunk, micro))
            if stage > 0:
                tasks.append(Task(TaskKind.SEND_GRAD, chunk, micro))
    tasks += [Task(TaskKind.WAIT_SENDS), Task(TaskKind.WAIT_GRADS),
              Task(TaskKind.OPTIMIZER_STEP)]
    return tasks
