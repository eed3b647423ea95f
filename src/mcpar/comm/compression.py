"""The 1-bit error-compensated all-reduce, which 1-bit Adam exchanges its momentum with.

Why it is written here and not taken from a library (PowerSGD, the other codec: powersgd.py):

- Every collective of the job must go through the CommunicationController, which counts the
  bytes and time per operation, mesh axis and codec. DeepSpeed's compressed backends issue
  their own ``torch.distributed`` calls, so their traffic would be invisible to it.
- torch has no 1-bit collective, and none at all on gloo: the 1-bit exchange is two all-to-alls
  of bit-packed signs, built from the controller's primitives.

1-bit (docs: algorithms.md §1.2, Tang et al. 2021, DeepSpeed's NCCL backend). Each rank
compresses (its buffer + its worker error) to one scale and one sign bit per element, keeps the
compression error, and sends chunk j of its signs to rank j (all-to-all). Rank j, acting as the
"server" of chunk j, averages the p decompressed chunks, adds its server error, compresses the
average again (keeping that error too) and sends it to every rank (a second all-to-all with an
all-gather's bytes: one round of messages where gloo's ring all-gather takes p - 1, which a slow,
high-latency link charges for). Every rank then decodes the same bytes into the same averaged
buffer, so the result is bit-identical on all ranks. The distributed
function and the single-process simulation share the compress / server-average / decompress
helpers, so both do the same floating-point operations in the same order.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from mcpar.comm.communicator import CommHandle, Communicator

ONEBIT_CODEC = "1bit"

# Bit i of a packed byte holds element 8k + i, most significant bit first (numpy.packbits order).
_BIT_SHIFTS = (7, 6, 5, 4, 3, 2, 1, 0)


_SHIFTS_BY_DEVICE: dict[torch.device, torch.Tensor] = {}


def _shifts(device: torch.device) -> torch.Tensor:
    """The bit positions as a uint8 tensor on ``device``, made once per device (no host-to-
    device copy per call)."""
    shifts = _SHIFTS_BY_DEVICE.get(device)
    if shifts is None:
        shifts = torch.tensor(_BIT_SHIFTS, dtype=torch.uint8, device=device)
        _SHIFTS_BY_DEVICE[device] = shifts
    return shifts


# --- sign bit packing ---------------------------------------------------------------------------

def pack_signs(x: torch.Tensor) -> torch.Tensor:
    """One bit per element of ``x``: 1 where its sign bit is clear (+0 and up), 0 where set.

    Returns a uint8 tensor of ``x.numel() // 8`` bytes, most significant bit first. ``x`` is read
    flat (float32); its number of elements must be a multiple of 8 (callers pad). The bit is
    the float's own sign bit, so -0.0 packs as -1 (as does a NaN with its sign bit set): reading
    it costs a shift, where ``x >= 0`` costs a comparison that is 4x slower on CPU, and the
    compression error is formed with the same sign (``torch.copysign``), so every element is
    still coded as +s or -s with its error kept. Hand-written because torch has no packbits and
    the 1-bit exchange sends these bytes.
    """
    if x.numel() % 8:
        raise ValueError(f"pack_signs needs a multiple of 8 elements, got {x.numel()}")
    flat = x.reshape(-1).to(torch.float32).contiguous()
    # 0xFF where the sign bit is set, 0x00 elsewhere (int32 -1 / 0, truncated to a byte).
    negative = (flat.view(torch.int32) >> 31).to(torch.uint8)
    if _multiply_packing_works(x.device):
        rows = negative.view(torch.int64) & _LOW_BIT_OF_EACH_BYTE
        return _pack_rows(rows).bitwise_not_()
    bits = (negative.reshape(-1, 8) & 1) ^ 1
    return (bits << _shifts(x.device)).sum(dim=1, dtype=torch.uint8)


_LOW_BIT_OF_EACH_BYTE = 0x0101010101010101


# The 8 bytes of a row of 0/1 flags, read as one little-endian int64 v = sum_k b_k 2^(8k), times
# this constant put b_k at bit 63 - k, with the other partial products above bit 63 (discarded)
# or below bit 56 and never carrying into the top byte: the top byte is the MSB-first packed
# byte. 3-4x faster than shifting and summing per bit (one pass instead of eight).
_PACK_MULTIPLIER = 0x8040201008040201 - (1 << 64)  # as a signed int64
_MULTIPLY_CHECKED: dict[torch.device, bool] = {}


def _pack_by_multiply(bits: torch.Tensor) -> torch.Tensor:
    return _pack_rows(bits.contiguous().view(torch.int64).reshape(-1))


def _pack_rows(rows: torch.Tensor) -> torch.Tensor:
    """int64 rows of eight 0/1 bytes -> one MSB-first byte each."""
    return ((rows * _PACK_MULTIPLIER) >> 56).to(torch.uint8)


def _multiply_packing_works(device: torch.device) -> bool:
    """The multiply relies on int64 products wrapping modulo 2^64, which CPU and CUDA kernels
    do but no document promises: check it once per device against the bit-by-bit packing."""
    works = _MULTIPLY_CHECKED.get(device)
    if works is None:
        flags = torch.tensor([[(i >> (7 - k)) & 1 for k in range(8)] for i in range(256)],
                             dtype=torch.uint8, device=device)
        works = bool(torch.equal(_pack_by_multiply(flags),
                                 torch.arange(256, device=device).to(torch.uint8)))
        _MULTIPLY_CHECKED[device] = works
    return works


_SIGN_TABLES: dict[torch.device, torch.Tensor] = {}


def _sign_table(device: torch.device) -> torch.Tensor:
    """(256, 8) float32: the ±1 signs of every byte value, MSB first."""
    table = _SIGN_TABLES.get(device)
    if table is None:
        bits = (torch.arange(256).reshape(-1, 1) >> torch.tensor(_BIT_SHIFTS)) & 1
        table = (bits.to(torch.float32) * 2.0 - 1.0).to(device)
        _SIGN_TABLES[device] = table
    return table


def _scaled_signs(packed: torch.Tensor, scale: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """s * (±1 signs of ``packed``), one table lookup per byte: the table is scaled first
    (256 x 8 products), which gives exactly the products an unpack-then-multiply would."""
    table = _sign_table(packed.device) * scale.reshape(1, 1)
    index = packed.reshape(-1).to(torch.int32)
    if out is None:
        return torch.index_select(table, 0, index).reshape(-1)
    torch.index_select(table, 0, index, out=out.view(-1, 8))
    return out


def unpack_signs(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ±1 float32 signs of ``numel`` elements packed by :func:`pack_signs`.

    ``numel`` must be exactly ``8 * packed.numel()``: a mismatch means the caller lost track of
    its padding, which would silently misalign every later element. One table lookup per byte.
    """
    if packed.dtype != torch.uint8:
        raise ValueError(f"packed signs must be uint8, got {packed.dtype}")
    if numel != 8 * packed.numel():
        raise ValueError(f"{packed.numel()} packed bytes hold {8 * packed.numel()} signs, "
                         f"not {numel}")
    # index_select with int32 indices: 6x faster on CPU than advanced indexing with int64.
    return torch.index_select(_sign_table(packed.device), 0,
                              packed.reshape(-1).to(torch.int32)).reshape(-1)


# --- 1-bit error-compensated all-reduce --------------------------------------------------------

def onebit_padded_size(numel: int, world: int) -> int:
    """D': the smallest multiple of world * lcm(world, 8) that is >= numel.

    Each of the ``world`` chunks then has D'/world elements, a multiple of 8, so every chunk's
    signs fill whole bytes and the chunks split the packed bytes evenly.
    """
    if world < 1:
        raise ValueError(f"world size must be >= 1, got {world}")
    divider = world * (world * 8 // math.gcd(world, 8))
    return max(1, math.ceil(numel / divider)) * divider


@dataclass
class OneBitErrorBuffers:
    """The two error-feedback buffers of one rank for a flat buffer of ``numel`` elements.

    ``worker``: D' float32, this rank's compression error of its own (padded) buffer.
    ``server``: D'/world float32, the error of the chunk this rank averages as "server".
    Both differ between ranks and must persist across steps (and checkpoints) for the error
    compensation to be exact.
    """

    worker: torch.Tensor
    server: torch.Tensor

    @classmethod
    def zeros(cls, numel: int, world: int,
              device: torch.device | str | None = None) -> OneBitErrorBuffers:
        padded = onebit_padded_size(numel, world)
        return cls(worker=torch.zeros(padded, dtype=torch.float32, device=device),
                   server=torch.zeros(padded // world, dtype=torch.float32, device=device))


def _compress_with_feedback(z: torch.Tensor, error_out: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """C[z] = s * sign⁺(z) with s = ||z||₂ / sqrt(len z); writes z - C[z] into ``error_out``.

    Returns (packed signs of z, s as a float32 tensor of shape (1,)).
    """
    scale = (torch.linalg.vector_norm(z) / math.sqrt(z.numel())).reshape(1)
    packed = pack_signs(z)
    # error = z - s * sign(z), the sign being z's sign bit, as packed.
    torch.copysign(scale.expand(z.numel()), z, out=error_out)
    torch.sub(z, error_out, out=error_out)
    return packed, scale


def _compress_worker(buffer: torch.Tensor, worker_error: torch.Tensor,
                     error_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker side: z = pad(buffer) + worker_error, compressed; z - C[z] goes to ``error_out``
    (default: ``worker_error`` itself)."""
    numel = buffer.numel()
    z = torch.empty_like(worker_error)
    torch.add(worker_error[:numel], buffer.reshape(-1), out=z[:numel])
    z[numel:].copy_(worker_error[numel:])
    return _compress_with_feedback(z, worker_error if error_out is None else error_out)


def _server_average(worker_signs: torch.Tensor, worker_scales: torch.Tensor,
                    server_error: torch.Tensor, error_out: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Server side of one chunk: y = (1/p) Σ_i s_i sign_i + server_error, compressed again; its
    error goes to ``error_out`` (default: ``server_error`` itself).

    ``worker_signs``: (p, chunk/8) packed signs of every worker's copy of this chunk, in rank
    order; ``worker_scales``: (p,). The sum runs in rank order, so every rank (and the
    simulation) that averages the same inputs gets the same bits.
    """
    world, chunk = worker_signs.shape[0], server_error.numel()
    if worker_signs.shape[1] * 8 != chunk:
        raise ValueError(f"{worker_signs.shape[1]} packed bytes per worker do not hold a "
                         f"chunk of {chunk} elements")
    total = _scaled_signs(worker_signs[0], worker_scales[0])
    if world > 1:
        term = torch.empty_like(total)
        for i in range(1, world):
            total.add_(_scaled_signs(worker_signs[i], worker_scales[i], out=term))
    total.div_(world).add_(server_error)
    return _compress_with_feedback(total, server_error if error_out is None else error_out)


def _decompress(server_signs: torch.Tensor, server_scales: torch.Tensor,
                numel: int) -> torch.Tensor:
    """Concatenate S_j * sign⁺(y_j) over the chunks j and drop the padding."""
    world = server_scales.numel()
    padded = 8 * server_signs.numel()
    values = torch.empty(world, padded // world, dtype=torch.float32,
                         device=server_signs.device)
    for j, packed in enumerate(server_signs.view(world, -1)):
        _scaled_signs(packed, server_scales[j], out=values[j])
    return values.view(-1)[:numel]


def _check_buffers(numel: int, world: int, worker_error: torch.Tensor,
                   server_error: torch.Tensor) -> int:
    padded = onebit_padded_size(numel, world)
    if worker_error.numel() != padded or server_error.numel() != padded // world:
        raise ValueError(
            f"error buffers of {worker_error.numel()} / {server_error.numel()} elements do not "
            f"fit {numel} elements over {world} ranks (need {padded} / {padded // world}); "
            "allocate them with OneBitErrorBuffers.zeros"
        )
    if worker_error.dtype != torch.float32 or server_error.dtype != torch.float32:
        raise ValueError("error buffers must be float32")
    return padded


def onebit_compressed_allreduce(buffer: torch.Tensor, worker_error: torch.Tensor,
                                server_error: torch.Tensor, comm: Communicator,
                                axis: str = "dp",
                                errors_out: OneBitErrorBuffers | None = None) -> torch.Tensor:
    """The error-compensated 1-bit average of ``buffer`` over the ranks of ``axis``.

    algorithms.md §1.2 steps 2-6. Returns a new flat float32 tensor of ``buffer.numel()``
    elements, bit-identical on every rank; updates ``worker_error`` and ``server_error`` in
    place, or leaves them as they are and writes the new errors to ``errors_out``. Per rank it
    sends about 2 (p-1)/p * D'/8 bytes plus 2 (p-1) float32 scales, against 2 (p-1)/p * 4 D
    bytes for an fp32 ring all-reduce, in two all-to-alls whose messages end with their scale.
    With one rank it runs the same compression with error feedback and no communication.
    """
    return onebit_compressed_allreduce_many(
        [OneBitJob(buffer, worker_error, server_error, errors_out)], comm, axis)[0]


@dataclass
class OneBitJob:
    """One buffer to average with :func:`onebit_compressed_allreduce_many`, with its error
    buffers (updated in place, or left as they are when ``errors_out`` is given)."""

    buffer: torch.Tensor
    worker_error: torch.Tensor
    server_error: torch.Tensor
    errors_out: OneBitErrorBuffers | None = None


def onebit_compressed_allreduce_many(
        jobs: Iterable[OneBitJob], comm: Communicator, axis: str = "dp",
        on_result: Callable[[int, torch.Tensor], None] | None = None,
        jobs_spread_out: bool = False) -> list[torch.Tensor]:
    """Several independent 1-bit exchanges, pipelined: each job's result is exactly what
    :func:`onebit_compressed_allreduce` would return for it alone.

    ``jobs`` may be produced lazily (e.g. handed over one by one from another thread): job k
    is compressed and its signs sent as soon as it is produced, while the producer forms job
    k+1. ``on_result(k, result)`` is called as each job's result is decoded, in job order,
    so that a caller can use the first results while the later ones are still on the wire.

    The order of the stages must be the same on every rank, so it cannot follow when each job
    happens to arrive; the caller says what to expect. By default the jobs come one right
    after the other: every job's first phase, then every job's second. With
    ``jobs_spread_out`` (buckets launched from the backward pass, milliseconds apart) each job
    is served as soon as it is started, and the one before it finished when the next arrives:
    waiting for a later job before serving the first would hold the first's result until the
    end of the backward pass.

    Why: one exchange is a chain compress -> all-to-all -> server average -> all-to-all ->
    decode in which the link idles while a rank computes and the rank idles while bytes cross
    a slow link. Here job k+1 is compressed while job k's signs are on the wire, and job k is
    served while job k+1's are: the all-to-alls are started in the background (same order on
    every rank: every job's first phase, then every job's second, as each becomes ready).
    """
    world = comm.axis_size(axis)
    results: list[torch.Tensor] = []

    def finish(flight: _InFlight) -> None:
        results.append(_finish_exchange(flight))
        if on_result is not None:
            on_result(len(results) - 1, results[-1])

    if jobs_spread_out:
        previous = None
        for job in jobs:
            flight = _start_exchange(job, world, comm, axis)
            if previous is not None:
                finish(previous)
            _serve_exchange(flight, comm, axis)
            previous = flight
        if previous is not None:
            finish(previous)
        return results
    flights = [_start_exchange(job, world, comm, axis) for job in jobs]
    for flight in flights:
        _serve_exchange(flight, comm, axis)
    for flight in flights:
        finish(flight)
    return results


@dataclass
class _InFlight:
    """One exchange between its stages: what it sent and where its replies land."""

    job: OneBitJob
    chunk_bytes: int
    outgoing: torch.Tensor  # kept alive until its all-to-all is done
    received: torch.Tensor
    handle: CommHandle
    gathered: torch.Tensor | None = None


def _start_exchange(job: OneBitJob, world: int, comm: Communicator,
                    axis: str) -> _InFlight:
    """Compress on the worker side and start phase 1: chunk j of the signs, with this
    worker's scale, goes to rank j (each message ends with its scale, so a step costs two
    collectives, not four: on a slow link every collective pays the latency again)."""
    numel = job.buffer.numel()
    padded = _check_buffers(numel, world, job.worker_error, job.server_error)
    out = job.errors_out
    if out is not None:
        _check_buffers(numel, world, out.worker, out.server)
    signs, scale = _compress_worker(job.buffer, job.worker_error,
                                    None if out is None else out.worker)
    chunk_bytes = padded // 8 // world
    outgoing = torch.cat([signs.view(world, chunk_bytes),
                          _scale_bytes(scale).expand(world, SCALE_BYTES)], dim=1)
    received = torch.empty_like(outgoing)
    handle = comm.all_to_all_single_async(received.view(-1), outgoing.view(-1), axis=axis,
                                          codec=ONEBIT_CODEC)
    return _InFlight(job, chunk_bytes, outgoing, received, handle)


def _serve_exchange(flight: _InFlight, comm: Communicator, axis: str) -> None:
    """Phase 2: average this rank's chunk over the workers, compress it again and send it with
    its scale to every rank, as an all-to-all of the same message to every peer (see the
    module docstring)."""
    flight.handle.wait()
    job, chunk_bytes, received = flight.job, flight.chunk_bytes, flight.received
    world = received.shape[0]
    server_signs, server_scale = _server_average(
        received[:, :chunk_bytes].contiguous(), _bytes_scale(received[:, chunk_bytes:]),
        job.server_error, None if job.errors_out is None else job.errors_out.server)
    message = torch.cat([server_signs, _scale_bytes(server_scale).view(-1)])
    flight.outgoing = message.expand(world, -1).contiguous()
    flight.gathered = torch.empty(world, chunk_bytes + SCALE_BYTES, dtype=torch.uint8,
                                  device=received.device)
    flight.handle = comm.all_to_all_single_async(flight.gathered.view(-1),
                                                 flight.outgoing.view(-1), axis=axis,
                                                 codec=ONEBIT_CODEC)


def _finish_exchange(flight: _InFlight) -> torch.Tensor:
    """Decode every server's chunk: the averaged buffer, the same bits on every rank."""
    flight.handle.wait()
    gathered, chunk_bytes = flight.gathered, flight.chunk_bytes
    assert gathered is not None
    return _decompress(gathered[:, :chunk_bytes].reshape(-1),
                       _bytes_scale(gathered[:, chunk_bytes:]), flight.job.buffer.numel())


SCALE_BYTES = 4  # a float32 scale, sent as raw bytes after its signs


def _scale_bytes(scale: torch.Tensor) -> torch.Tensor:
    """A float32 scale of one element as a (1, 4) uint8 row."""
    return scale.reshape(1).to(torch.float32).contiguous().view(torch.uint8).view(1, SCALE_BYTES)


def _bytes_scale(rows: torch.Tensor) -> torch.Tensor:
    """(p, 4) uint8 rows back to p float32 scales."""
    return rows.reshape(-1).clone().view(torch.float32)  # a fresh, aligned buffer


def simulate_onebit_allreduce(buffers_per_worker: list[torch.Tensor],
                              worker_errors: list[torch.Tensor],
                              server_errors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Single-process simulation of :func:`onebit_compressed_allreduce` over p workers.

    ``buffers_per_worker[i]``, ``worker_errors[i]`` and ``server_errors[i]`` are rank i's
    inputs and error buffers (updated in place). Returns the result every rank would get (the
    same tensor values p times). It calls the same helpers as the distributed version, in the
    same order per rank, so it reproduces it bit for bit: the reference of the tests.
    """
    world = len(buffers_per_worker)
    if not (len(worker_errors) == len(server_errors) == world >= 1):
        raise ValueError("one buffer, worker error and server error per worker")
    numel = buffers_per_worker[0].numel()
    if any(b.numel() != numel for b in buffers_per_worker):
        raise ValueError("every worker's buffer must have the same number of elements")
    padded = 0
    for worker_error, server_error in zip(worker_errors, server_errors, strict=True):
        padded = _check_buffers(numel, world, worker_error, server_error)
    chunk_bytes = padded // 8 // world

    compressed = [_compress_worker(b, e)
                  for b, e in zip(buffers_per_worker, worker_errors, strict=True)]
    worker_scales = torch.cat([scale for _, scale in compressed])
    server_parts = []
    for j in range(world):
        received = torch.stack([signs[j * chunk_bytes:(j + 1) * chunk_bytes]
                                for signs, _ in compressed])
        server_parts.append(_server_average(received, worker_scales, server_errors[j]))
    all_server_signs = torch.cat([signs for signs, _ in server_parts])
    server_scales = torch.cat([scale for _, scale in server_parts])
    result = _decompress(all_server_signs, server_scales, numel)
    return [result.clone() for _ in range(world)]
