"""MemoryController: the per-rank memory budget of a layout.

The formula is the cost model's, ``mcpar.sim.memory.memory_per_gpu`` (its docstring says what is
counted and why): the config is mapped to the simulator's model shape and layout by
``mcpar.sim.fromconfig`` (mcpar's biases, position table, tied head, stage cut, autocast), so
``mcpar check``, the dynamic batch splitting and ``mcpar simulate`` price the same bytes. The
device's own reserve is not part of it: the runtime's memory budget (``device.memory_budget_bytes``)
keeps its headroom instead.

``params_per_pipeline_rank`` counts the parameters of each pipeline position exactly from the
model spec and the ComputeController's stage cut; the simulator's count of the busiest rank is
the same number (a test checks it).

Offload (``controllers.memory.offload``) is the MemoryController's own setting, priced here from
the config: the optimizer state leaves the device (an off-device row below the total) and the
streaming goes through two groups of ``offload_buffer_mb`` (``OFFLOAD_BUFFER_MB`` when the config
has no such key) in host memory: on a CPU device they are the device's, on CUDA they are not.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.config import JobConfig
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.device_select import cuda_available
from mcpar.models.spec import get_model_spec
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.memory import (
    OFF_DEVICE_ROW,
    ROW_NAMES,
    MemoryBreakdown,
    Offload,
    format_bytes,
    format_memory_rows,
    held_limits,
    memory_header,
    memory_per_gpu,
)
from mcpar.topology import ParallelDims

__all__ = ["MemoryEstimate", "config_offload", "estimate_memory", "format_bytes", "layer_modes",
           "memory_breakdown", "params_per_pipeline_rank",
           "schedule_held_limits"]

# One streaming group's MiB when the config does not say (``controllers.memory.offload_buffer_mb``).
OFFLOAD_BUFFER_MB = 64.0


@dataclass
class MemoryEstimate:
    num_params: int
    params_per_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    comm_bytes: int = 0  # error feedback, gradient buckets in flight, offload streaming buffers
    gathered_bytes: int = 0  # ZeRO-3's gathered layers and root parameters
    offloaded_bytes: int = 0  # optimizer state off the device (not in the total)

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes
                + self.comm_bytes + self.gathered_bytes)

    def rows(self) -> list[tuple[str, int]]:
        values = (self.param_bytes, self.grad_bytes, self.optimizer_bytes, self.activation_bytes,
                  self.comm_bytes, self.gathered_bytes)
        return list(zip(ROW_NAMES, values, strict=True)) + [("total", self.total_bytes)]

    def off_device_rows(self) -> list[tuple[str, int]]:
        return [(OFF_DEVICE_ROW, self.offloaded_bytes)] if self.offloaded_bytes else []

    def report_lines(self) -> list[str]:
        """The estimate as ``mcpar check`` prints it (``mcpar simulate`` prints the same rows;
        the off-device row is the MemoryController's, under offload only)."""
        return [memory_header(self.params_per_rank),
                *format_memory_rows(self.rows() + self.off_device_rows())]


def memory_breakdown(cfg: JobConfig, dims: ParallelDims) -> MemoryBreakdown:
    """The cost model's breakdown for a resolved config (no device reserve). The node size
    (``cluster.ranks_per_node``) sizes the parameter store's node-local copy; when it is left to
    detection, the estimate takes the most that copy can cost (one rank per node)."""
    layout = config_layout(cfg, dims.world_size)  # data x tensor x pipeline x context
    return memory_per_gpu(config_model(cfg), layout, reserved=0.0,
                          gpus_per_node=cfg.cluster.ranks_per_node, offload=config_offload(cfg),
                          layer_recompute=layer_modes(cfg))


def schedule_held_limits(cfg: JobConfig, dims: ParallelDims) -> tuple[int, ...] | None:
    """The most chunk activations each pipeline rank may hold under the config's split
    schedule, so no rank passes 1F1B's activation peak (``mcpar.sim.memory.held_limits``, with
    the estimate's own model, layout and recompute); None where nothing needs bounding."""
    if dims.pp == 1:
        return None
    return held_limits(config_model(cfg), config_layout(cfg, dims.world_size),
                       layer_modes(cfg))


def config_offload(cfg: JobConfig) -> Offload | None:
    """The config's optimizer offload, or None when the state stays on the device."""
    mem = cfg.controllers.memory
    if mem.offload == "none":
        return None
    mb = getattr(mem, "offload_buffer_mb", None) or OFFLOAD_BUFFER_MB
    # The two streaming buffers are host memory: the device's own on a CPU device only.
    on_host = cfg.training.device == "cuda" or (cfg.training.device == "auto"
                                                 and cuda_available())
    return Offload(mem.offload, 0.0 if on_host else mb * 2**20)


def estimate_memory(cfg: JobConfig, dims: ParallelDims) -> MemoryEstimate:
    """Per-rank memory of the busiest rank of a resolved config (``parallelism.data`` and
    ``optimization.gradient_accumulation`` filled)."""
    breakdown = memory_breakdown(cfg, dims)
    rows = dict(breakdown.rows())
    return MemoryEstimate(
        num_params=get_model_spec(cfg.model.kind).num_params(cfg.model),
        params_per_rank=max(params_per_pipeline_rank(cfg, dims)),
        param_bytes=rows["parameters"],
        grad_bytes=rows["gradients"],
        optimizer_bytes=rows["optimizer state"],
        activation_bytes=rows["activations"],
        comm_bytes=rows["communication buffers"],
        gathered_bytes=rows["gathered working set"],
        offloaded_bytes=round(breakdown.offloaded),
    )


def params_per_pipeline_rank(cfg: JobConfig, dims: ParallelDims) -> list[int]:
    """Exact parameters held by one rank of each pipeline position (stages cut as the
    ComputeController cuts them; a rank holds `virtual_stages` of them)."""
    spec = get_model_spec(cfg.model.kind)
    num_stages = dims.pp * cfg.parallelism.virtual_stages
    ranges = partition_layers(cfg.model, num_stages)
    counts = [0] * dims.pp
    for stage, (start, end) in enumerate(ranges):
        counts[stage % dims.pp] += spec.stage_num_params(
            cfg.model, end - start, stage == 0, stage == num_stages - 1, dims.tp, dims.ep)
    return counts


def layer_modes(cfg: JobConfig) -> tuple[str, ...]:
    """Each block's recompute mode, in the model's order."""
    mem = cfg.controllers.memory
    if mem.recompute_blocks is None:
        return (mem.activation_checkpointing,) * cfg.model.num_layers
    none, selective, full = mem.recompute_blocks
    return ("full",) * full + ("selective",) * selective + ("none",) * none
