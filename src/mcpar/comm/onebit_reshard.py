"""1-bit Adam's error feedback carried across a change of the data-parallel degree.

What the errors mean. Every data rank i keeps a worker error e_i for each element of its
momentum (what its own compressions have left out so far) and serves one chunk of the averaged
momentum, for which it keeps the server error s (what the second compression left out). Error
feedback telescopes: after t compressed steps, the sum of the averages the ranks applied is the
sum of the true averages minus mean_i(e_i) minus s, element by element. So what has to survive a
change from n to n' data ranks is, per element of the flat momentum, mean_i(e_i) and s. Each new
rank takes the old ranks' mean worker error (the mean of n' equal copies is the old mean) and,
for the chunk it now serves, the server errors of those elements, wherever the old chunking had
put them. The padding of each exchange segment (whole sign bytes per chunk) holds no element of
the model and starts at zero.

Where it applies: the model's other degrees (pipeline, tensor, experts, context) are the same in
both runs and neither run splits the data axis by node (hierarchical 1-bit keeps the errors of a
node's shard), so that every old rank of a model coordinate held the same parameters in the same
flat order. The caller checks the degrees; anything else restarts the errors from zero, and the
load's log says so.

Saved per rank next to the buffers (``CompressionState``): the exchange segments' ranges of the
flat momentum (``ranges``: segment, start, end) and the exchange's (world, rank, intra), so that
the old buffers can be read back per element without the old run's bucket plan.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mcpar.comm.compression import OneBitErrorBuffers, onebit_padded_size

Ranges = Sequence[Sequence[tuple[int, int]]]  # per segment: (start, end) of the flat momentum


def ranges_table(segments: Ranges) -> torch.Tensor:
    """Segments' ranges as an int64 (k, 3) table of (segment, start, end) rows, for a file."""
    rows = [(index, start, end) for index, ranges in enumerate(segments)
            for start, end in ranges]
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3)


def table_ranges(table: torch.Tensor) -> list[list[tuple[int, int]]]:
    """The inverse of :func:`ranges_table`."""
    out: list[list[tuple[int, int]]] = []
    for segment, start, end in table.tolist():
        while len(out) <= segment:
            out.append([])
        out[segment].append((start, end))
    return out


def segment_positions(ranges: Sequence[tuple[int, int]]) -> torch.Tensor:
    """Flat positions of one segment's elements, in the segment's (exchange) order."""
    return torch.cat([torch.arange(start, end, dtype=torch.int64) for start, end in ranges])


def flat_errors(worker: torch.Tensor, server: torch.Tensor, segments: Ranges, world: int,
                rank: int, numel: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One rank's error storage read per element of the flat momentum: its worker errors
    (``numel`` values) and the flat positions and values of the server errors it kept.

    Storage order (``onebit_segments.plan_segments``): every segment's padded worker errors one
    after the other, then every segment's server chunk likewise; rank r serves elements
    [r c, (r+1) c) of each padded segment, c = padded / world."""
    held = sum(end - start for ranges in segments for start, end in ranges)
    if held != numel:
        raise ValueError(f"the segments hold {held} elements, this flat momentum {numel}")
    worker_flat = torch.zeros(numel, dtype=torch.float32)
    positions, values = [], []
    worker_at = server_at = 0
    for ranges in segments:
        where = segment_positions(ranges)
        size = onebit_padded_size(where.numel(), world)
        chunk = size // world
        worker_flat[where] = worker[worker_at:worker_at + where.numel()].float()
        lo, hi = rank * chunk, min((rank + 1) * chunk, where.numel())
        if lo < hi:
            positions.append(where[lo:hi])
            values.append(server[server_at:server_at + hi - lo].float())
        worker_at, server_at = worker_at + size, server_at + chunk
    if worker_at != worker.numel() or server_at != server.numel():
        raise ValueError(f"error buffers of {worker.numel()} and {server.numel()} elements do not "
                         f"match their segments ({worker_at} and {server_at})")
    empty = torch.zeros(0, dtype=torch.int64)
    return (worker_flat, torch.cat(positions) if positions else empty,
            torch.cat(values) if values else empty.float())


def fill_errors(segments: Ranges, errors: Sequence[OneBitErrorBuffers], worker: torch.Tensor,
                server: torch.Tensor, rank: int) -> None:
    """Write per-element errors of the flat momentum into one rank's segment buffers
    (``errors[k]``: segment k's views): each segment's worker errors, and the server errors
    of the chunk ``rank`` serves; the padding zero."""
    for ranges, buffers in zip(segments, errors, strict=True):
        where = segment_positions(ranges)
        buffers.worker.zero_()
        buffers.worker[:where.numel()].copy_(worker[where])
        chunk = buffers.server.numel()
        lo, hi = rank * chunk, min((rank + 1) * chunk, where.numel())
        buffers.server.zero_()
        if lo < hi:
            buffers.server[:hi - lo].copy_(server[where[lo:hi]])


class ErrorMerge:
    """The old ranks' errors of one model coordinate, merged one rank at a time (one rank's
    buffers in memory at once): the mean worker error and the server error of every element."""

    def __init__(self, numel: int) -> None:
        self.numel = numel
        self.worker_sum = torch.zeros(numel, dtype=torch.float64)
        self.server = torch.zeros(numel, dtype=torch.float32)
        self.served = torch.zeros(numel, dtype=torch.bool)
        self.ranks = 0

    def add(self, worker: torch.Tensor, server: torch.Tensor, table: torch.Tensor,
            exchange: torch.Tensor) -> None:
        """One old rank's saved buffers, ranges table and (world, rank, intra)."""
        world, rank, intra = (int(v) for v in exchange.tolist())
        if intra != 1:
            raise ValueError("its errors are a node's shard's (hierarchical data axis)")
        worker_flat, positions, values = flat_errors(worker, server, table_ranges(table), world,
                                                     rank, self.numel)
        self.worker_sum += worker_flat
        self.server[positions] = values
        self.served[positions] = True
        self.ranks += 1

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mean worker error, server error) per flat element; every element must be served."""
        if self.ranks == 0 or not bool(self.served.all()):
            missing = self.numel - int(self.served.sum())
            raise ValueError(f"{missing} elements have no saved server error")
        return (self.worker_sum / self.ranks).float(), self.server
