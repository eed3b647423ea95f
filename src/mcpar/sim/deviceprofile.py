"""This machine's accelerator as the cost model sees it, measured on the device itself.

The hardware table (``data/hardware.csv``) gives a GPU's peaks and the efficiencies fitted on
published runs give what kernels reach of them on average; what a job reaches on this card, its
clocks, driver and torch is measured here, the way ``localprofile`` measures a CPU:

- the sustained matrix-multiply rate in the training dtype, in the three layouts training runs
  (forward, input gradient, weight gradient), and in fp32 (``notes['<precision>_flops']``);
- causal ``scaled_dot_product_attention`` forward and backward, counted in the cost model's FLOPs;
- the bandwidth of element-wise kernels (a copy and an add: bytes read and written);
- the fixed cost of one tiny op and of one tiny transformer block, forward and backward (launches
  and dispatch);
- between two of this host's devices, when it has two, the collective backend's (NCCL's)
  all-reduce, all-gather, reduce-scatter and send/recv, as ``t = alpha + n beta`` lines, with the
  same micro-benchmark as gloo's (``microbench.collective_costs``).

The profile is a ``LocalProfile`` with one worker per device (``cores`` 1, the per-thread rates
are the device's), saved and keyed by ``profilestore`` (the key names the accelerator and how many
this host has), and a stale one is measured again, as the CPU's is. ``device_cluster`` turns it
into the cluster ``parallelism.auto`` ranks layouts on and the run's prediction prices: the table
row of the device with the measured rates as its peaks (so the GEMM efficiency is 1 and the
attention's is the measured ratio), the measured collectives inside one node, and the fitted
network and overlap figures, which one host cannot measure.

    python -m mcpar.sim.deviceprofile [--out FILE]    # measure this host's CUDA device and save
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from mcpar.sim.hardware import (
    GPU_ALIASES,
    Accelerator,
    Cluster,
    Efficiency,
    LocalProfile,
    load_accelerators,
    make_cluster,
)
from mcpar.sim.microbench import attention_rate, collective_costs, sustained_time, tiny_block
from mcpar.sim.params import GPU_EFFICIENCY
from mcpar.sim.profilestore import lookup_profile, save_profile

if TYPE_CHECKING:
    import torch

# A device the hardware table has no row for is priced as this one.
REFERENCE_GPU = "a100-80gb"
# Sizes on a GPU: large enough that the kernels, not the launches, are timed.
GPU_SHAPES = {"gemm": 8192, "attention": (4, 16, 2048, 128), "stream": 1 << 26}
# The NCCL lines are fitted from 1 MiB to 256 MiB (bandwidth-bound on NVLink from a few MiB).
NCCL_SIZES = (1 << 20, 1 << 24, 1 << 26, 1 << 28)
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def gemm_rate(device: torch.device, dtype: torch.dtype, size: int, seconds: float = 0.2) -> float:
    """FLOP/s of ``size`` cubed matrix products in the forward, input-gradient and
    weight-gradient layouts."""
    import torch

    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    elapsed = sum(sustained_time(fn, device, seconds) for fn in (
        lambda: a @ b, lambda: a @ b.t(), lambda: a.t() @ b))
    return 3 * 2 * size**3 / elapsed


def stream_rate(device: torch.device, elements: int, seconds: float = 0.2) -> float:
    """Bytes/s of element-wise kernels (a copy, an add), counted as read plus written."""
    import torch

    a, b, c = (torch.randn(elements, device=device) for _ in range(3))
    moved = elapsed = 0.0
    for fn, tensors in ((lambda: c.copy_(a), 2), (lambda: torch.add(a, b, out=c), 3)):
        elapsed += sustained_time(fn, device, seconds)
        moved += tensors * 4 * elements
    return moved / elapsed


def fixed_costs(device: torch.device, seconds: float = 0.2) -> tuple[float, float]:
    """(seconds of one tiny op forward and backward, seconds of one tiny transformer block's
    forward and backward beyond that): what launches and dispatch cost, whatever the sizes."""
    one_op, block = tiny_block(device)
    op = sustained_time(one_op, device, seconds)
    return op, max(sustained_time(block, device, seconds) - op, 0.0)


def measure_device(device: torch.device, precision: str = "bf16",
                   shapes: dict[str, object] | None = None, seconds: float = 0.2,
                   collectives: bool = True) -> LocalProfile:
    """This device's profile (``shapes``: the sizes timed, ``GPU_SHAPES`` by default; a test
    passes small ones to run the same code on a CPU). The collectives are measured between
    devices 0 and 1 over NCCL when ``collectives`` and this host has two CUDA devices."""
    import torch

    shapes = {**GPU_SHAPES, **(shapes or {})}
    dtype = getattr(torch, DTYPES[precision])
    flops = gemm_rate(device, dtype, int(shapes["gemm"]), seconds)  # type: ignore[call-overload]
    fp32 = (flops if dtype == torch.float32
            else gemm_rate(device, torch.float32, int(shapes["gemm"]), seconds))  # type: ignore[call-overload]
    attention = attention_rate(device, dtype, shapes["attention"], seconds)  # type: ignore[arg-type]
    stream = stream_rate(device, int(shapes["stream"]), seconds)  # type: ignore[call-overload]
    op, block = fixed_costs(device, seconds)
    links: dict[str, list[float]] = {}
    notes = {f"{precision}_flops": flops, "fp32_flops": fp32}
    if collectives and device.type == "cuda" and torch.cuda.device_count() >= 2:
        lines, _ = collective_costs("nccl", "cuda", NCCL_SIZES)
        links = {k: list(v) for k, v in lines.items()}
    return LocalProfile(cores=1, flops_per_thread=flops, attention_flops_per_thread=attention,
                        mem_bw_per_thread=stream, mem_bw_total=stream, op_overhead_s=op,
                        layer_overhead_s=block, mask_rate_per_thread=0.0, collectives=links,
                        notes=notes)


def table_row(device_name: str, table: dict[str, Accelerator] | None = None
              ) -> tuple[Accelerator, str]:
    """The hardware table's row for a CUDA device (by the aliases its name contains), else the
    reference GPU's; with the words that say which."""
    table = table or load_accelerators()
    lowered = device_name.lower()
    row = next((GPU_ALIASES[a] for a in sorted(GPU_ALIASES, key=len, reverse=True)
                if a in lowered), "").lower()
    if row in table:
        return table[row], f"{table[row].name} of the hardware table ({device_name})"
    accel = table[REFERENCE_GPU]
    return accel, f"{accel.name} of the hardware table ({device_name} has no row; the nearest kept)"


def device_cluster(profile: LocalProfile, accel: Accelerator, world: int) -> Cluster:
    """``world`` devices of ``accel`` (8 per node), at the rates ``profile`` measured: each
    measured GEMM rate (``notes['<precision>_flops']``) is that precision's peak, reached whole;
    attention reaches the measured share of the training dtype's rate; element-wise kernels
    stream at the measured bandwidth; the measured collectives price groups inside one node.
    The network and overlap efficiencies stay the ones fitted on published runs."""
    peaks = dict(accel.peak_flops)
    peaks.update({key.removesuffix("_flops"): float(rate) for key, rate in profile.notes.items()
                  if key.endswith("_flops")})
    measured = dataclasses.replace(accel, peak_flops=peaks, hbm_bw=profile.mem_bw_total,
                                   attention_share=1.0)
    eff = Efficiency(gemm=1.0, attention=profile.attention_flops_per_thread
                     / profile.flops_per_thread, memory=1.0, network=GPU_EFFICIENCY.network,
                     overlap=GPU_EFFICIENCY.overlap, layer_overhead_s=profile.layer_overhead_s)
    per_node = min(8, world)
    cluster = make_cluster(measured, world, per_node, accel.typical_inter_gbps)
    # The lines were measured between two devices of one host: they price one node's groups.
    ops = ({k: (a, b) for k, (a, b) in profile.collectives.items()} if world <= per_node
           else {})
    return dataclasses.replace(cluster, efficiency=eff, op_costs=ops)


def cuda_cluster(world: int) -> tuple[Cluster, str]:
    """What a CUDA job is planned and predicted on: this host's measured device profile when it
    is valid here (``profilestore.lookup_profile``), else the table row at its fitted
    efficiencies; with the words the report and ``mcpar check`` say of it."""
    import torch

    name = torch.cuda.get_device_name(0)
    accel, what = table_row(name)
    found = lookup_profile(device_type="cuda")
    if found.profile is not None:
        return (device_cluster(found.profile, accel, world),
                f"{what}, at the rates measured on it ({found.path}) x {world}")
    return (make_cluster(accel, world, min(8, world), accel.typical_inter_gbps),
            f"{what} x {world} ({found.why}: python -m mcpar.sim.deviceprofile measures it)")


def load_device_profile(remeasure: bool = False, precision: str = "bf16") -> LocalProfile:
    """The saved CUDA device profile when it is this host's, else measured now and saved (with
    a line saying why)."""
    found = lookup_profile(device_type="cuda")
    if found.profile is not None and not remeasure:
        return found.profile
    why = "asked to measure again" if remeasure and found.profile is not None else found.why
    print(f"mcpar: {why}: measuring this host's CUDA device (saved to {found.path})",
          file=sys.stderr, flush=True)
    profile = _measured_apart(precision)
    save_profile(profile, found.path, _cuda_key())
    return profile


def _measured_apart(precision: str) -> LocalProfile:
    """``measure_device`` on device 0 in a process of its own: the launcher that asks must not
    keep a CUDA context (and its cached memory) on the device a worker then trains on."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    proc = ctx.Process(target=_measure_worker, args=(precision, queue))
    proc.start()
    proc.join(600)
    if queue.empty():
        raise RuntimeError(f"the CUDA device measurement did not report (exit {proc.exitcode})")
    return LocalProfile(**queue.get())


def _measure_worker(precision: str, queue: object) -> None:
    import torch

    profile = measure_device(torch.device("cuda", 0), precision)
    queue.put(dataclasses.asdict(profile))  # type: ignore[attr-defined]


def _cuda_key() -> dict[str, str | int]:
    from mcpar.sim.profilestore import BACKENDS, machine_key

    return machine_key("cuda", BACKENDS["cuda"])


def main(argv: list[str] | None = None) -> int:
    import torch

    from mcpar.sim.profilestore import profile_path

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="where to save the profile")
    parser.add_argument("--precision", choices=sorted(DTYPES), default="bf16",
                        help="the training dtype whose matrix-multiply rate is the peak")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("deviceprofile: no CUDA device is visible; the CPU's profile is "
              "python -m mcpar.sim.localprofile", file=sys.stderr)
        return 2
    path = args.out or profile_path("cuda")
    profile = measure_device(torch.device("cuda", 0), args.precision)
    print(json.dumps(save_profile(profile, path, _cuda_key()), indent=2))
    print(f"saved to {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
