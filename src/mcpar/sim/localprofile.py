"""This machine as a 'cluster': a short calibration micro-benchmark of the CPU and of gloo. What
it measures and how ``--cluster local`` uses it: docs/cost_model.md ("The local profile").

    python -m mcpar.sim.localprofile [--out FILE]    # measure and save

The file, its machine key and checksum, and when a saved profile is used: ``profilestore``.

Beyond the doc: rates are sustained over a few tenths of a second; element-wise throughput is
measured on 4 MiB tensors (cache-resident, as a small model's activations are); the block whose
fixed cost is measured is so small that its arithmetic is negligible; mcpar's ring-attention
blocks are timed on one thread (``microbench.ring_block_notes``: on a CPU they run at neither the
GEMM rate nor the streaming rate, so the cost model prices context parallelism's ring from them);
gloo is timed at 16 KiB to 4 MiB, and a p-rank ring is then priced (p - 1) alpha
+ 2 (p - 1) / p n beta from those lines; what sharing the cores costs the workers' compute and
the ring's exchanges is timed with twice as many one-thread workers as cores
(``shared_cores_bench``).
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
from typing import TYPE_CHECKING

from mcpar.errors import UserError
from mcpar.sim.cpu_load import foreign_share
from mcpar.sim.hardware import (
    CROWDED_EXCHANGE_NOTE,
    GATHER_OVERLAP_NOTE,
    TIME_SLICING_NOTE,
    Accelerator,
    Cluster,
    Efficiency,
    LocalProfile,
    NodeLink,
    RingBlockCost,
    cluster_preset,
    load_accelerators,
)
from mcpar.sim.microbench import (
    RING_NOTE,
    attention_rate,
    collective_costs,
    ring_block_notes,
    sustained_time,
    tiny_block,
)
from mcpar.sim.profilestore import (
    FOREIGN_NOTE,
    lookup_profile,
    profile_path,
    save_profile,
    under_load,
)
from mcpar.sim.profilestore import cores as cores_here
from mcpar.sim.shared_cores_bench import crowded_exchange_cost, time_slicing_penalty

if TYPE_CHECKING:
    import torch


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


def _cpu() -> torch.device:
    import torch

    return torch.device("cpu")


def _sustained_time(fn: Callable[[], object], seconds: float = 0.3) -> float:
    """``microbench.sustained_time`` on the CPU."""
    return sustained_time(fn, _cpu(), seconds)


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

    torch.set_num_threads(1)
    return attention_rate(torch.device("cpu"), torch.float32, (8, heads, 128, dh), 0.3)


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

    torch.set_num_threads(1)
    one_op, block = tiny_block(torch.device("cpu"))
    op = _best_time(one_op, inner=50)
    return op, _best_time(block, inner=20) - op  # the final sum/backward is not the block's


def _ring_blocks() -> dict[str, float]:
    """``microbench.ring_block_notes`` on one CPU thread, as each worker runs them."""
    import torch

    torch.set_num_threads(1)
    return ring_block_notes(_cpu(), 0.2)


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
    ring = _ring_blocks()
    slicing = time_slicing_penalty(n)
    crowded_exchange = crowded_exchange_cost(n)
    # The CPU generator draws a mask in one thread: 2 threads drew 158 M elements/s here
    # against 126-138 for one, so a worker's one thread draws at the one-thread rate (the
    # all-thread rate over the cores, as the products are priced, read half of it).
    masks_1 = _mask_rate(1)
    costs, gather_overlap = collective_costs()
    return LocalProfile(
        cores=n, flops_per_thread=flops_1, attention_flops_per_thread=attn_1,
        mem_bw_per_thread=mem_1, mem_bw_total=mem_all, op_overhead_s=op,
        layer_overhead_s=block, mask_rate_per_thread=masks_1,
        collectives={k: list(v) for k, v in costs.items()},
        notes={"flops_all_cores": flops_all, GATHER_OVERLAP_NOTE: gather_overlap,
               TIME_SLICING_NOTE: slicing, CROWDED_EXCHANGE_NOTE: crowded_exchange,
               **{attention_note(dh): rate for dh, rate in attention.items()}, **ring},
    )


def local_cluster(profile: LocalProfile, ranks_hint: int = 1,
                  nodes: NodeLink | None = None) -> Cluster:
    """The profile as a cluster of one node, or of ``nodes``: its ranks per node and link
    (the profile's collectives then price what stays inside a node); the GPU count is the
    job's worker count."""
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
    # Between nodes, a rank's share of its node's link: the cost model's inter-node figures
    # are per rank (a GPU's own NIC), and a node's ranks that send at once share the one link.
    inter_bw, alpha_inter = ((nodes.bandwidth / nodes.ranks_per_node, nodes.latency_s)
                             if nodes is not None else (1.0 / (2 * ar_beta), ar_alpha / 2))
    return Cluster(accel=accel, num_gpus=ranks_hint,
                   gpus_per_node=nodes.ranks_per_node if nodes is not None else 1 << 20,
                   inter_bw=inter_bw, alpha_intra=ar_alpha / 2,
                   alpha_inter=alpha_inter, efficiency=eff, cores=cores, name="local",
                   op_costs={k: (a, b) for k, (a, b) in profile.collectives.items()},
                   reserved_bytes=0.0, gather_overlap=_note(profile, GATHER_OVERLAP_NOTE),
                   time_slicing_penalty=_note(profile, TIME_SLICING_NOTE) or 0.0,
                   crowded_exchange_s=_note(profile, CROWDED_EXCHANGE_NOTE) or 0.0,
                   attention_head_dims=_head_dim_rates(profile),
                   ring_blocks=ring_block_cost(profile))


def attention_note(head_dim: int) -> str:
    """The profile's note of the attention rate at ``head_dim``."""
    return f"attention_flops_dh{head_dim}"


def _head_dim_rates(profile: LocalProfile) -> dict[int, float]:
    """Each measured head dimension's attention rate over the reference one's."""
    rates = {dh: _note(profile, attention_note(dh)) for dh in ATTENTION_HEAD_DIMS}
    return {dh: rate / profile.attention_flops_per_thread for dh, rate in rates.items()
            if rate is not None and profile.attention_flops_per_thread > 0}


def ring_block_cost(profile: LocalProfile) -> RingBlockCost | None:
    """The profile's timing of the ring-attention blocks, None where an earlier version did not
    measure it (the ring is then priced from the rates, as on an accelerator)."""
    values = {f.name: _note(profile, RING_NOTE + f.name)
              for f in dataclasses.fields(RingBlockCost)}
    if any(v is None for v in values.values()):
        return None
    return RingBlockCost(**values)  # type: ignore[arg-type]


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
