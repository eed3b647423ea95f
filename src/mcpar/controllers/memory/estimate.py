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
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.config import JobConfig
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.models.spec import get_model_spec
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.memory import (
    ROW_NAMES,
    MemoryBreakdown,
    format_bytes,
    format_memory_rows,
    memory_header,
    memory_per_gpu,
)
from mcpar.topology import ParallelDims

__all__ = ["MemoryEstimate", "estimate_memory", "format_bytes", "memory_breakdown",
           "params_per_pipeline_rank"]


@dataclass
class MemoryEstimate:
    num_params: int
    params_per_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int
    other_bytes: int = 0  # ZeRO-3 gather buffers, compression error feedback

    @property
    def total_bytes(self) -> int:
        return (self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes
                + self.other_bytes)

    def rows(self) -> list[tuple[str, int]]:
        values = (self.param_bytes, self.grad_bytes, self.optimizer_bytes, self.activation_bytes,
                  self.other_bytes)
        return list(zip(ROW_NAMES, values, strict=True)) + [("total", self.total_bytes)]

    def report_lines(self) -> list[str]:
        """The estimate as ``mcpar check`` prints it (``mcpar simulate`` prints the same)."""
        return [memory_header(self.params_per_rank), *format_memory_rows(self.rows())]


def memory_breakdown(cfg: JobConfig, dims: ParallelDims) -> MemoryBreakdown:
    """The cost model's breakdown for a resolved config (no device reserve). The node size
    (``cluster.ranks_per_node``) sizes the parameter store's node-local copy; when it is left to
    detection, the estimate takes the most that copy can cost (one rank per node)."""
    world = dims.dp * dims.tp * dims.pp
    layout = config_layout(cfg, world)
    return memory_per_gpu(config_model(cfg), layout, reserved=0.0,
                          gpus_per_node=cfg.cluster.ranks_per_node)


def estimate_memory(cfg: JobConfig, dims: ParallelDims) -> MemoryEstimate:
    """Per-rank memory of the busiest rank of a resolved config (``parallelism.data`` and
    ``optimization.gradient_accumulation`` filled)."""
    rows = dict(memory_breakdown(cfg, dims).rows())
    return MemoryEstimate(
        num_params=get_model_spec(cfg.model.kind).num_params(cfg.model),
        params_per_rank=max(params_per_pipeline_rank(cfg, dims)),
        param_bytes=rows["parameters"],
        grad_bytes=rows["gradients"],
        optimizer_bytes=rows["optimizer state"],
        activation_bytes=rows["activations"],
        other_bytes=rows["other"],
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
