"""Workers that share CPU cores: a processor-sharing model of the pipeline schedule.

On a GPU cluster every rank owns its device, so a pipeline rank that waits (the bubble) simply
idles. On this machine mcpar may run more worker threads than there are cores; then a waiting
rank frees its core for the others, and a rank runs at full speed only while few ranks are
runnable. Neither "every rank at cores / threads speed all the time" (too slow: it ignores that
the bubble frees cores) nor "total work / cores" (too fast: it ignores that the fill and drain
leave cores idle) is right.

``shared_pipeline_time`` replays the schedule (GPipe or 1F1B, as each rank orders its tasks)
as a fluid: at every moment the runnable ranks (those whose next task's input has arrived) share
the cores equally, each running at min(1, cores / demand) of its full speed, where demand counts
the threads of every runnable rank. Tasks take their full-speed time divided by that speed.
"""

from __future__ import annotations

EPS = 1e-12


def task_order(rank: int, pp: int, m: int, schedule: str) -> list[tuple[str, int]]:
    """(kind, micro-batch) in the order a rank runs them: GPipe all forwards then all
    backwards; 1F1B pp - 1 - rank warm-up forwards, then one forward one backward, then the
    remaining backwards."""
    if schedule == "gpipe":
        return [("F", i) for i in range(m)] + [("B", i) for i in range(m)]
    warm = min(pp - 1 - rank, m)
    order = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        order += [("F", warm + i), ("B", i)]
    order += [("B", i) for i in range(m - warm, m)]
    return order


def shared_pipeline_time(fwd: list[float], bwd: list[float], m: int, schedule: str,
                         cores: float, threads_per_rank: float) -> float:
    """Makespan of `m` micro-batches through pipeline ranks whose forward/backward of one
    micro-batch take fwd[r]/bwd[r] seconds at full speed, sharing `cores` cores, each rank
    demanding `threads_per_rank` of them while runnable."""
    pp = len(fwd)
    orders = [task_order(r, pp, m, schedule) for r in range(pp)]
    position = [0] * pp
    done = {("F", r, i): False for r in range(pp) for i in range(m)}
    done.update({("B", r, i): False for r in range(pp) for i in range(m)})

    def cost(r: int) -> float:
        kind, _ = orders[r][position[r]]
        return fwd[r] if kind == "F" else bwd[r]

    remaining = [cost(r) for r in range(pp)]

    def ready(r: int) -> bool:
        if position[r] >= len(orders[r]):
            return False
        kind, i = orders[r][position[r]]
        if kind == "F":
            return r == 0 or done[("F", r - 1, i)]
        return done[("F", r, i)] and (r == pp - 1 or done[("B", r + 1, i)])

    now = 0.0
    while any(position[r] < len(orders[r]) for r in range(pp)):
        runnable = [r for r in range(pp) if ready(r)]
        if not runnable:
            raise RuntimeError("pipeline schedule deadlocked (a bug in task_order)")
        speed = min(1.0, cores / (threads_per_rank * len(runnable)))
        step = min(remaining[r] for r in runnable) / speed
        now += step
        for r in runnable:
            remaining[r] -= step * speed
            if remaining[r] <= EPS:
                kind, i = orders[r][position[r]]
                done[(kind, r, i)] = True
                position[r] += 1
                remaining[r] = cost(r) if position[r] < len(orders[r]) else 0.0
    return now
