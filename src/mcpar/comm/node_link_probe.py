"""The link between a job's nodes, measured by the job before it plans its layout.

``parallelism.auto`` prices every layout on this machine's profile, which measures one host's
loopback. A job whose workers span several nodes (torchrun's ``LOCAL_WORLD_SIZE`` below its
``WORLD_SIZE``) also needs the link between them: which axis crosses it decides the step as soon
as it is slower than the host. The ``cluster.inter_node_*`` keys give it; without them the
workers time it here, once the process group exists and before any plan is made.

How: the first rank of node 0 and the first rank of node 1 ping-pong a small and a large message
(``PROBE_BYTES``) a few times; the fastest round trip of each size gives ``t = 2 latency + n /
bandwidth``, solved for both. Rank 0 broadcasts the two figures, so every worker prices the same
cluster and picks the same layout. The other ranks only wait in the broadcast: nothing else
crosses the link meanwhile. A point-to-point exchange is what a pipeline's activations and one
hop of a ring send, and ``local_cluster`` shares the one link among a node's ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mcpar.sim.hardware import NodeLink

# Small enough to time the latency, large enough that the rate, not a shaper's burst or the
# TCP window's first round trips, decides the large one's time.
PROBE_BYTES = (1 << 12, 1 << 22)
PROBE_ROUNDS = 3  # timed round trips per size, after one that warms the connection


def _round_trips(peer: int, nbytes: int, leads: bool) -> float:
    """The fastest of ``PROBE_ROUNDS`` round trips of ``nbytes`` there and 4 bytes back, as
    the leading side times it (the other side echoes; its figure is unused)."""
    payload = torch.zeros(nbytes // 4, dtype=torch.float32)
    ack = torch.zeros(1, dtype=torch.float32)
    best = float("inf")
    for round_ in range(1 + PROBE_ROUNDS):
        start = time.perf_counter()
        if leads:
            dist.send(payload, peer)
            dist.recv(ack, peer)
        else:
            dist.recv(payload, peer)
            dist.send(ack, peer)
        if round_:
            best = min(best, time.perf_counter() - start)
    return best


def fit_round_trips(small_s: float, large_s: float, small_bytes: int = PROBE_BYTES[0],
                    large_bytes: int = PROBE_BYTES[1]) -> tuple[float, float]:
    """(one-way latency s, bandwidth bytes/s) of two round trips ``t = 2 latency + n / bw``."""
    slope = (large_s - small_s) / (large_bytes - small_bytes)
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    latency = max(0.0, (small_s - small_bytes / bandwidth) / 2)
    return latency, bandwidth


def measure_node_link(ranks_per_node: int) -> NodeLink:
    """The link between node 0 and node 1 (ranks 0 and ``ranks_per_node``), the same figures on
    every rank. Every rank of the default process group must call it."""
    rank = dist.get_rank()
    peer = ranks_per_node  # node 1's first rank: consecutive ranks share a node
    figures = torch.zeros(2, dtype=torch.float64)
    if rank in (0, peer):
        times = [_round_trips(peer if rank == 0 else 0, n, leads=rank == 0)
                 for n in PROBE_BYTES]
        if rank == 0:
            figures = torch.tensor(fit_round_trips(*times), dtype=torch.float64)
    dist.broadcast(figures, src=0)
    latency, bandwidth = float(figures[0]), float(figures[1])
    return NodeLink(ranks_per_node, latency, bandwidth, "measured at start")
