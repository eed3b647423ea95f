"""How far apart workers that share too few cores finish the same stretch of compute.

Why
    A data-parallel step computes, then waits at its all-reduce for the slowest rank. With more
    worker processes than cores the operating system time-slices them, and equal work does not
    end at equal times: the wait at the next synchronization holds the difference. The cost
    model prices oversubscribed ranks at a fair share of the cores (every rank slowed alike), so
    this is what that assumption leaves out; ``docs/cost_model.md`` ("Ranking layouts here")
    quotes it.

What it measures
    ``--workers`` processes (gloo, one thread each) start together after a barrier, each runs
    ``--matmuls`` products of 512 x 256 by 256 x 512 (fp32), and gathers every rank's elapsed
    time; the figure is ``max / mean - 1`` (how much later than the mean the last one ends),
    over ``--repeats`` starts: median, mean and max, and the mean elapsed time.

Run
    .venv/bin/python bench/oversubscription_skew.py [--workers 4] [--matmuls 20 100 400]
        [--repeats 12] [--out FILE]

Figures (2026-12-06, the 2-core machine, idle; two runs, ``bench/data/oversubscription_skew.json``
is the second): 4 workers, 20 / 100 / 400 products (about 55, 265 and 1060 ms each): median
14.5% and 6.4% / 7.7% and 1.6% / 2.5% and 1.8%, mean 15% and 9.3% / 7.2% and 4.7% / 3.0% and
2.3%, max 26-31% / 16-17% / 5.4-6.4%; 2 workers, 400 products: median 0.2% and 0.4%. The
shares spread widely between runs; the shape holds: the last rank ends tens of milliseconds
late, more so in relative terms the shorter the stretch, and not at all with a core each.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time
from pathlib import Path

from bench_workers import emit_result


def _worker(rank: int, world: int, port: int, matmuls: list[int], repeats: int,
            queue: object) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    a, b = torch.randn(512, 256), torch.randn(256, 512)
    out: dict[int, dict[str, float]] = {}
    for count in matmuls:
        skews, means = [], []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(count):
                a @ b
            elapsed = torch.tensor([time.perf_counter() - start])
            every = [torch.zeros(1) for _ in range(world)]
            dist.all_gather(every, elapsed)
            times = [t.item() for t in every]
            means.append(statistics.fmean(times))
            skews.append(max(times) / means[-1] - 1)
        out[count] = {"skew_median": statistics.median(skews),
                      "skew_mean": statistics.fmean(skews), "skew_max": max(skews),
                      "elapsed_mean_s": statistics.fmean(means)}
    if rank == 0:
        queue.put(out)  # type: ignore[attr-defined]
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--matmuls", type=int, nargs="+", default=[20, 100, 400])
    parser.add_argument("--repeats", type=int, default=12)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.workers < 2 or args.repeats < 1 or min(args.matmuls) < 1:
        parser.error("--workers must be at least 2, --repeats and --matmuls at least 1")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    procs = [ctx.Process(target=_worker, args=(r, args.workers, port, args.matmuls,
                                                args.repeats, queue))
             for r in range(args.workers)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
    if queue.empty():
        print("oversubscription_skew: the workers did not report", file=sys.stderr)
        return 1
    result = {"benchmark": "oversubscription_skew", "workers": args.workers,
              "cores": os.cpu_count(), "repeats": args.repeats,
              "by_matmuls": {str(k): v for k, v in queue.get().items()}}
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
