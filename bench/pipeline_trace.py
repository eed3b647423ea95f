"""Where a pipeline schedule's step loses time against its theory: the measured trace replayed.

What it measures
    ``--pp`` worker processes run ``--schedule`` on the bubble bench's fixed-cost stages
    (``pipeline_bubble.py``: a forward sleeps ``--fwd-ms / v``, B and W as much) for
    ``--repeats`` steps after ``--warmup``. Each rank's executor records every F, B and W
    with its start and end on the host's monotonic clock (``PipelineStats.started_at``), so the
    ranks' actions lie on one timeline. The step is then walked back from the action that ends
    last: each action waited either for the previous action of its rank or for the action
    whose output it takes (on another rank: the message), whichever ended later. Along that
    critical path the step splits into
      - ``nominal``: what the actions would take at their sleeps (the theory's units);
      - ``action_overrun``: what they took beyond (the sleep's overshoot, the stage's own ops);
      - ``message_wait``: from the producing action's end to the start of its consumer, on
        another rank (send, receive, the receiver's wake-up);
      - ``local_gap``: from the previous action's end to the start, where the action whose
        output it takes had ended before that: the executor's work between two tasks
        (posting sends and receives), and the tail of a message its producer sent after its
        task ended (the trace times tasks, not sends, so the two are not told apart);
      - ``start`` and ``end``: before the first action, and after the last one until the
        slowest rank's step ends (waiting for sends, the end of the step).
    Each figure is the median over the steps, in ms and in units of a forward; the local gaps
    are also given by the pair of tasks they sit between, and counted (``count ...``), as are
    the messages on the path.

How to run
    python bench/pipeline_trace.py [--schedule zb_h1] [--pp 4] [--micro 8] [--fwd-ms 20]
                                   [--repeats 5] [--warmup 1] [--rounds 1] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_workers import emit_result, run_worker
from pipeline_bubble import FIXED_SHAPE, FIXED_VOCAB, FixedCostStage, SleepingWeightGrads
from pipeline_timing import placement, splits, theory

import mcpar.controllers.registered  # noqa: F401  (the schedules)
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.compute.schedules import schedule_problem, step_tasks
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.parallel.pipeline import PipelineExecutor
from mcpar.parallel.weight_grad import split_weight_grads
from mcpar.registry.schedule import SCHEDULES
from mcpar.topology import ParallelDims

Timed = tuple[str, int, int, float, float]  # kind, chunk, micro-batch, start, end (absolute)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="zb_h1")
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--fwd-ms", type=float, default=20.0)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="runs on fresh processes")
    p.add_argument("--out", default=None)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    v = 2 if args.schedule in SCHEDULES and SCHEDULES.get(args.schedule).multi_chunk else 1
    args.virtual = v
    reason = schedule_problem(args.schedule, args.pp, args.micro, v)
    if reason is not None or args.fwd_ms <= 0 or args.repeats < 1 or args.warmup < 0:
        p.error(reason or "--fwd-ms > 0, --repeats >= 1, --warmup >= 0")
    return args


def critical_path_split(ranks: list[list[Timed]], step_end: float, pp: int, v: int,
                        schedule: str, unit_s: float) -> dict[str, float]:
    """The step of one run, walked back along its critical path (the module's text)."""
    entry = SCHEDULES.get(schedule)
    last = pp * v - 1
    stage = {(r, c): entry.stage_of(c, r, pp, v) for r in range(pp) for c in range(v)}
    where: dict[tuple[str, int, int], tuple[int, int]] = {}
    for r, actions in enumerate(ranks):
        for i, (kind, chunk, micro, _s, _e) in enumerate(actions):
            where[(kind, stage[(r, chunk)], micro)] = (r, i)
    nominal = {"F": 1 / v, "B": (1 if splits(schedule) else 2) / v, "W": 1 / v}
    out = dict.fromkeys(("nominal", "action_overrun", "message_wait", "local_gap", "start",
                         "end"), 0.0)
    r = max(range(pp), key=lambda rank: ranks[rank][-1][4])  # the action that ends last
    i = len(ranks[r]) - 1
    out["end"] = step_end - ranks[r][i][4]
    while True:
        kind, chunk, micro, start, end = ranks[r][i]
        out["nominal"] += nominal[kind] * unit_s
        out["action_overrun"] += end - start - nominal[kind] * unit_s
        s = stage[(r, chunk)]
        dep = (("F", s - 1, micro) if kind == "F" and s > 0 else
               ("B", s, micro) if kind == "W" else
               ("B", s + 1, micro) if kind == "B" and s < last else
               ("F", s, micro) if kind == "B" else None)
        prev = (r, i - 1) if i > 0 else None
        prev_end = ranks[r][i - 1][4] if prev else None
        dep_at = where.get(dep) if dep else None
        dep_end = ranks[dep_at[0]][dep_at[1]][4] if dep_at else None
        if dep_at is not None and dep_at[0] != r and (prev_end is None or dep_end >= prev_end):
            out["message_wait"] += start - dep_end
            out["count message"] = out.get("count message", 0.0) + 1
            r, i = dep_at
        elif prev is not None:
            gap = start - max(prev_end, dep_end if dep_end is not None else 0.0)
            out["local_gap"] += gap
            # Which pair of tasks the gap sits between (what the executor ran in it).
            pair = f"local_gap {ranks[r][i - 1][0]}>{kind}"
            out[pair] = out.get(pair, 0.0) + gap
            out[f"count {pair}"] = out.get(f"count {pair}", 0.0) + 1
            r, i = prev
        else:
            out["start"] += start
            return out


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size)
    rank, pp, m, v, schedule = env.rank, args.pp, args.micro, args.virtual, args.schedule
    try:
        dims = ParallelDims(dp=1, tp=1, pp=pp, ep=1, world_size=pp)
        dims.build_mesh("cpu")
        comm = CommunicationController(dims)
        fwd_s = args.fwd_ms / 1000 / v
        stages = [SCHEDULES.get(schedule).stage_of(c, rank, pp, v) for c in range(v)]
        chunks = [FixedCostStage(fwd_s, first=s == 0, split=splits(schedule)) for s in stages]
        store = SleepingWeightGrads(fwd_s) if splits(schedule) else None
        for chunk in chunks if store is not None else []:
            split_weight_grads(chunk, store)
        executor = PipelineExecutor(chunks, rank, pp, comm, m, FIXED_SHAPE, F.mse_loss,
                                    torch.device("cpu"), weight_grads=store,
                                    **placement(schedule, rank, pp, m, v))
        tasks = step_tasks(schedule, rank, pp, m, v)
        gen = torch.Generator().manual_seed(0)
        steps = []
        for n in range(args.warmup + args.repeats):
            inputs = [torch.randint(0, FIXED_VOCAB, FIXED_SHAPE[:2], generator=gen)
                      for _ in range(m)]
            dist.barrier()
            executor.run(inputs if executor.holds_first_stage else None,
                         [torch.zeros(FIXED_SHAPE) for _ in range(m)]
                         if executor.holds_last_stage else None, tasks)
            stats = executor.last_stats
            mine = ([(k, c, mb, stats.started_at + b, stats.started_at + e)
                     for k, c, mb, b, e in stats.actions],
                    stats.started_at, stats.started_at + stats.total_s, stats.busy_s)
            gathered: list = [None] * pp
            dist.all_gather_object(gathered, mine)
            if n >= args.warmup:
                steps.append(gathered)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return
    unit = args.fwd_ms / 1000
    splits_ms, idle = [], []
    for gathered in steps:
        origin = min(g[1] for g in gathered)
        ranks = [[(k, c, mb, b - origin, e - origin) for k, c, mb, b, e in g[0]]
                 for g in gathered]
        step_end = max(g[2] for g in gathered) - origin
        parts = critical_path_split(ranks, step_end, pp, v, schedule, unit)
        splits_ms.append({k: x if k.startswith("count") else 1000 * x for k, x in parts.items()}
                         | {"step": 1000 * step_end})
        idle.append(statistics.fmean(1 - g[3] / step_end for g in gathered))
    keys = {k for s in splits_ms for k in s}
    median = {k: statistics.median(s.get(k, 0.0) for s in splits_ms) for k in sorted(keys)}
    expected = theory(schedule, pp, m, v)
    result = {
        "benchmark": "pipeline_trace", "schedule": schedule, "pp": pp, "micro": m,
        "virtual_stages": v, "fwd_ms": args.fwd_ms, "repeats": args.repeats,
        "idle_fraction_per_step": idle, "idle_fraction": statistics.fmean(idle),
        "theory": expected, "points_over_theory": 100 * (statistics.fmean(idle) - expected),
        "critical_path_ms_median": median,
        "critical_path_units_median": {k: x / args.fwd_ms for k, x in median.items()
                                       if not k.startswith("count")},
        "critical_path_ms_per_step": splits_ms,
        "machine": f"{os.cpu_count()} cores, shared with other jobs while it ran",
    }
    Path(args.result_file).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    rounds = []
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="pipeline-trace-") as tmp:
            result_file = os.path.join(tmp, "result.json")
            try:
                launch_local(args.pp, [os.path.abspath(__file__), "--worker", "--result-file",
                                       result_file,
                                       *(argv if argv is not None else sys.argv[1:])],
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
            except LaunchFailed as err:
                print(f"pipeline_trace: {err}", file=sys.stderr)
                return 1
            rounds.append(json.loads(Path(result_file).read_text()))
    result = {**rounds[0], "rounds": rounds,
              "points_over_theory_per_round": [r["points_over_theory"] for r in rounds]}
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
