"""Model FLOPs utilisation: what share of the hardware's peak the model's arithmetic uses.

MFU = flops_per_token x tokens_per_s / (peak_flops_per_device x devices).

``flops_per_token`` is the model shape's (``registry/model_shape.py``, ``flops_terms``), per
token, forward 2 FLOPs per multiply-add and backward twice the forward (input and weight
gradients), so 3 x the forward, term by term (h hidden, kv the key/value width, f the MLP
width, s seq_len, V vocab, L layers):

- attention linears: 2 (h (h + 2 kv) + h h) per layer: the QKV and output projections;
- MLP: 2 m h f per layer, m = 2 matrices (3 for SwiGLU/GeGLU), times top_k (+ 1 for a shared
  expert) for MoE, plus the router's 2 h E;
- attention scores and values: 4 s h per layer (q k^T and p v), over the full s x s square,
  no causal discount, as PaLM's and Megatron's formulas and torch's own SDPA flop formula
  count them;
- output head: 2 h V, once (after the last layer);
- not counted: the embedding lookup (a gather, not a matmul), biases, norms, activations,
  softmax, the loss, the optimizer; recomputation (that would be HFU), so activation recompute
  lowers MFU for the same model, as it should.

Checked against ``torch.utils.flop_counter.FlopCounterMode`` over one forward+backward of the
built model (``tests/test_mfu.py``): equal to the FLOP under SDPA's math backend for GPT, Llama
(GQA) and MoE. With the default CPU kernel torch's count is lower by exactly the attention
term (12 L s h per token, 14% of the default GPT's count): the counter has no formula for the
CPU flash kernel (``_scaled_dot_product_flash_attention_for_cpu``) and counts it as zero. On
CUDA its fused-kernel formula counts the backward's recomputed scores too (3.5 x instead of
3 x the attention forward): hardware FLOPs, not model FLOPs.

Peaks: on CUDA, the datasheet's dense figure from the cost model's hardware table (bf16 for
``training.dtype: bfloat16``; float32 runs as TF32, half of it). On CPU no datasheet means
anything for a shared machine, and a rate measured for a fraction of a second at start swings
with the load of the moment, so the peak is a stored figure, the same for every run on this
machine: (1) the calibrated local profile when it is this machine's (``sim/profilestore.py``,
``lookup_profile``, the rule the memory placement follows too: keyed to the CPU model, cores,
torch version and backend, its checksum intact): the better of its one-thread rate and its
all-core rate per core, times the rank's threads; else (2) a figure measured once (training-shaped
fp32 matmuls, median of several windows, every rank measuring at once as they train) and
cached in ``cpu_peak_cache()`` under this machine's key (CPU model, cores, threads per rank,
torch version), which later runs reuse, its source saying why a saved local profile was not
used. The source, with its path and date, goes with every MFU (``Peak.source``: summary.json,
the profile report).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from mcpar.sim.profilestore import ProfileLookup, cores, cpu_model, lookup_profile


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


CACHE_ENV = "MCPAR_PEAK_CACHE"
# Training-shaped fp32 matmuls (m, k, n), as the local profile times them: a small GPT's
# projections at 1024 tokens, in the forward, input-gradient and weight-gradient layouts.
_SHAPES = ((1024, 256, 768), (1024, 256, 1024), (1024, 1024, 256), (1024, 256, 256))


def cpu_peak_cache() -> Path:
    env = os.environ.get(CACHE_ENV)
    return Path(env) if env else Path.home() / ".cache" / "mcpar" / "cpu_peak.json"


def machine_key(threads: int) -> str:
    """What a cached CPU peak is valid for: CPU model, cores, threads per rank, torch version."""
    return (f"{cpu_model()} | {cores()} cores | {threads} thread(s) per rank | "
            f"torch {torch.__version__}")


def measured_matmul_flops(windows: int = 5, seconds: float = 0.3) -> float:
    """The fp32 matmul rate this process's threads sustain (FLOP/s): ``windows`` windows of
    about ``seconds`` each over the training-shaped matmuls, the median window's rate (one
    window caught by another process's burst moves the median little, the best window
    would be the burst-free outlier)."""
    # A generator of its own: the run's RNG stream (dropout, data order, checkpoints' rng/)
    # must not depend on whether the peak was measured.
    gen = torch.Generator().manual_seed(0)
    calls = []
    for m, k, n in _SHAPES:
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
        g, x = torch.randn(m, n, generator=gen), torch.randn(m, k, generator=gen)
        calls += [(lambda a=a, b=b: a @ b), (lambda g=g, b=b: g @ b.t()),
                  (lambda x=x, g=g: x.t() @ g)]
    flops_per_round = sum(3 * 2.0 * m * k * n for m, k, n in _SHAPES)
    for fn in calls:  # warm-up: the first call allocates and picks a kernel
        fn()
    rates = []
    for _ in range(windows):
        rounds, t0 = 0, time.perf_counter()
        while True:
            for fn in calls:
                fn()
            rounds += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= seconds:
                break
        rates.append(rounds * flops_per_round / elapsed)
    return statistics.median(rates)


def calibrated_cpu_peak(threads: int, found: ProfileLookup | None = None,
                        ) -> tuple[float, str] | None:
    """(FLOP/s of a rank with ``threads`` threads, source) from the calibrated local profile
    (``found``, default ``lookup_profile()``), or None without one valid for this machine."""
    found = found or lookup_profile()
    profile = found.profile
    if profile is None:
        return None
    all_cores = profile.notes.get("flops_all_cores", 0.0) / profile.cores
    per_thread = max(profile.flops_per_thread, all_cores)
    return per_thread * threads, (
        f"fp32 matmul rate of the calibrated local profile {found.path} (measured "
        f"{found.measured}): {per_thread / 1e9:.4g} GFLOP/s per thread x {threads} thread(s) per "
        "rank; not a datasheet")


def cached_cpu_peak(threads: int) -> tuple[float, str] | None:
    """(FLOP/s per rank, source) cached for this machine and thread count, or None."""
    path = cpu_peak_cache()
    try:
        entry = json.loads(path.read_text())[machine_key(threads)]
        flops, when = float(entry["flops_per_rank"]), str(entry["measured"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not (math.isfinite(flops) and flops > 0):
        return None
    return flops, _cached_source(path, when, threads)


def store_cpu_peak(threads: int, flops: float) -> tuple[float, str]:
    """Caches a measured rate (FLOP/s per rank) for this machine; (flops, source)."""
    path, when = cpu_peak_cache(), time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    try:
        try:
            table = json.loads(path.read_text())
            table = table if isinstance(table, dict) else {}
        except (OSError, ValueError):
            table = {}
        table[machine_key(threads)] = {"flops_per_rank": flops, "measured": when}
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}")
        tmp.write_text(json.dumps(table, indent=2))
        os.replace(tmp, path)  # a reader never sees half a file
    except OSError as err:
        return flops, (f"fp32 matmul rate measured at start ({threads} thread(s) per rank), "
                       f"not cached ({path}: {err.strerror}); not a datasheet")
    return flops, _cached_source(path, when, threads)


def _cached_source(path: Path, when: str, threads: int) -> str:
    return (f"fp32 matmul rate measured once ({when}) and cached at {path} "
            f"({threads} thread(s) per rank); not a datasheet")


def stored_cpu_peak(threads: int, found: ProfileLookup | None = None,
                    ) -> tuple[float, str] | None:
    """The CPU peak per rank a run reuses: the calibrated profile's, else the cached one (its
    source then says why a saved profile was not used)."""
    found = found or lookup_profile()
    calibrated = calibrated_cpu_peak(threads, found)
    if calibrated is not None:
        return calibrated
    cached = cached_cpu_peak(threads)
    return None if cached is None else (cached[0], _not_used(cached[1], found))


def _not_used(source: str, found: ProfileLookup) -> str:
    """``source``, with why the saved local profile was not used (none saved: nothing to say)."""
    return source if found.status == "missing" else f"{source} ({found.why})"


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
    found = lookup_profile()
    stored = stored_cpu_peak(threads, found)
    if stored is None:
        flops, source = store_cpu_peak(threads, measured_matmul_flops())
        stored = flops, _not_used(source, found)
    return Peak(stored[0], devices, stored[1])


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
