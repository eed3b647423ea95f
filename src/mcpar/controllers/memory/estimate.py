"""MemoryController: the per-rank memory budget of a layout.

The estimate counts what each rank holds: its share of the parameters (split by tensor and pipeline
parallelism), their gradients, the optimizer state (sharded over data ranks from ZeRO stage 1), and
the activations kept for the backward pass. Activation bytes per layer and micro-batch follow the
transformer analysis of Korthikanti et al. (2022): s*b*h*(34 + 5*a*s/h) bytes at 16-bit precision,
divided by the tensor degree (and the 34 fully, with sequence parallelism); fp32 doubles it. Under
1F1B the first stage holds up to `pipeline` micro-batches in flight.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.config import JobConfig
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.models.spec import get_model_spec
from mcpar.topology import ParallelDims


@dataclass
class MemoryEstimate:
    num_params: int
    params_per_rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    activation_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes + self.activation_bytes

    def rows(self) -> list[tuple[str, int]]:
        return [
            ("parameters", self.param_bytes),
            ("gradients", self.grad_bytes),
            ("optimizer state", self.optimizer_bytes),
            ("activations", self.activation_bytes),
            ("total", self.total_bytes),
        ]


def estimate_memory(cfg: JobConfig, dims: ParallelDims) -> MemoryEstimate:
    m, opt = cfg.model, cfg.optimization
    spec = get_model_spec(m.kind)
    num_params = spec.num_params(m)
    h = m.hidden_size
    per_rank = max(params_per_pipeline_rank(cfg, dims))
    bytes_per_value = 4  # parameters, gradients and Adam moments are kept in fp32
    zero_div = dims.dp if cfg.controllers.memory.zero_stage >= 1 else 1
    grad_div = dims.dp if cfg.controllers.memory.zero_stage >= 2 else 1
    param_div = dims.dp if cfg.controllers.memory.zero_stage >= 3 else 1
    s, b, a = m.seq_len, opt.micro_batch_size, m.num_heads
    act_scale = 1 if cfg.training.dtype == "bfloat16" else 2
    linear_part = 34 / dims.tp if cfg.parallelism.sequence_parallel else 10 + 24 / dims.tp
    per_layer = s * b * h * (linear_part + 5 * a * s / (h * dims.tp)) * act_scale
    layers_per_stage = -(-m.num_layers // dims.pp)
    in_flight = min(dims.pp, opt.gradient_accumulation or 1) if dims.pp > 1 else 1
    activations = int(per_layer * layers_per_stage * in_flight)
    # Logits of the last stage: [b, s, vocab / tp] in fp32, plus their gradient.
    activations += 2 * s * b * (m.vocab_size // dims.tp) * 4
    return MemoryEstimate(
        num_params=num_params,
        params_per_rank=per_rank,
        param_bytes=per_rank * bytes_per_value // param_div,
        grad_bytes=per_rank * bytes_per_value // grad_div,
        optimizer_bytes=2 * per_rank * bytes_per_value // zero_div,
        activation_bytes=activations,
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


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"
