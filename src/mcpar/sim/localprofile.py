"""This machine as a 'cluster': a short calibration micro-benchmark of the CPU and of gloo. What
it measures and how ``--cluster local`` uses it: docs/cost_model.md ("The local profile").

    python -m mcpar.sim.localprofile [--out FILE]    # measure and save

The file, its machine key and checksum, and when a saved profile is used: ``profilestore``.

Beyond the doc: rates are sustained over a few tenths of a second; element-wise throughput is
measured on 4 MiB tensors (cache-resident, as a small model's activations are); the block whose
fixed cost is measured is so small that its arithmetic is negligible; gloo is timed at 16 KiB to
4 MiB, and a p-rank ring is then priced (p - 1) alpha + 2 (p - 1) / p n beta from those lines.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mcpar.errors import UserError
from mcpar.sim.cpu_load import foreign_share
from mcpar.sim.hardware import (
    GATHER_OVERLAP_NOTE,
    Accelerator,
    Cluster,
    Efficiency,
    LocalProfile,
    cluster_preset,
    load_accelerators,
)
from mcpar.sim.profilestore import (
    FOREIGN_NOTE,
    lookup_profile,
    profile_path,
    save_profile,
    under_load,
)
from mcpar.sim.profilestore import cores as cores_here


def _best_time(fn: Callable[[], object], repeats: int = 5, inner: int = 3) -> float:
    """Median of `repeats` timings of `inner` calls, per call (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        times.append((time.perf_counter() - t0) / inner)
    return statistics.median(times)


def _sustained_time(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """Mean time per call over at least `seconds` of back-to-back calls: a training step runs
    for seconds, not for the millisecond in which a core may run faster."""
    fn()
    calls, t0 = 0, time.perf_counter()
    while True:
        fn()
        calls += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return elapsed / calls


def _matmul_rate(threads: int) -> float:
    """Sustained fp32 matmul FLOP/s at a small GPT's shapes, in the three layouts training uses
    (forward A B, input gradient A B^T, weight gradient A^T B)."""
    import torch

    torch.set_num_threads(threads)
    flops = elapsed = 0.0
    for m, k, n in ((1024, 256, 768), (1024, 256, 1024), (1024, 1024, 256), (1024, 256, 256)):
        a, b = torch.randn(m, k), torch.randn(k, n)
        g, x = torch.randn(m, n), torch.randn(m, k)
        for fn in (lambda a=a, b=b: a @ b, lambda g=g, b=b: g @ b.t(),
                   lambda x=x, g=g: x.t() @ g):
            elapsed += _sustained_time(fn, 0.1)
            flops += 2 * m * k * n
    return flops / elapsed


# The head dimensions whose attention rate the profile times (hidden 256 split into heads);
# 64 is the reference, ``attention_flops_per_thread``.
ATTENTION_HEAD_DIMS = (16, 32, 64, 128)
REFERENCE_HEAD_DIM = 64


def _attention_rates() -> dict[int, float]:
    """Causal attention forward+backward FLOP/s of one thread at each head dimension of
    ``ATTENTION_HEAD_DIMS`` (8 sequences of 128, heads of the dimension making 256)."""
    return {dh: _attention_rate(256 // dh, dh) for dh in ATTENTION_HEAD_DIMS}


def _attention_rate(heads: int = 4, dh: int = REFERENCE_HEAD_DIM) -> float:
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(1)
    b, s = 8, 128
    q, k, v = (torch.randn(b, heads, s, dh, requires_grad=True) for _ in range(3))

    def step() -> None:
        F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()

    # The cost model's FLOPs: 2 T s h forward over the causal half, backward 2.5 x that.
    flops = 2 * (b * s) * s * (heads * dh) * 3.5
    return flops / _sustained_time(step, 0.3)


def _mask_rate(threads: int) -> float:
    """Elements/s ``threads`` threads draw a dropout mask at (``F.dropout`` in training mode on
    a cache-resident fp32 tensor: the Bernoulli draw, the scale and the multiply)."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    x = torch.randn(1 << 20)
    return x.numel() / _sustained_time(lambda: F.dropout(x, 0.1, training=True), 0.3)


def _stream_rate(threads: int) -> float:
    """Bytes/s of element-wise kernels, counted as the cost model counts them (tensors read and
    written), over the mix a transformer runs: adds, GELU forward and backward, LayerNorm. On a
    CPU the GELU's arithmetic, not memory, bounds it, so a plain copy would be too fast."""
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    n = 1 << 20  # 4 MiB of fp32 per tensor: cache-resident, as a small model's activations are
    a, b, c = torch.randn(n), torch.randn(n), torch.empty(n)
    x = torch.randn(n // 256, 256)
    weight, bias = torch.ones(256), torch.zeros(256)
    kernels = [  # (call, tensors moved)
        (lambda: torch.add(a, b, out=c), 3),
        (lambda: F.gelu(a), 2),
        (lambda: torch.ops.aten.gelu_backward(b, a), 3),
        (lambda: F.layer_norm(x, (256,), weight, bias), 2),
    ]
    moved = elapsed = 0.0
    for fn, tensors in kernels:
        elapsed += _sustained_time(fn, 0.1)
        moved += tensors * 4 * n
    return moved / elapsed


def _block_overhead() -> tuple[float, float]:
    """(seconds per tiny op forward+backward, seconds per tiny block forward+backward)."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    torch.set_num_threads(1)
    h, heads = 16, 2
    x = torch.randn(1, 8, h, requires_grad=True)
    w = torch.randn(8, h, requires_grad=True)

    def one_op() -> None:
        (x * 2).sum().backward()

    ln1, ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
    qkv, proj, fc, out = nn.Linear(h, 3 * h), nn.Linear(h, h), nn.Linear(h, 4 * h), \
        nn.Linear(4 * h, h)

    def block() -> None:
        y = ln1(x)
        q, k, v = (t.view(1, 8, heads, -1).transpose(1, 2) for t in qkv(y).chunk(3, dim=2))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        z = x + proj(a.transpose(1, 2).reshape(1, 8, h))
        z = z + out(F.gelu(fc(ln2(z))))
        z.sum().backward()

    del w
    op = _best_time(one_op, inner=50)
    return op, _best_time(block, inner=20) - op  # the final sum/backward is not the block's


COLLECTIVE_SIZES = [16384, 262144, 2**20, 4 * 2**20]


def _collective_worker(rank: int, port: int, queue: object, backend: str = "gloo",
                       device_type: str = "cpu", sizes: tuple[int, ...] | None = None) -> None:
    """Prices the backend's all-reduce, all-gather, reduce-scatter and a send/recv pair between
    two processes (one thread or one device each) as training meets them: each call follows a
    burst of compute, so the ranks arrive a little apart and the data is cold. The cost of an
    operation is the time of (burst + operation) loops minus that of burst-only loops; rank 0
    reports it. ``backend`` gloo on the CPU, or NCCL between two CUDA devices
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
               "rs": lambda full=full, half=half: dist.reduce_scatter_single(half, full),
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
    hidden = _gather_overlap(burst, loop, device, (sizes or COLLECTIVE_SIZES)[-1])
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


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _line(points: list[tuple[int, float]]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of time against bytes, both kept non-negative."""
    xs, ts = [float(n) for n, _ in points], [t for _, t in points]
    mx, mt = statistics.fmean(xs), statistics.fmean(ts)
    slope = sum((x - mx) * (t - mt) for x, t in zip(xs, ts, strict=True)) / sum(
        (x - mx) ** 2 for x in xs)
    slope = max(slope, 1e-12)
    return max(mt - slope * mx, 1e-6), slope


def _collective_costs(backend: str = "gloo", device_type: str = "cpu",
                      sizes: tuple[int, ...] | None = None
                      ) -> tuple[dict[str, tuple[float, float]], float]:
    """Per operation: (alpha, beta) of t = alpha + n beta between two ranks (n: the full buffer,
    or the message for p2p), over ``backend`` between two ``device_type`` workers; and the share
    of a prefetched all-gather that hides behind compute (``_gather_overlap``)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _free_port()
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


def measure() -> LocalProfile:
    """This machine's profile, with the share of its cores other processes used meanwhile
    (``notes['foreign_cpu_share']``, where it can be read: ``cpu_load``)."""
    profile, share = foreign_share(_measure)
    if share is None:
        return profile
    return dataclasses.replace(profile, notes={**profile.notes, FOREIGN_NOTE: share})


def _measure() -> LocalProfile:
    n = cores_here()
    flops_1 = _matmul_rate(1)
    flops_all = _matmul_rate(n)
    attention = _attention_rates()
    attn_1 = attention[REFERENCE_HEAD_DIM]
    mem_1 = _stream_rate(1)
    mem_all = _stream_rate(n)
    op, block = _block_overhead()
    masks_all = _mask_rate(n)
    costs, gather_overlap = _collective_costs()
    return LocalProfile(
        cores=n, flops_per_thread=flops_1, attention_flops_per_thread=attn_1,
        mem_bw_per_thread=mem_1, mem_bw_total=mem_all, op_overhead_s=op,
        layer_overhead_s=block, mask_rate_per_thread=masks_all / n,
        collectives={k: list(v) for k, v in costs.items()},
        notes={"flops_all_cores": flops_all, GATHER_OVERLAP_NOTE: gather_overlap,
               **{attention_note(dh): rate for dh, rate in attention.items()}},
    )


def local_cluster(profile: LocalProfile, ranks_hint: int = 1) -> Cluster:
    """The profile as a one-node cluster; the GPU count is the job's worker count."""
    cores = profile.cores
    # mcpar's workers keep every core busy together (one thread per core), and cores share
    # caches, memory and, as hyper-threads, execution units: a thread's rate is the all-core
    # rate over the cores, not what one thread reaches alone.
    flops_all = profile.notes.get("flops_all_cores", profile.flops_per_thread * cores)
    ar_alpha, ar_beta = profile.collectives["ar"]
    accel = Accelerator(
        name="local-cpu", peak_flops={"fp32": flops_all / cores},
        hbm_bytes=float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        hbm_bw=profile.mem_bw_total / cores, intra_bw=1.0 / (2 * ar_beta),
        typical_inter_gbps=0.0, is_cpu=True, mem_bw_total=profile.mem_bw_total,
        mask_rate=profile.mask_rate_per_thread,
    )
    eff = Efficiency(gemm=1.0, attention=profile.attention_flops_per_thread
                     / profile.flops_per_thread, memory=1.0, network=1.0, overlap=0.0,
                     layer_overhead_s=profile.layer_overhead_s)
    return Cluster(accel=accel, num_gpus=ranks_hint, gpus_per_node=1 << 20,
                   inter_bw=1.0 / (2 * ar_beta), alpha_intra=ar_alpha / 2,
                   alpha_inter=ar_alpha / 2, efficiency=eff, cores=cores, name="local",
                   op_costs={k: (a, b) for k, (a, b) in profile.collectives.items()},
                   reserved_bytes=0.0, gather_overlap=_note(profile, GATHER_OVERLAP_NOTE),
                   attention_head_dims=_head_dim_rates(profile))


def attention_note(head_dim: int) -> str:
    """The profile's note of the attention rate at ``head_dim``."""
    return f"attention_flops_dh{head_dim}"


def _head_dim_rates(profile: LocalProfile) -> dict[int, float]:
    """Each measured head dimension's attention rate over the reference one's."""
    rates = {dh: _note(profile, attention_note(dh)) for dh in ATTENTION_HEAD_DIMS}
    return {dh: rate / profile.attention_flops_per_thread for dh, rate in rates.items()
            if rate is not None and profile.attention_flops_per_thread > 0}


def _note(profile: LocalProfile, key: str) -> float | None:
    """A measured note of the profile, None where an earlier version did not measure it."""
    value = profile.notes.get(key) if isinstance(profile.notes, dict) else None
    return float(value) if isinstance(value, int | float) else None


def load_local_cluster(path: Path | None = None, remeasure: bool = False) -> Cluster:
    """The saved local profile as a cluster, when it is this machine's (``lookup_profile``);
    measured and saved first when missing or stale, with a line saying why. A profile that is
    this machine's but unsound (a measured rate zero or not finite) is a UserError."""
    found = lookup_profile(path)
    if found.profile is not None and not remeasure:
        return local_cluster(found.profile)
    if found.status == "broken" and not remeasure:
        raise UserError(list(found.problems))
    why = "asked to measure again" if remeasure and found.profile is not None else found.why
    print(f"mcpar: {why}: measuring this machine for the 'local' profile (saved to "
          f"{found.path})", file=sys.stderr, flush=True)
    profile = measure()
    save_profile(profile, found.path)
    loaded = under_load(profile)
    if loaded:
        print(f"mcpar: warning: the local profile was {loaded}: its rates are low by about "
              "that share, and so is every step priced on it; measure it again on a quiet "
              f"machine (python -m mcpar.sim.localprofile --out {found.path})",
              file=sys.stderr, flush=True)
    return local_cluster(profile)


def named_cluster(name: str, table: dict[str, Accelerator] | None = None,
                  key: str = "--cluster") -> Cluster:
    """``local`` (this machine's saved profile, measured first when missing) or a GPU preset
    (``hardware.cluster_preset``)."""
    if name.strip().lower() == "local":
        return load_local_cluster()
    return cluster_preset(name, table or load_accelerators(), key=key)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to save the profile")
    args = parser.parse_args(argv)
    path = args.out or profile_path()
    profile = measure()
    print(json.dumps(save_profile(profile, path), indent=2))
    if under_load(profile):
        print(f"warning: the profile was {under_load(profile)}: measure it again on a quiet "
              "machine", file=sys.stderr)
    print(f"saved to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
