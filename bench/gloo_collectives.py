"""What gloo's collectives cost on this machine: time per call and bytes on the loopback wire.

Why
    mcpar counts the bytes of every collective from shapes (``comm/communicator.py``), with the
    formula of the algorithm the backend runs, and chooses algorithms by what they cost. This
    bench checks both against gloo itself: it found that gloo's ``reduce_scatter`` sends a whole
    all-reduce (2(n-1)/n of the buffer per rank, not the ring's (n-1)/n) and takes an
    all-reduce's time, which is why mcpar's reduce-scatter on gloo is an all-to-all of the
    chunks and a local sum, and why ZeRO-3 carries a layer's reduce-scatter and the next
    layer's gather in one all-to-all there.

What it measures
    For ``--worlds`` ranks (gloo on 127.0.0.1, one thread each) and each ``--sizes`` (MB of the
    full buffer): the median seconds per call over ``--calls`` calls, and the loopback
    interface's transmitted bytes per call per rank, divided by the buffer's bytes
    (``/proc/net/dev``: every process's loopback traffic, so run it on a quiet machine; TCP and
    gloo headers add a few percent), for torch's ``all_reduce``, ``reduce_scatter_single``,
    ``all_gather_single`` (buffer = its output), ``all_to_all_single``, and mcpar's
    ``Communicator.reduce_scatter_into``; next to each, the fraction mcpar's books count.

Run
    .venv/bin/python bench/gloo_collectives.py [--worlds 2 4] [--sizes 0.1 0.4 4] [--calls 20]
        [--out FILE]

Figures (2026-12-02, the 2-core machine, load 2; ``bench/data/gloo_collectives.json``)
    Wire bytes per rank / buffer, at 0.1, 0.4 and 4 MB: torch's reduce-scatter 1.00-1.01 at 2
    ranks and 1.50-1.54 at 4 (an all-reduce's 2(n-1)/n); mcpar's 0.50 and 0.73-0.75, the
    (n-1)/n its books count. Median ms per call at 2 ranks (0.1 / 0.4 / 4 MB): torch
    reduce-scatter 0.94 / 1.93 / 14.2, mcpar's 0.70 / 3.61 / 6.73, all-gather 0.64 / 1.11 /
    6.96, all-to-all 0.39 / 1.05 / 3.85, all-reduce 0.77 / 2.71 / 11.1. At 4 ranks on 2 cores
    every collective took 3.5-16 ms. Times spread widely between runs on this machine; the
    bytes do not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_workers import emit_result

from mcpar.comm.communicator import Communicator
from mcpar.launch.env import find_free_port
from mcpar.topology import ParallelDims

OPS = ("all_reduce", "torch_reduce_scatter", "mcpar_reduce_scatter", "all_gather",
       "all_to_all")


def loopback_tx_bytes() -> int:
    for line in Path("/proc/net/dev").read_text().splitlines():
        name, _, counters = line.partition(":")
        if name.strip() == "lo":
            return int(counters.split()[8])
    raise RuntimeError("no loopback interface in /proc/net/dev")


def counted_fraction(op: str, n: int) -> float:
    """The bytes per rank mcpar's books count for the op, as a fraction of the buffer."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def calls_of(comm: Communicator, buffer: torch.Tensor, shard: torch.Tensor,
             full: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each op once, on these tensors (the reduce-scatters into ``shard``, the gathers and the
    all-to-all into ``full``)."""
    return {"all_reduce": lambda: dist.all_reduce(buffer),
            "torch_reduce_scatter": lambda: dist.reduce_scatter_single(shard, buffer),
            "mcpar_reduce_scatter": lambda: comm.reduce_scatter_into(shard, buffer),
            "all_gather": lambda: dist.all_gather_single(full, shard),
            "all_to_all": lambda: dist.all_to_all_single(full, buffer)}


def worker(rank: int, world: int, port: int, sizes: list[float], calls: int,
           out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dims = ParallelDims(dp=world, tp=1, pp=1, ep=1, world_size=world)
    dims.build_mesh("cpu")
    comm = Communicator(dims)
    results = []
    for mb in sizes:
        numel = max(world, int(mb * 1e6 / 4) // world * world)
        buffer = torch.randn(numel)
        shard = torch.empty(numel // world)
        full = torch.empty(numel)
        run = calls_of(comm, buffer, shard, full)
        for op in OPS:
            for _ in range(3):  # warm the connections and allocations
                run[op]()
            dist.barrier()
            tx_start = loopback_tx_bytes()
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                run[op]()
                times.append(time.perf_counter() - start)
            dist.barrier()
            wire = (loopback_tx_bytes() - tx_start) / calls / world / (numel * 4)
            results.append({"world": world, "buffer_mb": numel * 4 / 1e6, "op": op,
                            "median_ms": 1e3 * statistics.median(times),
                            "wire_fraction_per_rank": wire,
                            "counted_fraction_per_rank": counted_fraction(op, world)})
    if rank == 0:
        (Path(out_dir) / f"world{world}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.4, 4.0],
                   help="MB of the full buffer")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if min(args.worlds) < 2 or args.calls < 1 or min(args.sizes) <= 0:
        p.error("--worlds at least 2, --calls at least 1, --sizes positive")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.worlds:
            print(f"gloo_collectives: {world} ranks", file=sys.stderr, flush=True)
            mp.start_processes(worker, args=(world, find_free_port(), args.sizes, args.calls,
                                             tmp), nprocs=world, start_method="fork")
            rows += json.loads((Path(tmp) / f"world{world}.json").read_text())
    result = {"benchmark": "gloo_collectives", "torch_version": torch.__version__,
              "cores": os.cpu_count(), "calls": args.calls, "load_avg_1min": os.getloadavg()[0],
              "rows": rows}
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
