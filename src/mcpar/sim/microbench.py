"""The micro-benchmarks both profiles time a machine with: ``localprofile`` (the CPU, gloo)
and ``deviceprofile`` (a CUDA device, NCCL). One definition of each, the device explicit: the
sustained time of a call, causal attention's rate, the tiny block whose cost is a layer's fixed
overhead, mcpar's ring-attention blocks, and the collectives' ``t = alpha + n beta`` lines
between two workers. What sharing cores costs CPU workers: ``shared_cores_bench``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from mcpar.launch.env import find_free_port

if TYPE_CHECKING:
    import torch


def sustained_time(fn: Callable[[], object], device: torch.device, seconds: float) -> float:
    """Mean seconds per call over at least ``seconds`` of back-to-back calls (a training step
    runs for seconds, not for the millisecond in which a core may run faster), the device's
    queue drained before and after (a device's kernels return once queued)."""
    from mcpar.device import synchronize

    fn()
    synchronize(device)
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        if calls % 8 == 0 or device.type == "cpu":
            synchronize(device)
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                return elapsed / calls


def attention_rate(device: torch.device, dtype: torch.dtype,
                   shape: tuple[int, int, int, int], seconds: float) -> float:
    """Causal attention forward and backward at ``shape`` (batch, heads, sequence, head
    dimension), in the cost model's FLOPs (2 T s h over the causal half forward, 2.5 times that
    backward)."""
    import torch
    import torch.nn.functional as F

    b, heads, s, dh = shape
    q, k, v = (torch.randn(b, heads, s, dh, device=device, dtype=dtype, requires_grad=True)
               for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    return 2 * (b * s) * s * (heads * dh) * 3.5 / sustained_time(step, device, seconds)


def tiny_block(device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one tiny op's forward and backward, one tiny transformer block's forward and backward
    with a final sum): their arithmetic is negligible, so their time is the fixed cost of
    dispatch, autograd and launches; the block's minus the op's is a layer's."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, heads = 16, 2
    x = torch.randn(1, 8, h, device=device, requires_grad=True)
    ln1, ln2, qkv, proj, fc, out = nn.ModuleList([
        nn.LayerNorm(h), nn.LayerNorm(h), nn.Linear(h, 3 * h), nn.Linear(h, h),
        nn.Linear(h, 4 * h), nn.Linear(4 * h, h)]).to(device)

    def one_op() -> None:
        (x * 2).sum().backward()

    def block() -> None:
        q, k, v = (t.view(1, 8, heads, -1).transpose(1, 2) for t in qkv(ln1(x)).chunk(3, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = x + proj(a.transpose(1, 2).reshape(1, 8, h))
        (z + out(F.gelu(fc(ln2(z))))).sum().backward()

    return one_op, block




def training_block_step(device: torch.device) -> Callable[[], None]:
    """Forward and backward of two GPT blocks at a small model's shapes (hidden 256, 4 heads, 4
    sequences of 128 tokens): the mix of GEMMs, attention, element-wise work and eager dispatch
    a training step runs, in about 30 ms of one core."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    h, heads, b, t = 256, 4, 4, 128
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(b, t, h, generator=gen).to(device).requires_grad_()
    blocks = [nn.ModuleList([nn.LayerNorm(h), nn.LayerNorm(h), nn.Linear(h, 3 * h),
                             nn.Linear(h, h), nn.Linear(h, 4 * h), nn.Linear(4 * h, h)]).to(device)
              for _ in range(2)]

    def step() -> None:
        z = x
        for ln1, ln2, qkv, proj, fc, out in blocks:
            q, k, v = (u.view(b, t, heads, -1).transpose(1, 2)
                       for u in qkv(ln1(z)).chunk(3, dim=2))
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            z = z + proj(a.transpose(1, 2).reshape(b, t, h))
            z = z + out(F.gelu(fc(ln2(z))))
        z.sum().backward()

    return step


# The ring blocks' shapes timed, (batch, heads, local tokens 2c, head dimension), at 2 ranks: tiny
# ones, whose arithmetic is negligible, at 2 and 4 ranks give the fixed cost of a call and of
# each further step; one size at two head dimensions gives the cost per score and its growth
# with the head dimension (a CPU's ring at a small GPT's context shards).
RING_TINY = (1, 2, 4, 8)
RING_SIZED = (4, 4, 128)
RING_NOTE = "ring_"  # the profile's notes: RING_NOTE + each field of ``hardware.RingBlockCost``


def ring_block_notes(device: torch.device, seconds: float) -> dict[str, float]:
    """One rank's ring-attention blocks timed, forward and backward (``mcpar.ring_blocks`` with
    a ``LocalRing``: the training code's kernels without the transfers, which the collectives'
    lines price), as the fields of ``hardware.RingBlockCost`` under ``RING_NOTE``."""
    import torch

    from mcpar.ring_blocks import LocalRing, ring_blocks
    from mcpar.ring_geometry import score_elements
    from mcpar.sim.hardware import RING_HEAD_DIMS

    def timed(shape: tuple[int, int, int, int], ranks: int) -> tuple[float, float]:
        b, heads, tokens, dh = shape
        q, k, v = (torch.randn(b, heads, tokens, dh, device=device, requires_grad=True)
                   for _ in range(3))
        ring = LocalRing(1, ranks)  # rank 1 meets the own block and ranks - 1 dense ones
        fwd = sustained_time(lambda: ring_blocks(q, k, v, ring), device, seconds)
        both = sustained_time(lambda: ring_blocks(q, k, v, ring).sum().backward(), device,
                              seconds)
        return fwd, max(0.0, both - fwd)

    tiny = {n: timed(RING_TINY, n) for n in (2, 4)}
    step = [max(0.0, (tiny[4][i] - tiny[2][i]) / 2) for i in (0, 1)]
    call = [max(0.0, tiny[2][i] - step[i]) for i in (0, 1)]
    b, heads, tokens = RING_SIZED
    scores = score_elements(b * heads, tokens, 2)
    per = {dh: [max(0.0, t - call[i] - step[i]) / scores
                for i, t in enumerate(timed((b, heads, tokens, dh), 2))]
           for dh in RING_HEAD_DIMS}
    low, high = RING_HEAD_DIMS
    notes: dict[str, float] = {}
    for i, pass_ in enumerate(("fwd", "bwd")):
        notes.update({f"{pass_}_call_s": call[i], f"{pass_}_step_s": step[i],
                      f"{pass_}_per_score_low_s": per[low][i],
                      f"{pass_}_per_score_high_s": per[high][i]})
    return {RING_NOTE + key: value for key, value in notes.items()}

COLLECTIVE_SIZES = [16384, 262144, 2**20, 4 * 2**20]


def profiled_reduce_scatter(out: torch.Tensor, full: torch.Tensor, backend: str) -> None:
    """A two-rank reduce-scatter as the Communicator runs it, so that the profile prices the
    runtime's: on gloo ``all_to_all_reduce_scatter``, else the backend's own."""
    import torch.distributed as dist

    from mcpar import all_to_all_reduce_scatter as by_all_to_all

    if backend == "gloo":
        by_all_to_all.all_to_all_reduce_scatter(out, full, 2)[1]()
    else:
        dist.reduce_scatter_single(out, full)


def _collective_worker(rank: int, port: int, queue: object, backend: str = "gloo",
                       device_type: str = "cpu", sizes: tuple[int, ...] | None = None) -> None:
    """Prices the backend's all-reduce, all-gather, reduce-scatter and a send/recv pair between
    two processes (one thread or one device each) as training meets them: each call follows a
    burst of compute, so the ranks arrive a little apart and the data is cold. The cost of an
    operation is the time of (burst + operation) loops minus that of burst-only loops; rank 0
    reports it. ``backend`` gloo on the CPU (``localprofile``), or NCCL between two CUDA devices
    (``deviceprofile``)."""
    import datetime

    import torch
    import torch.distributed as dist

    from mcpar.device import synchronize

    torch.set_num_threads(1)
    device = torch.device(device_type, rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2,
                            init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    a, b = torch.randn(512, 256, device=device), torch.randn(256, 512, device=device)

    def burst() -> None:
        for _ in range(3):  # about the compute between two tensor-parallel collectives
            a @ b

    def p2p(buf: torch.Tensor) -> None:
        # One transfer each way; counted as two sends.
        if rank == 0:
            dist.send(buf, 1)
            dist.recv(buf, 1)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)

    def loop(fn: Callable[[], object] | None, iters: int) -> float:
        dist.barrier()
        synchronize(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            burst()
            if fn is not None:
                fn()
        synchronize(device)  # a device's collectives return once queued: time them done
        return time.perf_counter() - t0

    results: dict[str, list[tuple[int, float]]] = {op: [] for op in ("ar", "ag", "rs", "p2p")}
    for n in sizes or COLLECTIVE_SIZES:
        full, half = torch.zeros(n // 4, device=device), torch.zeros(n // 8, device=device)
        ops = {"ar": lambda full=full: dist.all_reduce(full),
               "ag": lambda full=full, half=half: dist.all_gather_single(full, half),
               "rs": lambda full=full, half=half: profiled_reduce_scatter(half, full, backend),
               "p2p": lambda full=full: p2p(full)}
        for op, fn in ops.items():
            fn()
            iters = 12 if n <= 2**20 else 6
            costs = []
            for _ in range(3):
                bare = loop(None, iters)
                costs.append((loop(fn, iters) - bare) / iters)
            per_call = max(statistics.median(costs), 1e-6) / (2 if op == "p2p" else 1)
            results[op].append((n, per_call))
    hidden = (_gather_overlap(burst, loop, device, (sizes or COLLECTIVE_SIZES)[-1])
              if device_type == "cpu" else None)
    if rank == 0:
        queue.put((results, hidden))  # type: ignore[attr-defined]
    dist.destroy_process_group()


def _gather_overlap(burst: Callable[[], None], loop: Callable[[Callable[[], object] | None, int],
                                                              float],
                    device: object, nbytes: int, repeats: int = 5) -> float:
    """The share of an all-gather launched before a stretch of compute that hides behind it,
    as the parameter store's prefetch launches the next block's (``(serial - overlapped) /
    (serial - compute alone)``, the median of ``repeats``, in [0, 1]). On a CPU the backend
    moves an all-gather's bytes in its own threads without the cores' arithmetic; a reduction
    needs them, and ``Efficiency.overlap`` (0 on a CPU) stands for those."""
    import torch
    import torch.distributed as dist

    full = torch.zeros(nbytes // 4, device=device)  # type: ignore[arg-type]
    half = torch.zeros(nbytes // 8, device=device)  # type: ignore[arg-type]

    def compute() -> None:
        for _ in range(8):  # a few times the gather: a block's forward beside its prefetch
            burst()

    def serial() -> None:
        compute()
        dist.all_gather_single(full, half)

    def overlapped() -> None:
        work = dist.all_gather_single(full, half, async_op=True)
        compute()
        work.wait()

    shares = []
    for _ in range(repeats):
        alone, one_after, beside = loop(compute, 2), loop(serial, 2), loop(overlapped, 2)
        shares.append((one_after - beside) / max(one_after - alone, 1e-9))
    return min(1.0, max(0.0, statistics.median(shares)))


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of time against bytes, both kept non-negative."""
    xs, ts = [float(n) for n, _ in points], [t for _, t in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-12)
    return max(mt - slope * mx, 1e-6), slope


def collective_costs(backend: str = "gloo", device_type: str = "cpu",
                     sizes: tuple[int, ...] | None = None
                     ) -> tuple[dict[str, tuple[float, float]], float | None]:
    """Per operation: (alpha, beta) of t = alpha + n beta between two ranks (n: the full buffer,
    or the message for p2p), over ``backend`` between two ``device_type`` workers; and, on the
    CPU, the share of a prefetched all-gather that hides behind compute (``_gather_overlap``;
    None on a device, where that burst of compute is too short to hide anything)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = find_free_port()
    procs = [ctx.Process(target=_collective_worker,
                         args=(r, port, queue, backend, device_type, sizes)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(180)
    if queue.empty():
        raise RuntimeError(f"the {backend} collective micro-benchmark did not report")
    results, hidden = queue.get()
    return {op: _line(points) for op, points in results.items()}, hidden
