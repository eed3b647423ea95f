"""The profiled window's figures, from every rank's record: what the report prints and plots.

Input: one record per rank (``session.RunProfiler``: per step its task log, blocking waits,
data time, step time and collective books), the run's summary and a context (layout, device,
capacity, metrics, the plan's prediction). Output: plain dicts and lists, in the report's order.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from mcpar.profiler.bandwidth import from_sent
from mcpar.profiler.timeline import (
    CATEGORIES,
    pipeline_bubble,
    split_schedule_bubble,
    split_step,
    theoretical_bubble,
)
from mcpar.registry.schedule import splits_backward


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else 0.0


def step_split(ranks: list[dict]) -> list[dict[str, Any]]:
    """Per rank: the mean seconds per category over the window, and the mean step time."""
    rows = []
    for rank in ranks:
        splits = [split_step(s["tasks"], s["waits"], s["data_s"], s["step_s"])
                  for s in rank["steps"]]
        row: dict[str, Any] = {"rank": rank["rank"],
                               "step_s": _mean([s["step_s"] for s in rank["steps"]])}
        row.update({c: _mean([sp[c] for sp in splits]) for c in CATEGORIES})
        rows.append(row)
    return rows


def comm_share(split: list[dict[str, Any]]) -> float:
    """Exposed communication over step time, the mean of the ranks'."""
    return _mean([r["exposed_comm"] / r["step_s"] for r in split if r["step_s"] > 0])


def collectives(ranks: list[dict]) -> list[dict[str, Any]]:
    """Per (operation, axis, codec), per rank and step: calls, bytes sent and seconds (means
    over the ranks that issue it), the group size n, and nccl-tests' algbw / busbw.

    The bandwidths use the *shortest* rank's time: a collective completes for every rank
    together, so the rank that joined it last measured the collective itself, while the
    others' time also holds their wait for it (skew between ranks, which the straggler
    section reports). nccl-tests starts its ranks together and needs no such care."""
    acc: dict[tuple[str, str, str], list[list[float]]] = defaultdict(list)
    for rank in ranks:
        steps = max(1, len(rank["steps"]))
        mine: dict[tuple[str, str, str], list[float]] = defaultdict(lambda: [0.0, 0.0, 0.0])
        for step in rank["steps"]:
            for row in step["comm"]:
                key = (row["op"], row["axis"], row["codec"])
                mine[key][0] += row["calls"] / steps
                mine[key][1] += row["bytes"] / steps
                mine[key][2] += row["time_s"] / steps
        for key, values in mine.items():
            acc[key].append([*values, float(rank["axis_sizes"].get(key[1], 1))])
    rows = []
    for (op, axis, codec), per_rank in sorted(acc.items()):
        calls, sent, seconds, n = (_mean([r[i] for r in per_rank]) for i in range(4))
        fastest = min(r[2] for r in per_rank)
        bw = from_sent(op, sent, fastest, int(n))
        rows.append({"op": op, "axis": axis, "codec": codec, "n": int(n), "calls": calls,
                     "bytes": sent, "time_s": seconds, "time_s_min": fastest,
                     "time_s_per_rank": [r[2] for r in per_rank],
                     "size_bytes": bw.size_bytes, "algbw": bw.algbw, "busbw": bw.busbw})
    return rows


def bubble(ranks: list[dict], pp: int, microbatches: int, virtual: int,
           schedule: str | None = None) -> dict[str, Any]:
    """The measured pipeline bubble (mean over the window's steps) against theory (a schedule
    that splits the backward: its registry entry's replay with equal stages, B = W = F)."""
    if pp <= 1:
        return {"pipeline": False}
    steps = min(len(r["steps"]) for r in ranks)
    measured = [pipeline_bubble([r["steps"][i]["tasks"] for r in ranks]) for i in range(steps)]
    return {"pipeline": True, "stages": pp, "microbatches": microbatches, "virtual": virtual,
            "measured": _mean(measured),
            "theory": split_schedule_bubble(schedule, pp, microbatches, virtual)
            if splits_backward(schedule, pp) else theoretical_bubble(pp, microbatches * virtual)}


def stragglers(split: list[dict[str, Any]]) -> dict[str, Any]:
    """Each rank's own work (compute, optimizer, data) per step: collectives make every rank's
    step time equal, so the spread of the work is where a slow rank shows."""
    work = {r["rank"]: r["compute"] + r["optimizer"] + r["data"] for r in split}
    mean = _mean(list(work.values()))
    slowest = max(work, key=lambda k: work[k])
    return {"work_s": work, "slowest_rank": slowest,
            "spread": (max(work.values()) - min(work.values())) / mean if mean > 0 else 0.0,
            "step_s": {r["rank"]: r["step_s"] for r in split}}


def moe_load(ranks: list[dict]) -> list[list[int]] | None:
    """Tokens per expert per layer, in the window's last step (rank 0's record is the job's)."""
    moe = ranks[0]["steps"][-1].get("moe") if ranks[0]["steps"] else None
    if not moe:
        return None
    return [layer["tokens_per_expert"] for layer in moe.get("layers", [])]


def analyse(ranks: list[dict], summary: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    split = step_split(ranks)
    window = [s for s in ranks[0]["steps"]]
    tokens_per_s = _mean([s["tokens_per_s"] for s in window])
    step_s = _mean([r["step_s"] for r in split])
    memory = summary.get("memory") or {}
    measured_total = float((memory.get("measured") or {}).get("total", 0.0))
    out = {
        "context": ctx,
        "window": [s["step"] for s in window],
        "split": split,
        "comm_share": comm_share(split),
        "collectives": collectives(ranks),
        "memory": {"estimate": memory.get("estimate", {}), "measured": memory.get("measured", {}),
                   "capacity_bytes": ctx["capacity_bytes"],
                   "utilisation": measured_total / ctx["capacity_bytes"]
                   if ctx["capacity_bytes"] else 0.0,
                   "peak_per_rank": {r["rank"]: r["peak_mem_bytes"] for r in ranks},
                   "over_step": {r["rank"]: r.get("memory_over_step", []) for r in ranks}},
        "throughput": {"tokens_per_s": tokens_per_s, "step_s": step_s,
                       "mfu": _mean([s["mfu"] for s in window]), **summary.get("mfu", {})},
        "bubble": bubble(ranks, ctx["pp"], ctx["microbatches"], ctx["virtual"],
                         ctx.get("schedule")),
        "moe": moe_load(ranks),
        "stragglers": stragglers(split),
        "timeline": {"step": window[-1]["step"] if window else None,
                     "ranks": [r["steps"][-1]["tasks"] if r["steps"] else [] for r in ranks]},
    }
    out["prediction"] = _prediction_rows(out, ctx.get("prediction"), measured_total)
    return out


def _prediction_rows(out: dict[str, Any], pred: dict | None,
                     measured_memory: float) -> list[dict[str, Any]]:
    if not pred:
        return []
    measured = {"step_s": out["throughput"]["step_s"], "comm_share": out["comm_share"],
                "bubble": out["bubble"].get("measured", 0.0),
                "tokens_per_s": out["throughput"]["tokens_per_s"],
                "mfu": out["throughput"]["mfu"], "memory_bytes": measured_memory}
    return [{"figure": k, "predicted": pred[k], "measured": measured[k]} for k in measured]
