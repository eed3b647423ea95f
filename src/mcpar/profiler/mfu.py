"""Model FLOPs utilisation: what share of the hardware's peak the model's arithmetic uses.

MFU = flops_per_token x tokens_per_s / (peak_flops_per_device x devices).

``flops_per_token`` is the model spec's (``models/spec.py``): 6 x the matmul weights (forward 2,
backward 4 per multiply-add) plus the attention scores and values, 12 x layers x hidden x
seq_len, over the full square (no causal discount); the embedding lookup is not a matmul and is
not counted, the output projection is. Recomputation is not counted (that would be HFU), so
turning activation recompute on lowers MFU for the same model, as it should.

Peaks: on CUDA, the datasheet's dense figure from the cost model's hardware table (bf16 for
``training.dtype: bfloat16``; float32 runs as TF32, half of it); on CPU there is no datasheet
that means anything for a shared machine, so the peak is *measured*: the best sustained fp32
matmul rate of this rank's threads, once per run, and every report says so.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch


@dataclass(frozen=True)
class Peak:
    flops_per_device: float
    devices: int
    source: str  # how the figure was obtained, printed next to every MFU

    @property
    def total(self) -> float:
        return self.flops_per_device * self.devices

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "total": self.total}


def measured_matmul_flops(seconds: float = 0.25, size: int = 512) -> float:
    """The best fp32 matmul rate this process's threads sustain (FLOP/s): square matmuls of
    ``size``, repeated for about ``seconds``; the fastest batch of ten counts."""
    # A generator of its own: the run's RNG stream (dropout, data order, checkpoints' rng/)
    # must not depend on whether the peak was measured.
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(size, size, generator=gen), torch.randn(size, size, generator=gen)
    a @ b  # warm-up: the first call allocates and picks a kernel
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        for _ in range(10):
            a @ b
        best = min(best, (time.perf_counter() - t0) / 10)
    return 2.0 * size**3 / best


def datasheet_peak(device_name: str, dtype: str) -> tuple[float, str] | None:
    """The hardware table's dense peak of a CUDA device (FLOP/s) and its row, or None."""
    from mcpar.sim.hardware import GPU_ALIASES, load_accelerators

    table = load_accelerators()
    lowered = device_name.lower()
    for alias, row in sorted(GPU_ALIASES.items(), key=lambda kv: -len(kv[0])):
        if alias in lowered and row.lower() in table:
            accel = table[row.lower()]
            precision = "bf16" if dtype == "bfloat16" else "fp32"
            return accel.peak_flops[precision], f"{accel.name} datasheet {precision}"
    return None


def device_peak(device: torch.device, dtype: str, devices: int) -> Peak:
    """The peak MFU is measured against, for ``devices`` devices like this one."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        found = datasheet_peak(name, dtype)
        if found is not None:
            return Peak(found[0], devices, f"{found[1]} dense peak ({name})")
        # A GPU the table lacks: measured like a CPU, and said so.
        return Peak(_measured_cuda(device), devices, f"measured matmul peak ({name}, not in "
                    "the hardware table)")
    threads = torch.get_num_threads()
    return Peak(measured_matmul_flops(), devices,
                f"measured fp32 matmul peak on CPU ({threads} thread(s) per rank), not a "
                "datasheet")


def _measured_cuda(device: torch.device, size: int = 4096) -> float:
    gen = torch.Generator(device=device).manual_seed(0)  # leaves the run's RNG stream alone
    a = torch.randn(size, size, device=device, dtype=torch.bfloat16, generator=gen)
    (a @ a).sum().item()
    start = time.perf_counter()
    for _ in range(20):
        a @ a
    torch.cuda.synchronize(device)
    return 20 * 2.0 * size**3 / (time.perf_counter() - start)


def mfu(flops_per_token: float, tokens_per_s: float, peak: Peak) -> float:
    return flops_per_token * tokens_per_s / peak.total if peak.total > 0 else 0.0
