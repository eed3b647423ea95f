"""Reduce-scatter as an all-to-all of the chunks and a local sum: how mcpar reduce-scatters over
gloo, whose own reduce-scatter runs a whole all-reduce (2(n-1)/n of the buffer on the wire per
rank, twice the all-to-all's bytes, in 2-4x its time; ``bench/gloo_collectives.py``).

One function for the two places that must agree: the Communicator runs it, and the local
profile's micro-benchmark prices it (``sim.microbench``), so that the cost model's reduce-scatter
line is the one the runtime pays.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


def sum_rows(out: torch.Tensor, rows: torch.Tensor) -> None:
    """``out`` = the sum of ``rows`` [n, len(out)], in row (axis-rank) order: the same float
    sum on every rank."""
    out.copy_(rows[0])
    for row in rows[1:]:
        out.add_(row)


def all_to_all_reduce_scatter(output: torch.Tensor, tensor: torch.Tensor, n: int,
                              group: dist.ProcessGroup | None = None, async_op: bool = False
                              ) -> tuple[dist.Work | None, Callable[[], None]]:
    """Send chunk j of ``tensor`` (flat, ``n`` equal chunks) to rank j of ``group``; the second
    item, called once the work is done, sums the chunks received into ``output``."""
    rows = tensor.reshape(n, -1)
    received = torch.empty_like(rows)
    work = dist.all_to_all_single(received, rows, group=group, async_op=async_op)
    return work, lambda: sum_rows(output.view(-1), received)
