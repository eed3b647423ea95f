"""A step's time, split by what each rank was doing: from the ComputeController's task log and
the Communicator's record of the main thread's blocking waits.

Categories (seconds of one step on one rank; they add up to the step time):

- ``data``: before the first task (the micro-batches read and moved to the device);
- ``compute``: forward and backward tasks, less the blocking collectives inside them (tensor and
  expert parallelism wait on the wire in the middle of a forward);
- ``exposed_comm``: communication the schedule did not hide: waiting for the gradient
  reductions, launching sends and arming buckets, and every blocking collective the main thread
  waited on inside another task (the gradient norm, the step's statistics);
- ``bubble``: waiting for another pipeline stage (receives, and the sends' completion);
- ``optimizer``: the update task less its collectives;
- ``idle``: what is left (the trainer's own bookkeeping between tasks).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from mcpar.registry.schedule import SCHEDULES
from mcpar.registry.schedule_replay import replay

CATEGORIES = ("compute", "exposed_comm", "bubble", "optimizer", "data", "idle")
_COMPUTE = {"forward", "backward", "weight_grad"}
_BUBBLE = {"recv_activation", "recv_grad", "wait_sends"}
_COMM = {"send_activation", "send_grad", "sync_grads", "sync_weight_grads", "wait_grads"}


def _overlap(start: float, end: float, waits: Iterable[tuple[float, float]]) -> float:
    return sum(max(0.0, min(end, w1) - max(start, w0)) for w0, w1 in waits)


def split_step(tasks: Sequence[dict], waits: Sequence[tuple[float, float]], data_s: float,
               step_s: float) -> dict[str, float]:
    """``tasks``: the step's task log as dicts {name, start, end} (seconds since the first
    task); ``waits``: the main thread's blocking collectives other than receives, on the same
    clock; ``data_s``: seconds from the step's start to its first task."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    out["data"] = max(0.0, data_s)
    for task in tasks:
        name, start, end = task["name"], task["start"], task["end"]
        dur = end - start
        if name in _COMPUTE or name == "optimizer_step":
            waited = min(dur, _overlap(start, end, waits))
            out["compute" if name in _COMPUTE else "optimizer"] += dur - waited
            out["exposed_comm"] += waited
        elif name in _BUBBLE:
            out["bubble"] += dur
        elif name in _COMM:
            out["exposed_comm"] += dur
    out["idle"] = max(0.0, step_s - sum(out[c] for c in CATEGORIES if c != "idle"))
    return out


def pipeline_bubble(ranks: Sequence[Sequence[dict]]) -> float:
    """The measured bubble fraction of one step's pipeline: 1 - (the ranks' mean busy time in
    forward and backward) / (the pipeline's span: from the step's start to the last stage task
    of any rank). Each rank's log starts at its own step start; the previous step's closing
    collective aligns those starts to within a collective's latency."""
    spans = [max((t["end"] for t in tasks if t["name"] in _COMPUTE | _BUBBLE), default=0.0)
             for tasks in ranks]
    span = max(spans, default=0.0)
    if span <= 0:
        return 0.0
    busy = [sum(t["end"] - t["start"] for t in tasks if t["name"] in _COMPUTE)
            for tasks in ranks]
    return 1.0 - sum(busy) / len(busy) / span


def split_schedule_bubble(schedule: str | None, stages: int, microbatches: int,
                          virtual: int) -> float:
    """A split schedule's bubble with equal stages and B = W = F: its replay's idle share."""
    entry = SCHEDULES.get(str(schedule))
    span = replay(entry, [3.0] * stages, microbatches, virtual, 1 / 3)
    return 1 - 3.0 * microbatches / span


def theoretical_bubble(stages: int, microbatches: int) -> float:
    """1F1B's (and GPipe's) bubble fraction with equal stages: (p - 1) / (m + p - 1)."""
    return (stages - 1) / (microbatches + stages - 1)
