"""Accelerators, clusters and the efficiency parameters the cost model runs with.

Peak figures come from ``data/hardware.csv`` (a copy of ``calibration/hardware.csv`` shipped with
the package, so nothing outside the package is read at run time); ``--hardware FILE`` takes
another table with the same columns. Units inside the simulator are SI: FLOP/s, bytes, bytes/s
and seconds. GPU memory sizes in the table ("80 GB") are the datasheet's binary gigabytes, so
``hbm_gb`` is read as GiB; every ``*_gb`` figure the simulator prints is GiB too.

Links (per GPU, per direction):

- intra-node: NVLink/NVSwitch, half of the table's bidirectional figure;
- inter-node: the row's ``inter_node_gbps_per_gpu`` (gigabits/s of the GPU's own NIC, one rail
  per GPU as on DGX systems), divided by 8.

Latencies are not in the table; they are fixed constants here, of the order NCCL reaches per ring
step with its low-latency protocol (a few microseconds on NVLink, more through a NIC and a switch).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import asdict, dataclass, field, replace
from importlib import resources
from pathlib import Path

from mcpar.errors import UserError, problem

ALPHA_INTRA_S = 2e-6  # per ring step on NVLink/NVSwitch
ALPHA_INTER_S = 6e-6  # per ring step through a NIC and one switch hop
GIB = 2.0**30
# What a GPU holds besides the job's tensors: CUDA context, NCCL and cuBLAS workspaces, allocator
# fragmentation. A CPU worker has none of these (the local profile's reserve is 0).
RESERVED_BYTES = 2.0 * GIB

# Where offloaded optimizer state streams to and from, bytes/s per rank and direction (the
# MemoryController's placement prices offload with them). cpu: PCIe 4.0 x16, 32 GB/s per
# direction in the specification, about 25 GB/s reached by pinned-memory copies. nvme: a PCIe 4.0
# NVMe SSD, about 7 GB/s sequential read and 5 GB/s write in vendors' datasheets; 3.5 GB/s is
# taken for a step that both reads and writes.
OFFLOAD_BANDWIDTH = {"cpu": 25e9, "nvme": 3.5e9}

# Dense FP8 tensor-core peaks (TFLOP/s) from the datasheets; hardware.csv has no fp8 column.
FP8_PEAK_TFLOPS = {"H100-80GB": 1979.0, "H200-141GB": 1979.0}
# Share of the dense peak the flash-attention kernels of the calibrated generation can draw on,
# against an A100 (1.0; the fitted ``attention`` efficiency is an A100-era kernel's share of
# peak). FlashAttention-2 reaches 50-73% of peak on an A100 (Dao 2023, abstract) but 35% on an
# H100 (Shah et al. 2024, FlashAttention-3, abstract): its Ampere-style tensor-core instructions
# leave Hopper's faster ones idle. 0.35 / 0.615 (the A100 range's middle) = 0.569.
ATTENTION_PEAK_SHARE = {"H100-80GB": 0.35 / 0.615, "H200-141GB": 0.35 / 0.615}
# Streaming multiprocessors (datasheets): a kernel that holds some of them slows the GEMMs that
# run beside it (``compute.UB_SCATTER_SMS``).
SM_COUNT = {"A100-40GB": 108, "A100-80GB": 108, "H100-80GB": 132, "H200-141GB": 132}

HARDWARE_COLUMNS = (
    "gpu", "peak_tflops_bf16", "peak_tflops_fp16", "hbm_gb", "hbm_gbs",
    "nvlink_gbs_per_gpu_bidirectional", "typical_node", "typical_inter_node_gbps_per_gpu",
)


@dataclass(frozen=True)
class Efficiency:
    """Global efficiency parameters: what fraction of a peak real kernels and collectives reach.

    One set is fitted on published runs for all GPUs (``params.GPU_EFFICIENCY``); the local CPU
    profile carries its own, measured by micro-benchmarks. Nothing here is per run.
    """

    gemm: float  # fraction of peak FLOP/s a large matrix multiply sustains
    attention: float  # fraction of peak a fused (flash) attention kernel sustains
    memory: float  # fraction of memory bandwidth that memory-bound kernels sustain
    network: float  # fraction of link bandwidth a collective's bandwidth term sustains
    overlap: float  # fraction of overlappable data-parallel communication actually hidden
    layer_overhead_s: float  # fixed time per layer per micro-batch (launches, syncs, dispatch)


@dataclass(frozen=True)
class Accelerator:
    name: str
    peak_flops: dict[str, float]  # by precision: fp16, bf16, fp8, fp32 (TF32 on GPUs)
    hbm_bytes: float
    hbm_bw: float  # bytes/s
    intra_bw: float  # bytes/s per GPU per direction inside a node
    typical_inter_gbps: float
    is_cpu: bool = False
    mem_bw_total: float = 0.0  # CPU only: what all cores stream together (hbm_bw: one thread)
    mask_rate: float = 0.0  # CPU only: dropout-mask elements/s per rank; 0: fused (GPUs)
    attention_share: float = 1.0  # ATTENTION_PEAK_SHARE: of the peak, what attention can use
    sms: int = 0  # SM_COUNT; 0: unknown (no SM is reserved for communication)

    def peak(self, precision: str, key: str = "precision") -> float:
        if precision not in self.peak_flops:
            raise UserError(problem(key, f"{self.name} has no {precision!r} peak in the hardware "
                                         f"table; use one of {sorted(self.peak_flops)}"))
        return self.peak_flops[precision]


# The head dimensions a profile times the ring blocks at (``microbench.ring_block_notes``).
RING_HEAD_DIMS = (32, 128)


@dataclass(frozen=True)
class RingBlockCost:
    """One rank's ring-attention blocks (``mcpar.ring_blocks``) as a profile timed them on one
    thread, forward and backward each: a fixed cost per call and per further ring step (the
    eager ops, whatever the size), and the cost per attention score at the two head dimensions
    of ``RING_HEAD_DIMS``, linear between them (and beyond, at least 0) as the GEMMs' work is:
    ``call + (ranks - 1) step + scores per_score(head_dim)``. Every field is a time measured
    (>= 0), none a fitted intercept, so a profile's check can refuse a negative one."""

    fwd_call_s: float
    fwd_step_s: float
    fwd_per_score_low_s: float
    fwd_per_score_high_s: float
    bwd_call_s: float
    bwd_step_s: float
    bwd_per_score_low_s: float
    bwd_per_score_high_s: float

    def seconds(self, ranks: int, scores: float, head_dim: float,
                threads: float = 1.0) -> tuple[float, float]:
        """(forward, backward) seconds of one call; the score work split over ``threads``."""
        low, high = RING_HEAD_DIMS
        share = (head_dim - low) / (high - low)

        def one(call: float, step: float, at_low: float, at_high: float) -> float:
            per_score = max(0.0, at_low + (at_high - at_low) * share)
            return call + (ranks - 1) * step + scores * per_score / max(threads, 1.0)

        return (one(self.fwd_call_s, self.fwd_step_s, self.fwd_per_score_low_s,
                    self.fwd_per_score_high_s),
                one(self.bwd_call_s, self.bwd_step_s, self.bwd_per_score_low_s,
                    self.bwd_per_score_high_s))


@dataclass(frozen=True)
class NodeLink:
    """The nodes of a CPU job and the link between them: ``ranks_per_node`` consecutive ranks
    share a node (its loopback), and each node reaches the others through one link of
    ``bandwidth`` bytes/s per direction, which its ranks share, after ``latency_s``.

    ``source`` says where the figures came from (measured by the job at start, or the
    ``cluster.inter_node_*`` keys), for the report."""

    ranks_per_node: int
    latency_s: float
    bandwidth: float
    source: str

    def describe(self) -> str:
        return (f"nodes of {self.ranks_per_node} rank(s) joined by a "
                f"{self.bandwidth * 8 / 1e6:,.0f} Mbit/s link, {self.latency_s * 1e6:,.0f} us "
                f"({self.source})")


@dataclass(frozen=True)
class Cluster:
    """The machine a run uses: accelerator type, how many, how they are wired."""

    accel: Accelerator
    num_gpus: int
    gpus_per_node: int
    inter_bw: float  # bytes/s per GPU per direction between nodes
    alpha_intra: float = ALPHA_INTRA_S
    alpha_inter: float = ALPHA_INTER_S
    efficiency: Efficiency | None = None  # None: the globally fitted GPU parameters
    cores: int = 0  # CPU profile only: cores shared by all worker processes
    name: str = ""
    # CPU profile only: measured (alpha, beta) per operation ("ar", "ag", "rs", "p2p") of
    # t = alpha + n beta between two ranks; empty: the textbook ring costs on the links above.
    op_costs: dict[str, tuple[float, float]] = field(default_factory=dict)
    reserved_bytes: float = RESERVED_BYTES  # per device, beside the job's memory
    # A measured profile's share of a prefetched all-gather (ZeRO-3's parameter store) that
    # hides behind compute (``microbench._gather_overlap``); None: ``efficiency.overlap``.
    gather_overlap: float | None = None
    # A measured profile's cost of time-slicing: how much longer CPU workers take, two to a
    # core, than the cores' share of them (``shared_cores_bench.time_slicing_penalty``); 0: none
    # known.
    time_slicing_penalty: float = 0.0
    # A measured profile's seconds that a posted point-to-point exchange (a ring-attention step)
    # costs beyond what it costs uncrowded, two workers to a core
    # (``shared_cores_bench.crowded_exchange_cost``); 0: none known.
    crowded_exchange_s: float = 0.0
    # A measured profile's causal-attention rate at each head dimension it timed, over the rate
    # its ``efficiency.attention`` holds (head dimension 64): small heads run a CPU's attention
    # kernel well below it. Empty: one rate for every head dimension.
    attention_head_dims: dict[int, float] = field(default_factory=dict)
    # A measured profile's cost of mcpar's ring-attention blocks; None: priced from the
    # accelerator's rates (``compute.ring_core_times``).
    ring_blocks: RingBlockCost | None = None

    @property
    def num_nodes(self) -> int:
        return max(1, -(-self.num_gpus // self.gpus_per_node))


def _num(row: dict[str, str], key: str, where: str, problems: list[str]) -> float:
    """A finite positive number of the table (a peak, a size, a bandwidth), else 1.0 and a
    problem naming the table, the GPU and the column."""
    text = row.get(key)
    try:
        value = float(text or "")
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        problems.append(problem(f"{where}.{key}", f"expected a finite number > 0, got {text!r}; "
                                                  "fix the hardware table's row"))
        return 1.0
    return value


def load_accelerators(path: str | Path | None = None) -> dict[str, Accelerator]:
    """Accelerators of a hardware table (the packaged copy when `path` is None), by name."""
    if path is None:
        text = resources.files("mcpar.sim").joinpath("data/hardware.csv").read_text()
        where = "hardware.csv"
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(problem(str(p), "hardware table not found; give a CSV with columns "
                                            + ", ".join(HARDWARE_COLUMNS)))
        try:
            text, where = p.read_text(), str(p)
        except (OSError, UnicodeDecodeError) as err:
            raise UserError(problem(str(p), f"cannot read the hardware table as UTF-8 text "
                                            f"({err})")) from None
    rows = list(csv.DictReader(text.splitlines()))
    missing = [c for c in HARDWARE_COLUMNS if rows and c not in rows[0]]
    if missing or not rows:
        raise UserError(problem(where, f"missing columns {missing or list(HARDWARE_COLUMNS)}"))
    table: dict[str, Accelerator] = {}
    problems: list[str] = []
    for i, row in enumerate(rows, 2):
        name = (row.get("gpu") or "").strip()
        if not name:
            problems.append(problem(f"{where}:{i}.gpu", "empty GPU name; name every row"))
            continue
        at = f"{where}[{name}]"
        if name.lower() in table:
            problems.append(problem(at, "a second row for this GPU; keep one"))
        bf16 = _num(row, "peak_tflops_bf16", at, problems) * 1e12
        fp16 = _num(row, "peak_tflops_fp16", at, problems) * 1e12
        peaks = {"bf16": bf16, "fp16": fp16, "fp32": bf16 / 2}  # fp32 matmuls run as TF32
        if name in FP8_PEAK_TFLOPS:
            peaks["fp8"] = FP8_PEAK_TFLOPS[name] * 1e12
        table[name.lower()] = Accelerator(
            name=name, peak_flops=peaks, hbm_bytes=_num(row, "hbm_gb", at, problems) * GIB,
            hbm_bw=_num(row, "hbm_gbs", at, problems) * 1e9,
            intra_bw=_num(row, "nvlink_gbs_per_gpu_bidirectional", at, problems) * 1e9 / 2,
            typical_inter_gbps=_num(row, "typical_inter_node_gbps_per_gpu", at, problems),
            attention_share=ATTENTION_PEAK_SHARE.get(name, 1.0),
            sms=SM_COUNT.get(name, 0),
        )
    if problems:
        raise UserError(problems)
    return table


def find_accelerator(name: str, table: dict[str, Accelerator], key: str) -> Accelerator:
    """The accelerator called `name` (case-insensitive), or a UserError naming `key`."""
    accel = table.get(name.strip().lower())
    if accel is None:
        known = ", ".join(a.name for a in table.values())
        raise UserError(problem(key, f"unknown GPU {name!r}; known: {known} (add a row to a "
                                     "hardware table and pass it with --hardware)"))
    return accel


def make_cluster(accel: Accelerator, num_gpus: int, gpus_per_node: int,
                 inter_node_gbps_per_gpu: float, name: str = "") -> Cluster:
    return Cluster(accel=accel, num_gpus=num_gpus, gpus_per_node=gpus_per_node,
                   inter_bw=inter_node_gbps_per_gpu * 1e9 / 8, name=name)


# Short names accepted in cluster presets such as "a100x1024".
GPU_ALIASES = {"a100": "A100-80GB", "a100-80gb": "A100-80GB", "a100-40gb": "A100-40GB",
               "h100": "H100-80GB", "h100-80gb": "H100-80GB", "h200": "H200-141GB",
               "h200-141gb": "H200-141GB"}
CLUSTER_PRESET = re.compile(r"^(?P<gpu>[a-z0-9-]+)x(?P<n>\d+)$")


def cluster_preset(name: str, table: dict[str, Accelerator] | None = None,
                   key: str = "--cluster") -> Cluster:
    """A cluster from a preset name: ``<gpu>x<count>`` (8 GPUs per node, the table's typical
    inter-node bandwidth), e.g. ``a100x1024``, ``h100x512``, ``a100-40gbx64``. ``local``, this
    machine's measured profile, is ``localprofile.named_cluster``'s (which builds on this module,
    so this one does not import it)."""
    match = CLUSTER_PRESET.match(name.strip().lower())
    if not match:
        raise UserError(problem(key, f"unknown cluster preset {name!r}; use <gpu>x<count> "
                                     f"(gpu one of {', '.join(sorted(GPU_ALIASES))}), e.g. "
                                     "a100x1024, or 'local'"))
    table = table or load_accelerators()
    gpu = GPU_ALIASES.get(match["gpu"], match["gpu"])
    accel = find_accelerator(gpu, table, key)
    n = int(match["n"])
    per_node = min(8, n)
    if n < 1 or n % per_node:
        raise UserError(problem(key, f"{n} GPUs is not a whole number of 8-GPU nodes"))
    return replace(make_cluster(accel, n, per_node, accel.typical_inter_gbps), name=name)


# The profile's note of the share of a prefetched all-gather that hides behind compute.
GATHER_OVERLAP_NOTE = "gather_overlap"
TIME_SLICING_NOTE = "time_slicing_penalty"
CROWDED_EXCHANGE_NOTE = "crowded_exchange_s"


@dataclass
class LocalProfile:
    """This machine, as measured by ``localprofile.measure`` (CPU workers over gloo); saved and
    read, stamped with the machine it is valid for, by ``profilestore``."""

    cores: int
    flops_per_thread: float  # fp32 matmul FLOP/s of one thread at training-like shapes
    attention_flops_per_thread: float  # causal SDPA forward+backward FLOP/s, one thread
    mem_bw_per_thread: float  # bytes/s an elementwise op streams with one thread
    mem_bw_total: float  # bytes/s all cores stream together
    op_overhead_s: float  # eager dispatch + autograd cost of one small op
    layer_overhead_s: float  # fixed cost of one transformer block's forward+backward
    # Elements/s a dropout mask is drawn at (torch's CPU bernoulli, one thread: it draws in one
    # however many a process runs): 25x slower than an element-wise multiply, it is most of what
    # dropout costs a CPU step.
    # 0: not measured (GPUs fuse the draw into the element-wise kernels).
    mask_rate_per_thread: float = 0.0
    # gloo over loopback, two ranks: op -> [alpha s, beta s/byte] of t = alpha + n beta
    collectives: dict[str, list[float]] = field(default_factory=dict)
    notes: dict[str, float] = field(default_factory=dict)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)
