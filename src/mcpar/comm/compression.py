"""Gradient and momentum compression codecs: 1-bit error-compensated all-reduce and PowerSGD.

Why these are written here and not taken from a library:

- Every collective of the job must go through the CommunicationController, which counts the
  bytes and time per operation, mesh axis and codec. DeepSpeed's compressed backends and torch's
  ``powerSGD_hook`` issue their own ``torch.distributed`` calls (the latter only from inside DDP's
  C++ reducer, which this framework does not use), so their traffic would be invisible to it.
- torch has no 1-bit collective, and none at all on gloo: the 1-bit exchange is two all-to-alls
  of bit-packed signs, built from the controller's primitives.

1-bit (docs: algorithms.md §1.2, Tang et al. 2021, DeepSpeed's NCCL backend). Each rank
compresses (its buffer + its worker error) to one scale and one sign bit per element, keeps the
compression error, and sends chunk j of its signs to rank j (all-to-all). Rank j, acting as the
"server" of chunk j, averages the p decompressed chunks, adds its server error, compresses the
average again (keeping that error too) and sends it to every rank (a second all-to-all with an
all-gather's bytes: one round of messages where gloo's ring all-gather takes p - 1, which a slow,
high-latency link charges for). Every rank then decodes the same bytes
into the same averaged buffer, so the result is bit-identical on all ranks. The distributed
function and the single-process simulation share the compress / server-average / decompress
helpers, so both do the same floating-point operations in the same order.

PowerSGD (docs: algorithms.md §2, Vogels et al. 2019). Each gradient matrix M (error feedback
added) is approximated by a rank-r product P Qᵀ found with one warm-started power-iteration step;
only P (n x r) and Q (m x r) are all-reduced. Vectors and matrices too small to gain are
all-reduced uncompressed, batched into one flat buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from mcpar.controllers.communication import CommHandle, CommunicationController

ONEBIT_CODEC = "1bit"
POWERSGD_CODEC = "powersgd"

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
                                server_error: torch.Tensor, comm: CommunicationController,
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


def onebit_compressed_allreduce_many(jobs: list[OneBitJob], comm: CommunicationController,
                                     axis: str = "dp") -> list[torch.Tensor]:
    """Several independent 1-bit exchanges, pipelined: each job's result is exactly what
    :func:`onebit_compressed_allreduce` would return for it alone.

    Why: one exchange is a chain compress -> all-to-all -> server average -> all-to-all ->
    decode in which the link idles while a rank computes and the rank idles while bytes cross
    a slow link. Here job k+1 is compressed while job k's signs are on the wire, and job k is
    served while job k+1's are: the all-to-alls are started in the background (same order on
    every rank: every job's first phase, then every job's second, as each becomes ready).
    """
    world = comm.axis_size(axis)
    flights = [_start_exchange(job, world, comm, axis) for job in jobs]
    for flight in flights:
        _serve_exchange(flight, comm, axis)
    return [_finish_exchange(flight) for flight in flights]


@dataclass
class _InFlight:
    """One exchange between its stages: what it sent and where its replies land."""

    job: OneBitJob
    chunk_bytes: int
    outgoing: torch.Tensor  # kept alive until its all-to-all is done
    received: torch.Tensor
    handle: CommHandle
    gathered: torch.Tensor | None = None


def _start_exchange(job: OneBitJob, world: int, comm: CommunicationController,
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


def _serve_exchange(flight: _InFlight, comm: CommunicationController, axis: str) -> None:
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


# --- PowerSGD ------------------------------------------------------------------------------------

@dataclass
class _MatrixState:
    """PowerSGD state of one compressed gradient: its matrix view, error and warm-started Q."""

    shape: torch.Size
    rows: int
    cols: int
    rank: int
    error: torch.Tensor  # rows x cols, float32, this rank's error feedback
    q: torch.Tensor  # cols x rank, float32, identical on every rank


def _orthogonalize(matrix: torch.Tensor, passes: int = 2) -> None:
    """Gram-Schmidt on the columns of ``matrix`` in place, run twice.

    Plain torch ops (not a LAPACK QR) so that identical inputs give identical outputs on every
    rank. A zero column stays zero instead of becoming NaN (a gradient can be all zero). The
    second pass ("twice is enough") restores orthogonality that one fp32 pass loses when the
    columns are nearly parallel, the usual case for gradients dominated by a few directions;
    without it P Pᵀ is no projection and the approximation error grows (measured: 2.5e-5
    instead of 2.4e-6 on a rank-1-plus-noise 32 x 3 matrix at rank 3). Costs r more column
    operations on an n x r matrix.
    """
    for _ in range(passes):
        for i in range(matrix.shape[1]):
            col = matrix[:, i:i + 1]
            norm = torch.linalg.vector_norm(col)
            col.div_(torch.where(norm > 0, norm, torch.ones_like(norm)))
            if i + 1 < matrix.shape[1]:
                rest = matrix[:, i + 1:]
                rest.sub_(col * (col * rest).sum(dim=0, keepdim=True))


@dataclass
class _GroupState:
    """PowerSGD state of one list of gradients (one key: the whole model, or one bucket)."""

    iteration: int = 0
    shapes: list[torch.Size] | None = None
    # Per gradient index: its matrix state, or None when it is sent uncompressed.
    matrices: list[_MatrixState | None] | None = None
    # Saved matrices waiting for the first compressed step to learn the shapes.
    pending: dict[int, dict[str, torch.Tensor]] | None = None


class PowerSGDCompressor:
    """Averages gradients over a mesh axis with rank-r PowerSGD compression and error feedback.

    ``reduce(grads, comm, axis, key)`` replaces every gradient in place by the (approximate)
    average over the axis; the result is identical on every rank. Call it once per optimizer
    step for each ``key``, with the same list of gradients (same order and shapes) each time: a
    caller that reduces bucket by bucket passes the bucket index as ``key``, and each key keeps
    its own state and step count.

    - Steps before ``start_iter`` (counting from 0): plain all-reduce average of everything.
    - Afterwards a gradient of shape (n, ...) is viewed as an n x m matrix (m = the rest) and
      compressed when it has >= 2 dimensions and (n + m) * r * min_compression_rate < n * m,
      with r = min(rank, n, m); min_compression_rate 0 compresses every matrix. The others are
      all-reduced uncompressed, flattened into one buffer.
    - Compressed: M = G + e; P = M Q; all-reduce P (mean); orthogonalize P; Q = Mᵀ P;
      all-reduce Q (mean); G <- P Qᵀ; e <- M - P Qᵀ (this rank's M: e also holds the rank's
      deviation from the average, as in torch's hook and the paper's code). All P's travel in
      one all-reduce and all Q's in another (codec "powersgd"): r (n + m) elements per matrix
      instead of n m.
    - Q starts from a normal draw of a generator seeded with ``seed``, the key and the
      gradient's index, so it is the same on every rank, and is warm-started from the previous
      step.
    """

    def __init__(self, rank: int = 2, *, start_iter: int, min_compression_rate: float = 2.0,
                 seed: int = 0):
        if rank < 1:
            raise ValueError(f"PowerSGD rank must be >= 1, got {rank}")
        if start_iter < 0:
            raise ValueError(f"start_iter must be >= 0, got {start_iter}")
        if min_compression_rate < 0:
            raise ValueError(f"min_compression_rate must be >= 0, got {min_compression_rate}")
        self.rank = rank
        self.start_iter = start_iter
        self.min_compression_rate = min_compression_rate
        self.seed = seed
        self._groups: dict[int, _GroupState] = {}

    def iteration(self, key: int = 0) -> int:
        """Steps reduced so far under ``key``."""
        group = self._groups.get(key)
        return group.iteration if group else 0

    # --- plan ---------------------------------------------------------------------------------
    def _matrix_shape(self, grad: torch.Tensor) -> tuple[int, int, int] | None:
        """(n, m, r) when ``grad`` is worth compressing, else None."""
        if grad.dim() < 2:
            return None
        rows = grad.shape[0]
        cols = grad.numel() // rows
        rank = min(self.rank, rows, cols)
        if (rows + cols) * rank * self.min_compression_rate >= rows * cols:
            return None
        return rows, cols, rank

    def _plan(self, group: _GroupState, key: int,
              grads: list[torch.Tensor]) -> list[_MatrixState | None]:
        shapes = [g.shape for g in grads]
        if group.shapes is None:
            group.shapes = shapes
        elif shapes != group.shapes:
            raise ValueError(f"PowerSGD (key {key}) was given a different list of gradients "
                             "than before")
        if group.matrices is not None:
            return group.matrices
        matrices: list[_MatrixState | None] = []
        for index, grad in enumerate(grads):
            dims = self._matrix_shape(grad)
            if dims is None:
                matrices.append(None)
                continue
            rows, cols, rank = dims
            # Integers only: str hashing is salted per process and would give each rank its own Q.
            gen = torch.Generator().manual_seed(
                ((self.seed * 1_000_003 + key) * 1_000_003 + index) % 2**63)
            q = torch.randn(cols, rank, generator=gen, dtype=torch.float32).to(grad.device)
            error = torch.zeros(rows, cols, dtype=torch.float32, device=grad.device)
            matrices.append(_MatrixState(grad.shape, rows, cols, rank, error, q))
        if group.pending is not None:
            compressed = {i for i, m in enumerate(matrices) if m is not None}
            if set(group.pending) != compressed:
                raise ValueError(f"the saved PowerSGD state of key {key} belongs to a different "
                                 "set of gradients")
            for i, saved in group.pending.items():
                state = matrices[i]
                assert state is not None
                if saved["error"].shape != state.error.shape or saved["q"].shape != state.q.shape:
                    raise ValueError(f"saved PowerSGD state of key {key}, gradient {i}, has "
                                     "another shape")
                state.error.copy_(saved["error"])
                state.q.copy_(saved["q"])
            group.pending = None
        group.matrices = matrices
        return matrices

    # --- reduce -------------------------------------------------------------------------------
    @staticmethod
    def _average_flat(tensors: list[torch.Tensor], comm: CommunicationController, axis: str,
                      codec: str) -> list[torch.Tensor]:
        """Sum the tensors over the axis in one flat all-reduce and divide by its size."""
        if not tensors:
            return []
        flat = torch.cat([t.reshape(-1).to(torch.float32) for t in tensors])
        comm.all_reduce(flat, axis=axis, codec=codec)
        flat.div_(comm.axis_size(axis))
        return [part.view(t.shape) for part, t in
                zip(flat.split([t.numel() for t in tensors]), tensors, strict=True)]

    @torch.no_grad()
    def reduce(self, grads: list[torch.Tensor], comm: CommunicationController,
               axis: str = "dp", key: int = 0) -> None:
        """Replace each gradient in place by its (compressed) average over ``axis``.

        A collective: every rank of the axis calls it with the same keys in the same order.
        """
        if not grads:
            return
        group = self._groups.setdefault(key, _GroupState())
        if group.iteration < self.start_iter:
            for grad, avg in zip(grads, self._average_flat(grads, comm, axis, "none"),
                                 strict=True):
                grad.copy_(avg)
            group.iteration += 1
            return

        states = self._plan(group, key, grads)
        plain = [g for g, s in zip(grads, states, strict=True) if s is None]
        for grad, avg in zip(plain, self._average_flat(plain, comm, axis, "none"), strict=True):
            grad.copy_(avg)

        compressed = [(g, s) for g, s in zip(grads, states, strict=True) if s is not None]
        if compressed:
            matrices = [g.reshape(s.rows, s.cols).to(torch.float32) + s.error
                        for g, s in compressed]
            ps = [m @ s.q for m, (_, s) in zip(matrices, compressed, strict=True)]
            ps = self._average_flat(ps, comm, axis, POWERSGD_CODEC)
            for p in ps:
                _orthogonalize(p)
            qs = [m.t() @ p for m, p in zip(matrices, ps, strict=True)]
            qs = self._average_flat(qs, comm, axis, POWERSGD_CODEC)
            for m, p, q, (grad, state) in zip(matrices, ps, qs, compressed, strict=True):
                approx = p @ q.t()
                torch.sub(m, approx, out=state.error)
                state.q.copy_(q)
                grad.copy_(approx.view(state.shape))
        group.iteration += 1

    # --- inspection and checkpoints --------------------------------------------------------
    def compressed_indices(self, key: int = 0) -> list[int]:
        """Indices of the gradients of ``key`` that are compressed (known after its first
        compressed step)."""
        group = self._groups.get(key)
        return [i for i, m in enumerate((group and group.matrices) or []) if m is not None]

    def error_buffer(self, index: int, key: int = 0) -> torch.Tensor:
        """This rank's error-feedback matrix of gradient ``index`` of ``key`` (rows x cols)."""
        group = self._groups.get(key)
        matrices = (group and group.matrices) or []
        if index >= len(matrices) or matrices[index] is None:
            raise KeyError(f"gradient {index} of key {key} is not compressed")
        return matrices[index].error  # type: ignore[union-attr]

    def state_dict(self) -> dict[int, dict[str, object]]:
        """Per key: step count, and per compressed gradient its error and Q (references to the
        live tensors; the errors differ per rank)."""
        out: dict[int, dict[str, object]] = {}
        for key, group in self._groups.items():
            if group.matrices is not None:
                matrices = {i: {"error": m.error, "q": m.q}
                            for i, m in enumerate(group.matrices) if m is not None}
            else:
                matrices = dict(group.pending or {})
            out[key] = {"iteration": group.iteration, "matrices": matrices}
        return out

    def load_state_dict(self, state: dict[int, dict[str, object]]) -> None:
        """Restore from :meth:`state_dict`. The matrices are checked against the gradients and
        copied in at the key's next compressed step (their shapes are known only then)."""
        self._groups = {}
        for key, saved in state.items():
            matrices: dict[int, dict[str, torch.Tensor]] = saved["matrices"]  # type: ignore[assignment]
            self._groups[int(key)] = _GroupState(
                iteration=int(saved["iteration"]),  # type: ignore[arg-type]
                pending={int(i): {k: t.clone() for k, t in m.items()}
                         for i, m in matrices.items()} or None,
            )
