"""ParallelDims: the one object that owns the parallel degrees and the device mesh.

The mesh order is fixed: pipeline outermost (it tolerates the slowest links: only activations cross
it, point to point), then data (which holds the expert axis as a sub-axis, as in the seed's layout),
then tensor innermost (its collectives run every layer, so its ranks must share a node). The
controllers query this object for process groups and never build their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from mcpar.config import JobConfig
from mcpar.errors import UserError, problem


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _mesh: object | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(f"dp {self.dp} x tp {self.tp} x pp {self.pp} != {self.world_size}")

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    @property
    def mesh_axis_names(self) -> tuple[str, str, str]:
        return ("pp", "dp", "tp")

    def describe(self) -> str:
        text = (
            f"{self.world_size} devices = tensor {self.tp} x pipeline {self.pp} x data {self.dp}"
        )
        if self.ep > 1:
            text += f", experts {self.ep} within the data axis ({self.dp // self.ep} expert groups)"
        return text

    def build_mesh(self, device_type: str) -> None:
        """Create the DeviceMesh once the default process group exists (world size > 1)."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        from torch.distributed.device_mesh import init_device_mesh

        self._mesh = init_device_mesh(
            device_type, self.mesh_shape, mesh_dim_names=self.mesh_axis_names
        )

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank along a mesh axis ('dp', 'tp', 'pp'); None if size 1."""
        if self._mesh is None or getattr(self, axis) == 1:
            return None
        return self._mesh.get_group(axis)  # type: ignore[attr-defined]

    def axis_rank(self, axis: str) -> int:
        if self._mesh is None:
            return 0
        return self._mesh.get_local_rank(axis)  # type: ignore[attr-defined]


def resolve_layout(cfg: JobConfig, world_size: int | None) -> ParallelDims:
    """Check the layout against the model and the world size and fill the derived values.

    Fills ``parallelism.data`` (from the world size when unset) and
    ``optimization.gradient_accumulation`` (from ``global_batch_size`` when given). With
    ``world_size=None`` (``mcpar check``) the world size is what the degrees multiply to.
    Raises UserError listing every problem found.
    """
    par, model, opt = cfg.parallelism, cfg.model, cfg.optimization
    problems: list[str] = []
    tp, pp = par.tensor, par.pipeline
    dp = par.data
    if dp is None:
        if world_size is None:
            dp = 1
        elif world_size % (tp * pp):
            problems.append(problem(
                "parallelism.data",
                f"{world_size} workers cannot be split into tensor {tp} x pipeline {pp} groups; "
                f"use a world size divisible by {tp * pp}",
            ))
            dp = 1
        else:
            dp = world_size // (tp * pp)
    if world_size is not None and dp * tp * pp != world_size:
        problems.append(problem(
            "parallelism",
            f"the layout needs data {dp} x tensor {tp} x pipeline {pp} = {dp * tp * pp} devices, "
            f"but the job has {world_size}; change the degrees or the number of workers",
        ))
    if model.hidden_size % model.num_heads:
        problems.append(problem(
            "model.num_heads",
            f"{model.num_heads} heads do not divide hidden_size {model.hidden_size}",
        ))
    if model.num_heads % tp:
        problems.append(problem(
            "model.num_heads",
            f"{model.num_heads} heads are not divisible by parallelism.tensor {tp}",
        ))
    if model.ffn_size % tp:
        problems.append(problem(
            "model.ffn_hidden_size",
            f"{model.ffn_size} is not divisible by parallelism.tensor {tp}",
        ))
    if model.vocab_size % tp:
        problems.append(problem(
            "model.vocab_size",
            f"{model.vocab_size} is not divisible by parallelism.tensor {tp} (the vocabulary "
            "is split over tensor ranks)",
        ))
    if par.sequence_parallel and tp == 1:
        problems.append(problem(
            "parallelism.sequence_parallel",
            "shards the sequence over tensor ranks; it needs parallelism.tensor > 1",
        ))
    if par.sequence_parallel and model.seq_len % tp:
        problems.append(problem(
            "model.seq_len",
            f"{model.seq_len} is not divisible by parallelism.tensor {tp} "
            "(sequence parallelism splits it)",
        ))
    if model.num_layers < pp * par.virtual_stages:
        problems.append(problem(
            "model.num_layers",
            f"{model.num_layers} layers cannot fill pipeline {pp} x virtual_stages "
            f"{par.virtual_stages} stages; a stage would be empty",
        ))
    if model.tie_embeddings and pp > 1:
        problems.append(problem(
            "model.tie_embeddings",
            "a tied embedding cannot be split between the first and last pipeline stages; "
            "set it to false or use parallelism.pipeline 1",
        ))
    if dp % par.experts:
        problems.append(problem(
            "parallelism.experts",
            f"expert degree {par.experts} does not divide the data degree {dp}",
        ))
    if model.kind == "moe":
        if model.num_experts % par.experts:
            problems.append(problem(
                "model.num_experts",
                f"{model.num_experts} experts are not divisible by parallelism.experts "
                f"{par.experts}",
            ))
        if model.top_k > model.num_experts:
            problems.append(problem(
                "model.top_k",
                f"top_k {model.top_k} is larger than num_experts {model.num_experts}",
            ))
    accum = opt.gradient_accumulation
    if opt.global_batch_size is not None:
        per_micro = opt.micro_batch_size * dp
        if opt.global_batch_size % per_micro:
            problems.append(problem(
                "optimization.global_batch_size",
                f"{opt.global_batch_size} is not divisible by micro_batch_size "
                f"{opt.micro_batch_size} x data {dp} = {per_micro}",
            ))
        elif accum is not None and accum * per_micro != opt.global_batch_size:
            problems.append(problem(
                "optimization.gradient_accumulation",
                f"{accum} x micro_batch_size {opt.micro_batch_size} x data {dp} != "
                f"global_batch_size {opt.global_batch_size}; set one of them only",
            ))
        else:
            accum = opt.global_batch_size // per_micro
    if problems:
        raise UserError(problems)
    par.data = dp
    opt.gradient_accumulation = accum or 1
    opt.global_batch_size = opt.micro_batch_size * opt.gradient_accumulation * dp
    return ParallelDims(dp=dp, tp=tp, pp=pp, ep=par.experts, world_size=dp * tp * pp)
