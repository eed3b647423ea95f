"""Everything that differs between CPU and CUDA, in one place.

The device is explicit: ``training.device: cpu|cuda``, or ``auto``, which takes CUDA only when
``torch.cuda.is_available()`` says so and logs what it chose; asking for ``cuda`` on a machine
without it is a user error, never a silent fallback to CPU.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from dataclasses import dataclass

import torch

from mcpar.errors import UserError, problem


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    # Process-group backend: "gloo" on CPU; on CUDA, NCCL for device tensors and gloo for the
    # small host tensors of bookkeeping collectives (step statistics, norms, routing counts).
    backend: str
    reason: str  # why this device, for the log

    def torch_device(self, local_rank: int) -> torch.device:
        if self.type == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")


def select_device(requested: str) -> DeviceInfo:
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise UserError(problem(
            "training.device", "'cuda' was asked for but no CUDA device is visible; use cpu or auto"
        ))
    if requested == "cuda" or (requested == "auto" and has_cuda):
        why = "asked for" if requested == "cuda" else "auto: CUDA is available"
        return DeviceInfo("cuda", "cpu:gloo,cuda:nccl",
                          f"cuda ({torch.cuda.device_count()} visible, {why})")
    why = "asked for" if requested == "cpu" else "auto: no CUDA device visible"
    return DeviceInfo("cpu", "gloo", f"cpu ({why})")


def available_devices(info: DeviceInfo) -> int:
    """Devices this host offers: GPUs on CUDA, cores on CPU (one worker per core)."""
    if info.type == "cuda":
        return torch.cuda.device_count()
    return os.cpu_count() or 1


def setup_worker(info: DeviceInfo, local_rank: int, local_world_size: int) -> torch.device:
    """Pin the worker to its device; on CPU give it its share of the cores (DESIGN.md §5):
    ``MCPAR_NUM_THREADS`` when set (e.g. emulated nodes sharing one host's cores, where the
    ranks of one "node" are not all the workers on the machine), else cores / local ranks."""
    device = info.torch_device(local_rank)
    if info.type == "cuda":
        torch.cuda.set_device(device)
    else:
        explicit = os.environ.get("MCPAR_NUM_THREADS", "")
        threads = (int(explicit) if explicit.isdigit() and int(explicit) > 0
                   else (os.cpu_count() or 1) // max(1, local_world_size))
        torch.set_num_threads(max(1, threads))
    return device


def autocast(device: torch.device, dtype: str) -> contextlib.AbstractContextManager:
    """Mixed precision for the forward pass: bf16 autocast, or nothing for fp32."""
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def peak_memory_bytes(device: torch.device) -> int:
    """Peak memory of this process: device memory on CUDA, resident set size on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    # ru_maxrss is KiB on Linux and bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(rss if sys.platform == "darwin" else rss * 1024)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so step timings are true on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def memory_budget_bytes(device: torch.device, local_world_size: int) -> float:
    """Memory one worker may plan to use: 90% of its GPU, or its share of 80% of host RAM."""
    if device.type == "cuda":
        return 0.9 * torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0.8 * host / max(1, local_world_size)
