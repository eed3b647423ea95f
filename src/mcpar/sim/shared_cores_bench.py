"""What sharing cores costs CPU workers, measured for the local profile: the time-slicing
penalty on compute (``time_slicing_penalty``), and the cost of a point-to-point exchange posted
around a burst of compute, as mcpar's ring attention posts each step's, when workers share the
cores (``crowded_exchange_cost``). The cost model reads both where a layout runs more one-thread
workers than the machine has cores (``costmodel._shared_cores``, ``compute.context_exposed``).
"""

from __future__ import annotations

import statistics
import time

from mcpar.launch.env import find_free_port
from mcpar.sim.microbench import training_block_step


def _slicing_worker(index: int, phases: list[int], iters: int, barrier: object,
                    queue: object) -> None:
    """One process of ``time_slicing_penalty``: in each phase, the first ``phases[k]`` workers
    run ``iters`` steps from one common start and report their time; the others wait for the
    next phase asleep at the barrier."""
    import torch

    torch.set_num_threads(1)
    step = training_block_step(torch.device("cpu"))
    step()
    for k, running in enumerate(phases):
        barrier.wait()  # type: ignore[attr-defined]
        if index < running:
            t0 = time.perf_counter()
            for _ in range(iters):
                step()
            queue.put((k, time.perf_counter() - t0))  # type: ignore[attr-defined]


def time_slicing_penalty(cores: int, seconds: float = 0.5, repeats: int = 5) -> float:
    """What sharing cores costs CPU workers beyond splitting them: twice as many one-thread
    processes as cores take ``T_2c / (2 T_c) - 1`` longer than ``cores`` of them would twice
    over, on ``training_block_step``; the median of ``repeats``, at least 0. Contention between
    cores that all run (memory, shared caches) is in the all-core rates already, so ``T_c`` is
    timed with every core busy. (A working set about ten times larger, four blocks with an 8k
    vocabulary and AdamW, gave no larger share on the 2-core machine, 0.00-0.07 against
    0.05-0.12 for one block: refilling caches after a switch is not what it measures.)"""
    import torch
    import torch.multiprocessing as mp

    torch.set_num_threads(1)
    step = training_block_step(torch.device("cpu"))
    step()
    t0 = time.perf_counter()
    for _ in range(3):
        step()
    iters = max(3, round(seconds / ((time.perf_counter() - t0) / 3)))
    phases = [cores, 2 * cores] * repeats
    ctx = mp.get_context("spawn")
    queue, barrier = ctx.SimpleQueue(), ctx.Barrier(2 * cores)
    procs = [ctx.Process(target=_slicing_worker, args=(i, phases, iters, barrier, queue))
             for i in range(2 * cores)]
    for p in procs:
        p.start()
    makespan = [0.0] * len(phases)
    for _ in range(sum(phases)):
        k, took = queue.get()
        makespan[k] = max(makespan[k], took)
    for p in procs:
        p.join(60)
    ratios = [makespan[k + 1] / (2 * makespan[k]) - 1 for k in range(0, len(phases), 2)]
    return max(0.0, statistics.median(ratios))


# The crowded exchange's shapes: a message of about a small ring step's K/V, and a burst of
# compute about one ring block's at the ranking bench's shapes (a few milliseconds).
EXCHANGE_BYTES = 65536
EXCHANGE_BURST_MATMULS = 8  # 256 x 256 products: about 2.5 ms of one core


def _exchange_worker(rank: int, world: int, port: int, phases: list[int], iters: int,
                     queue: object) -> None:
    """One process of ``crowded_exchange_cost``: in each phase the first ``phases[k]`` workers,
    in pairs, time loops of (post a send to and a receive from the pair's other worker, a burst
    of compute, wait for both) against loops of the burst alone, and report the difference per
    exchange; the others wait at the barrier."""
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=120))
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    send, arrived = torch.zeros(EXCHANGE_BYTES // 4), torch.zeros(EXCHANGE_BYTES // 4)
    peer = rank ^ 1

    def burst() -> None:
        for _ in range(EXCHANGE_BURST_MATMULS):
            a @ b

    def exchange() -> None:
        sent, received = dist.isend(send, peer), dist.irecv(arrived, peer)
        burst()
        sent.wait()
        received.wait()

    def loop(fn: object, count: int) -> float:
        t0 = time.perf_counter()
        for _ in range(count):
            fn()  # type: ignore[operator]
        return time.perf_counter() - t0

    for running in phases:
        dist.barrier()
        if rank < running:
            exchange()
            bare = loop(burst, iters)
            queue.put((running, (loop(exchange, iters) - bare) / iters))  # type: ignore[attr-defined]
    dist.barrier()
    dist.destroy_process_group()


def crowded_exchange_cost(cores: int, iters: int = 40, repeats: int = 3) -> float:
    """Seconds a posted point-to-point exchange (the ring's step: send and receive posted, a
    burst of compute, both waited) costs beyond the burst when twice as many one-thread workers
    as cores run, more than when as many run as there are cores: the median of ``repeats``
    pairs of phases, of the median pair, at least 0. Measured on the 2-core machine
    (2026-12-07): the exchange cost 0.2-1.5 ms with 2 workers and 2.2-3.6 ms with 4, from
    16 KiB to 1 MiB and bursts of 0.7-11 ms, about flat in the size; blocking all-reduces after
    the same bursts were not slower with 4 workers than with 2."""
    import torch.multiprocessing as mp

    alone = max(2, cores - cores % 2)  # pairs of workers, at most one per core
    phases = [alone, 2 * alone] * repeats
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [ctx.Process(target=_exchange_worker, args=(r, 2 * alone, port, phases, iters,
                                                        queue)) for r in range(2 * alone)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
    costs: dict[int, list[float]] = {}
    for _ in range(sum(phases)):
        if queue.empty():
            raise RuntimeError("the crowded exchange micro-benchmark did not report")
        running, cost = queue.get()
        costs.setdefault(running, []).append(cost)
    # Each phase's workers report in turn: phase k's reports are the k-th slice of each list.
    per_phase = {n: [statistics.median(c[k * n:(k + 1) * n]) for k in range(repeats)]
                 for n, c in costs.items()}
    extra = [crowded - uncrowded
             for crowded, uncrowded in zip(per_phase[2 * alone], per_phase[alone], strict=True)]
    return max(0.0, statistics.median(extra))
