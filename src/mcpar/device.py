"""Everything that differs between CPU and CUDA, in one place.

The device is explicit: ``training.device: cpu|cuda``, or ``auto``, which takes CUDA only when
``torch.cuda.is_available()`` says so and logs what it chose; asking for ``cuda`` on a machine
without it is a user error, never a silent fallback to CPU. That choice (``select_device``,
``DeviceInfo``, ``memory_budget_bytes``) lives in ``device_select.py``, which imports torch only
where CUDA is possible, so that ``mcpar check`` plans without torch; it is re-exported here.

What the devices' kernels keep for the backward pass where they differ (attention under
dropout, dropout masks), which the memory model prices without torch: ``device_kernels.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import resource
import sys
from collections.abc import Iterator

import torch

from mcpar.device_select import DeviceInfo, memory_budget_bytes, select_device

__all__ = ["DeviceInfo", "memory_budget_bytes", "select_device"]


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
        keep_freed_host_memory()
    return device


# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 << 20  # glibc's ceiling for M_MMAP_THRESHOLD on 64-bit


def keep_freed_host_memory() -> bool:
    """Have glibc keep freed blocks (up to 32 MiB each) for reuse instead of returning them to
    the operating system after every free.

    Why: torch has no caching allocator for host memory, so by default every multi-MB tensor a
    step allocates (activations, 1-bit Adam's local momentum, compression scratch) is a fresh
    mapping whose pages fault in on first touch, and page faults are dear in virtual machines.
    Measured in a 2-rank training step on a 2-core VM: forming 1-bit Adam's local momentum (0.88M
    elements) took 6.2 ms, 1.9 ms with freed memory kept. CUDA memory has torch's caching
    allocator and needs none of this. The process then holds on to its peak heap, as a caching
    allocator does. Returns whether the C library took the settings (False where it is not
    glibc). Benchmarks call it in their peer processes too, so that both sides compute alike.
    """
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    settings = ((_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX), (_M_TRIM_THRESHOLD, 1 << 30),
                (_M_TOP_PAD, 16 << 20))
    return all(mallopt(option, value) == 1 for option, value in settings)


def release_freed_host_memory() -> None:
    """Return the heap's free pages to the operating system now (glibc's malloc_trim), where
    ``keep_freed_host_memory`` has it keep them: after a one-off phase whose buffers are gone
    (a reshard reads one saved coordinate after another), so that the next one starts from
    what is really held. Nothing where the C library is not glibc."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


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
    return max(int(rss if sys.platform == "darwin" else rss * 1024), _host_peak_floor)


# The process's resident peak from before a ``host_peak_rss`` block reset the kernel's mark.
_host_peak_floor = 0


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class HostPeak:
    """What ``host_peak_rss`` measured: resident bytes at the block's peak above its start
    (None where the kernel's high-water mark cannot be reset: not Linux)."""

    bytes: int | None = None


@contextlib.contextmanager
def host_peak_rss() -> Iterator[HostPeak]:
    """Measure the host memory a block needs at its peak: the kernel's resident high-water mark
    (VmHWM) is reset at the start through /proc/self/clear_refs, read at the end, and the
    resident size at the start subtracted. The process's earlier peak is kept for
    ``peak_memory_bytes``, which the reset would otherwise lower."""
    global _host_peak_floor
    found = HostPeak()
    before, hwm = _status_kib("VmRSS"), _status_kib("VmHWM")
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
    except OSError:
        before = None
    if before is not None and hwm is not None:
        _host_peak_floor = max(_host_peak_floor, hwm * 1024)
    try:
        yield found
    finally:
        peak = _status_kib("VmHWM")
        if before is not None and peak is not None:
            found.bytes = max(0, peak - before) * 1024


def host_empty(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A host tensor; page-locked (``pin``) when it feeds a CUDA device, so that copies to and
    from the device are DMA and can run asynchronously."""
    return torch.empty(numel, dtype=dtype, pin_memory=pin)


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak for ``peak_memory_since_reset`` (CUDA; nothing to reset on CPU)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_since_reset(device: torch.device) -> int:
    """Device memory allocated at its peak since ``reset_peak_memory``; 0 on CPU, whose
    resident set size holds more than tensors (the measurement counts tensors there)."""
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else 0


def rng_state(device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The host's and ``device``'s random generator states (dropout draws from them)."""
    return torch.get_rng_state(), (torch.cuda.get_rng_state(device)
                                   if device.type == "cuda" else None)


def set_rng_state(device: torch.device, state: tuple[torch.Tensor, torch.Tensor | None]) -> None:
    """Put back what ``rng_state`` returned."""
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def synchronize(device: torch.device) -> None:
    """Wait for queued device work, so step timings are true on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# --- What differs between the torch versions mcpar supports (pyproject's range) -------------
# The single-tensor collectives took their ``_single`` names in torch 2.13 (before:
# all_gather_into_tensor, reduce_scatter_tensor, same arguments); mcpar calls the new names, which
# an older torch gets here as aliases of the old functions.
for _new, _old in (("all_gather_single", "all_gather_into_tensor"),
                   ("reduce_scatter_single", "reduce_scatter_tensor")):
    if not hasattr(torch.distributed, _new) and hasattr(torch.distributed, _old):
        setattr(torch.distributed, _new, getattr(torch.distributed, _old))

# torch's grouped matmul: public as F.grouped_mm in recent releases, private (torch._grouped_mm)
# before, CUDA-only (SM >= 80, bfloat16) in older ones; a CPU kernel exists in newer ones.
_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm",
                                                                          None)
_grouped_mm_checked: dict[tuple[str, torch.dtype], str | None] = {}


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows[offsets[i-1]:offsets[i]] @ weights[i]`` for every group i, in one kernel."""
    assert _GROUPED_MM is not None
    return _GROUPED_MM(rows, weights, offs=offsets)


def grouped_mm_unavailable(device_type: str, dtype: torch.dtype) -> str | None:
    """Why the MoE experts do not run as one grouped matmul here; None when they do.

    CUDA: a trial forward and backward at ``dtype`` once per process (older torch or GPUs
    reject some dtypes). CPU: the loop is used, as torch's CPU grouped kernel measured slower
    than a loop of matmuls (0.15 s vs 0.10 s for 8 experts, 4096 x 256 x 1024 rows, 1 thread)."""
    key = (device_type, dtype)
    if key not in _grouped_mm_checked:
        if _GROUPED_MM is None:
            why: str | None = f"torch {torch.__version__} has no grouped matmul"
        elif device_type != "cuda":
            why = f"{device_type}: torch's grouped kernel is not faster than the loop there"
        else:
            try:
                rows = torch.randn(16, 16, device="cuda", dtype=dtype, requires_grad=True)
                w = torch.randn(2, 16, 16, device="cuda", dtype=dtype, requires_grad=True)
                offsets = torch.tensor([8, 16], device="cuda", dtype=torch.int32)
                grouped_mm(rows, w, offsets).sum().backward()
                why = None
            except (RuntimeError, NotImplementedError) as e:
                why = f"cuda {dtype}: {str(e).splitlines()[0][:160]}"
        _grouped_mm_checked[key] = why
    return _grouped_mm_checked[key]


def autocast_dtype(device_type: str) -> torch.dtype | None:
    """The dtype autocast computes matmuls in on this device type now; None outside autocast."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return None


def adamw_options(device: torch.device) -> dict[str, bool]:
    """AdamW's implementation: fused (one kernel for all parameters) on CUDA; on CPU the
    default (foreach), which the tests' bit-exact parities are written against."""
    return {"fused": True} if device.type == "cuda" else {}


def compile_seconds() -> float:
    """Seconds this process has spent compiling with ``torch.compile`` so far (the graph
    capture with its forward compile, and the backward compile run lazily at the first
    backward pass); 0 where this torch keeps no such record."""
    try:
        from torch._dynamo.utils import compilation_time_metrics
    except ImportError:
        return 0.0
    return float(sum(sum(compilation_time_metrics.get(key, ()))
                     for key in ("_compile.compile_inner", "backward._backward_impl")))

