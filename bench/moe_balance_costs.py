"""Measured prices of the expert-placement trace model: expert compute per assignment, and the
wall time of moving one expert over loopback and over an emulated 100 Mbit/s link.

What it measures (``--out`` JSON, read by ``bench/moe_balance.py`` and the tests)
    - ``compute_s_per_assignment``: forward + backward of one expert MLP (hidden ``--hidden``,
      inner ``--ffn``, GELU, fp32, one thread) per routed (token, expert) row, timed over
      ``--rows`` rows, the median of ``--reps``.
    - per link (``loopback``: two gloo processes in one network namespace; ``100mbit``: two
      emulated nodes, ``netcluster.NetCluster(2, rate="100mbit")``, one process each): the median
      wall time of a gloo send/recv of one expert's migration payload, its two weight matrices
      and their two Adam moments (3 x 2 x hidden x ffn fp32 values), and the throughput
      (bytes/s) it implies.
    - ``seconds_per_excess_assignment`` per link: the compute plus the all-to-all bytes of one
      more row on the most loaded rank (hidden x 4 bytes, dispatched and combined, forward and
      backward: 4 transfers) at the link's measured throughput. That, and ``migration_s``, are
      the ``StepCostModel`` of the traces.

Needs root for the emulated link (network namespaces and tc); without it the ``100mbit`` entry
says why it is missing.

How to run
    python bench/moe_balance_costs.py [--hidden 1024] [--ffn 4096] [--out bench/data/...json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent
DEFAULT_OUT = BENCH / "data" / "moe_balance_costs.json"


def expert_compute_s(hidden: int, ffn: int, rows: int, reps: int) -> float:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    w1 = torch.randn(hidden, ffn, requires_grad=True)
    w2 = torch.randn(ffn, hidden, requires_grad=True)
    x = torch.randn(rows, hidden, requires_grad=True)
    times = []
    for _ in range(reps + 1):  # the first is a warm-up
        t0 = time.perf_counter()
        out = torch.nn.functional.gelu(x @ w1) @ w2
        out.sum().backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:]) / rows


def transfer_worker(numel: int, reps: int, out: str) -> None:
    """Rank 0 sends, rank 1 receives `numel` fp32 values, `reps` times (after a warm-up)."""
    import torch.distributed as dist
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    buf = torch.zeros(numel)
    times = []
    for rep in range(reps + 1):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            dist.send(buf, 1)
        else:
            dist.recv(buf, 0)
        dist.barrier()  # the receiver has it all
        if rep:
            times.append(time.perf_counter() - t0)
    if rank == 0:
        Path(out).write_text(json.dumps({"seconds": times}))
    dist.destroy_process_group()


def measure_link(kind: str, numel: int, reps: int, workdir: Path) -> dict:
    from netcluster import LoopbackCluster, NetCluster, NetClusterError
    from netcluster.torchrun import launch_torchrun
    out = workdir / f"transfer-{kind}.json"
    cluster = LoopbackCluster(2) if kind == "loopback" else NetCluster(2, rate="100mbit")
    try:
        with cluster:
            run = launch_torchrun(cluster, 1, [str(Path(__file__).resolve()), "_transfer",
                                               str(numel), str(reps), str(out)],
                                  timeout_s=600, cwd=str(REPO))
    except NetClusterError as err:
        return {"error": f"cluster: {err}"}
    if not run.ok:
        return {"error": "transfer failed: " + " | ".join(run.output)[-1500:]}
    seconds = json.loads(out.read_text())["seconds"]
    nbytes = numel * 4
    median = statistics.median(seconds)
    return {"bytes": nbytes, "seconds": seconds, "migration_s": median,
            "bytes_per_s": nbytes / median}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=4096)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=str(DEFAULT_OUT))
    args = p.parse_args(argv)
    import tempfile
    compute = expert_compute_s(args.hidden, args.ffn, args.rows, args.reps)
    numel = 3 * 2 * args.hidden * args.ffn
    a2a_bytes = 4 * args.hidden * 4
    links = {}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in ("loopback", "100mbit"):
            links[kind] = measure_link(kind, numel, args.reps, Path(tmp))
            if "bytes_per_s" in links[kind]:
                links[kind]["seconds_per_excess_assignment"] = (
                    compute + a2a_bytes / links[kind]["bytes_per_s"])
            print(f"{kind}: {links[kind]}", file=sys.stderr)
    report = {"bench": "moe_balance_costs", "hidden": args.hidden, "ffn": args.ffn,
              "expert_params": 2 * args.hidden * args.ffn,
              "compute_s_per_assignment": compute, "all_to_all_bytes_per_assignment": a2a_bytes,
              "links": links, "load_avg_1m": os.getloadavg()[0]}
    text = json.dumps(report, indent=2)
    print(text)
    Path(args.out).write_text(text + "\n")
    return report


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "_transfer":
        transfer_worker(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        main()
