"""A step's task list from the registered pipeline schedule (the ComputeController's order).

The schedules themselves are registry entries (``pipeline_schedules.py`` for the built-ins, the
contract in ``mcpar.registry.schedule``): each gives every rank's ordered forward / backward
actions. Without a pipeline (``pp = 1``) the one stage is the whole model and the step is
forward/backward of each micro-batch in turn.

``step_tasks`` expands the actions into the step's tasks (``mcpar.parallel.tasks``): the
receive, compute and send of each action, the arming of each chunk's gradient buckets right
before that chunk's last backward (so its data-parallel reduction starts while the backward
runs, and overlaps the rest of the schedule), then waiting for the sends and the reductions, and
the optimizer step. Under a schedule that splits the backward (``splits_backward``), a "W"
action is the chunk's WEIGHT_GRAD task: the buckets' parameters whose gradients B computes are
armed before the chunk's last B, the deferred ones (the linear layers' weights) before its last
W, so each bucket reduces as soon as both parts have landed.

Deadlock freedom: a task waits only for the task it depends on (the forward of the previous
global stage, or the backward of the next), sends never block, and every message has a tag unique
to (kind, sending stage, micro-batch), so a receive can never take another task's message, whatever
order the ranks reach them in. The tests simulate every rank's list together to show each
schedule completes. They also check that, between any two ranks, messages are received in the
order they are sent, so a backend that matches point-to-point messages by order rather than by tag
(NCCL) pairs them the same way.
"""

from __future__ import annotations

from mcpar.parallel.tasks import Task, TaskKind
from mcpar.registry.schedule import (
    DEFAULT_SCHEDULE,
    SCHEDULES,
    Action,
    ActionCosts,
    schedule_as_run,
)

__all__ = ["Action", "build_schedule", "schedule_problem", "step_tasks"]


def build_schedule(schedule: str, pp_rank: int, pp: int, num_microbatches: int,
                   virtual_stages: int = 1, costs: ActionCosts | None = None,
                   limits: tuple[int, ...] | None = None,
                   overlapped: bool = False) -> list[Action]:
    """The ordered actions of one optimizer step on pipeline rank `pp_rank` (with ``costs``:
    ordered by the measured cost of each action, where the schedule follows them; with
    ``limits``: each rank holding at most that many chunk activations, the MemoryController's
    ``held_limits``; ``overlapped``: for steps not synchronized by the optimizer step,
    ``for_overlapped_steps``)."""
    if schedule not in SCHEDULES:
        raise ValueError(SCHEDULES.unknown(schedule))
    return schedule_as_run(schedule, limits, overlapped).checked_actions(
        pp_rank, pp, num_microbatches, virtual_stages, costs)


def schedule_problem(schedule: str, pp: int, num_microbatches: int,
                     virtual_stages: int) -> str | None:
    """None if the schedule can run with these degrees, else a one-line reason with the fix."""
    if schedule not in SCHEDULES:
        return SCHEDULES.unknown(schedule)
    found = SCHEDULES.get(schedule).problem(pp, num_microbatches, virtual_stages)
    return None if found is None else found[1]


Message = tuple[str, int, int]  # (kind, sending stage, micro-batch)


def message_orders(schedule: str, pp: int, num_microbatches: int, virtual_stages: int,
                   costs: ActionCosts | None = None, limits: tuple[int, ...] | None = None,
                   overlapped: bool = False) -> tuple[dict[tuple[int, int], list[Message]],
                              dict[tuple[int, int], list[Message]]]:
    """Per (sending rank, receiving rank): the messages in the order the sender sends them,
    and in the order the receiver reads them (two stages on one rank exchange nothing)."""
    entry = SCHEDULES.get(schedule)
    last = pp * virtual_stages - 1
    rank_of = {entry.stage_of(c, r, pp, virtual_stages): r
               for r in range(pp) for c in range(virtual_stages)}
    sent: dict[tuple[int, int], list[Message]] = {}
    read: dict[tuple[int, int], list[Message]] = {}
    for r in range(pp):
        for a in build_schedule(schedule, r, pp, num_microbatches, virtual_stages, costs,
                                limits, overlapped):
            if a.kind == "W":
                continue
            s = entry.stage_of(a.chunk, r, pp, virtual_stages)
            step = 1 if a.kind == "F" else -1  # a forward reads from below, a backward above
            if 0 <= s - step <= last and rank_of[s - step] != r:
                read.setdefault((rank_of[s - step], r), []).append((a.kind, s - step, a.micro))
            if 0 <= s + step <= last and rank_of[s + step] != r:
                sent.setdefault((r, rank_of[s + step]), []).append((a.kind, s, a.micro))
    return sent, read


def step_tasks(schedule: str | None, pp_rank: int, pp: int, num_microbatches: int,
               virtual_stages: int = 1, reduce_every_backward: bool = False,
               costs: ActionCosts | None = None,
               limits: tuple[int, ...] | None = None,
               overlapped: bool = False) -> list[Task]:
    """Every task of one optimizer step on pipeline rank ``pp_rank``, in the order to run them.

    Without a pipeline (``pp == 1``) the schedule is forward then backward of each micro-batch
    in turn, whatever ``schedule`` names (1F1B with one stage). ``reduce_every_backward``
    (ZeRO stage 2, which keeps no full gradient between micro-batches) arms the gradient
    buckets before every backward, not only the last of each chunk. ``costs``: the measured
    cost of each action, for a schedule that orders by them; ``limits``: what each rank may
    hold; ``overlapped``: steps that overlap (``build_schedule``).
    """
    if pp == 1 or schedule is None:
        schedule = DEFAULT_SCHEDULE
    entry = SCHEDULES.get(schedule) if schedule in SCHEDULES else None
    if entry is not None and entry.splits_backward and reduce_every_backward:
        # A reduction after every backward would miss the W's gradients; the ZeRO entry's rule
        # (``reduces_every_backward``) never asks for one under a split schedule.
        raise ValueError(f"schedule {schedule} splits the backward, which ZeRO stage 2's "
                         "reduction after every backward cannot follow")
    actions = build_schedule(schedule, pp_rank, pp, num_microbatches, virtual_stages,
                             costs if pp > 1 else None, limits if pp > 1 else None,
                             overlapped and pp > 1)
    assert entry is not None  # build_schedule refused an unknown name
    last_stage = pp * virtual_stages - 1
    last_of = {(a.kind, a.chunk): i for i, a in enumerate(actions)}
    tasks: list[Task] = []
    for index, action in enumerate(actions):
        chunk, micro = action.chunk, action.micro
        stage = entry.stage_of(chunk, pp_rank, pp, virtual_stages)
        if action.kind == "W":
            if last_of[("W", chunk)] == index:
                tasks.append(Task(TaskKind.SYNC_WEIGHT_GRADS, chunk, micro))
            tasks.append(Task(TaskKind.WEIGHT_GRAD, chunk, micro))
        elif action.kind == "F":
            if stage > 0:
                tasks.append(Task(TaskKind.RECV_ACTIVATION, chunk, micro))
            tasks.append(Task(TaskKind.FORWARD, chunk, micro))
            if stage < last_stage:
                tasks.append(Task(TaskKind.SEND_ACTIVATION, chunk, micro))
        else:
            if stage < last_stage:
                tasks.append(Task(TaskKind.RECV_GRAD, chunk, micro))
            if last_of[("B", chunk)] == index or reduce_every_backward:
                # The chunk's gradients are complete once this backward has run: arm its
                # buckets so each starts reducing as soon as it is full.
                tasks.append(Task(TaskKind.SYNC_GRADS, chunk, micro))
            tasks.append(Task(TaskKind.BACKWARD, chunk, micro))
            if stage > 0:
                tasks.append(Task(TaskKind.SEND_GRAD, chunk, micro))
    tasks += [Task(TaskKind.WAIT_SENDS), Task(TaskKind.WAIT_GRADS),
              Task(TaskKind.OPTIMIZER_STEP)]
    return tasks
