"""Which device a job runs on (``training.device``), decided without importing torch where the
answer is certain without it, so that ``mcpar check`` plans a job without torch.

``auto`` takes CUDA exactly when ``torch.cuda.is_available()`` says so. Torch is asked only when
CUDA is possible here: a CPU-only torch build (its version ends in ``+cpu``), or a machine whose
CUDA driver library (``libcuda.so.1``, which torch's CUDA runtime loads to count devices) does
not load and which has no ROCm device (``/dev/kfd``, where a ROCm build of torch reports its
GPUs as CUDA), has no CUDA device for torch either. ``mcpar.device`` re-exports these.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.metadata
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcpar.errors import UserError, problem

if TYPE_CHECKING:
    import torch


@functools.cache
def cuda_ruled_out() -> bool:
    """True when no CUDA device can be visible to torch here, found without importing it."""
    try:
        if importlib.metadata.version("torch").endswith("+cpu"):
            return True
    except importlib.metadata.PackageNotFoundError:
        pass
    if os.path.exists("/dev/kfd"):
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return True
    return False


def cuda_available() -> bool:
    """``torch.cuda.is_available()``, importing torch only when the answer is not certain."""
    if cuda_ruled_out():
        return False
    import torch

    return torch.cuda.is_available()


def cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" | "cuda"
    # Process-group backend: "gloo" on CPU; on CUDA, NCCL for device tensors and gloo for the
    # small host tensors of bookkeeping collectives (step statistics, norms, routing counts).
    backend: str
    reason: str  # why this device, for the log

    def torch_device(self, local_rank: int) -> torch.device:
        import torch

        if self.type == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")


def select_device(requested: str) -> DeviceInfo:
    has_cuda = cuda_available()
    if requested == "cuda" and not has_cuda:
        raise UserError(problem(
            "training.device", "'cuda' was asked for but no CUDA device is visible; use cpu or auto"
        ))
    if requested == "cuda" or (requested == "auto" and has_cuda):
        why = "asked for" if requested == "cuda" else "auto: CUDA is available"
        # MCPAR_DIST_BACKEND=gloo: several ranks on one GPU (bench/gpu_check.py), which NCCL
        # refuses; gloo carries CUDA tensors through host memory.
        backend = os.environ.get("MCPAR_DIST_BACKEND") or "cpu:gloo,cuda:nccl"
        return DeviceInfo("cuda", backend, f"cuda ({cuda_device_count()} visible, {why})")
    why = "asked for" if requested == "cpu" else "auto: no CUDA device visible"
    return DeviceInfo("cpu", "gloo", f"cpu ({why})")


def memory_budget_bytes(device: torch.device, local_world_size: int) -> float:
    """Memory one worker may plan to use: 90% of its GPU, or its share of 80% of host RAM."""
    if device.type == "cuda":
        import torch

        return 0.9 * torch.cuda.get_device_properties(device).total_memory
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return 0.8 * host / max(1, local_world_size)
