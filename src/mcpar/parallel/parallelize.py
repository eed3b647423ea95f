"""Build this rank's part of the model, applying the parallelisms in a fixed order.

1. Build the full model from its spec with the seeded init (every rank draws the same values, so
   every shard below holds exactly the single-process numbers).
2. Pipeline: the plan's stage cut (the ComputeController's) splits the blocks into pp x
   virtual_stages stages; this rank keeps the chunks of its global stages (rank r holds stages
   r, r + pp, ..., or those the schedule places on it: ``stages``).
3. Tensor (and sequence) parallelism shards each kept chunk in place.
4. Expert parallelism: each MoE layer keeps this rank's experts (split over the expert axis, their
   width over the tensor axis) and exchanges tokens by all-to-all.
5. Context parallelism: attention cores over the context axis (ring or Ulysses) and the position
   lookups of this rank's zigzag shard of the sequence (``parallel/context.py``).
6. Move to the device.

This is where the model spec (``model.kind``) meets the parallel mechanisms: the spec's
``pieces`` tell the pipeline cut where the embedding, blocks and head are, its
``tensor_parallel`` plan which modules to shard and its ``expert_parallel`` plan where the MoE
layers and their experts are; the mechanisms under parallel/ take those as arguments and name no
model attribute.

Data parallelism is not applied here: the CommunicationController's gradient exchange takes the
parameters this returns (``ParallelModel.params``) and synchronizes them (see
``mcpar.controllers.communication``).

Building the whole model first costs host memory on every rank; it is what makes the shards
bit-identical to the single-process model, which the parity tests rely on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.config import JobConfig
from mcpar.models.spec import get_model_spec
from mcpar.parallel.context import apply_context_parallel
from mcpar.parallel.expert import apply_expert_parallel
from mcpar.parallel.pipeline import global_stage
from mcpar.parallel.stage import StageModule, cut_model
from mcpar.parallel.tensor import apply_tensor_parallel, vocab_parallel_cross_entropy
from mcpar.topology import ParallelDims

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ParallelModel:
    chunks: list[StageModule]  # this rank's stages, in local chunk order
    layer_ranges: list[tuple[int, int]]  # every global stage's [start, end) blocks
    params: list[nn.Parameter]  # unique parameters this rank holds
    loss_fn: LossFn

    @property
    def holds_first_stage(self) -> bool:
        return any(chunk.is_first for chunk in self.chunks)

    @property
    def holds_last_stage(self) -> bool:
        return any(chunk.is_last for chunk in self.chunks)

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def parallelize(cfg: JobConfig, dims: ParallelDims, comm: Communicator, device: torch.device,
                layer_ranges: list[tuple[int, int]],
                stages: list[int] | None = None) -> ParallelModel:
    """This rank's part of the model. ``layer_ranges``: every global stage's [start, end) blocks,
    the ComputeController's stage cut from the job's plan; ``stages``: the global stages of this
    rank's chunks, as the plan's schedule places them (default: r, r + pp, ...)."""
    spec = get_model_spec(cfg.model.kind)
    full = spec.build(cfg.model, cfg.training.seed)

    # 2. pipeline cut
    virtual = len(layer_ranges) // dims.pp  # the plan's virtual stages per rank
    if not layer_ranges or len(layer_ranges) % dims.pp:
        raise ValueError(f"{len(layer_ranges)} stage ranges for pipeline {dims.pp}")
    pp_rank = dims.axis_rank("pp")
    if stages is None:
        stages = [global_stage(c, pp_rank, dims.pp) for c in range(virtual)]
    chunks = [cut_model(full, layer_ranges, stage, spec.pieces) for stage in stages]
    del full

    # 3. tensor / sequence parallelism
    if dims.tp > 1:
        if spec.tensor_parallel is None:
            raise ValueError(f"model kind '{spec.name}' has no tensor-parallel plan")
        tp_rank = dims.axis_rank("tp")
        for chunk in chunks:
            apply_tensor_parallel(chunk, spec.tensor_parallel, comm, tp_rank, dims.tp,
                                  cfg.parallelism.sequence_parallel)

    # 4. expert parallelism (and the tensor split of the experts)
    if spec.expert_parallel is not None and (dims.ep > 1 or dims.tp > 1):
        for chunk in chunks:
            apply_expert_parallel(chunk, spec.expert_parallel, comm, dims.axis_rank("ep"), dims.ep,
                                  dims.axis_rank("tp"), dims.tp)

    # 5. context parallelism
    if dims.cp > 1:
        if spec.context_parallel is None:
            raise ValueError(f"model kind '{spec.name}' has no context-parallel plan")
        for chunk in chunks:
            apply_context_parallel(chunk, spec.context_parallel, comm, dims.axis_rank("cp"),
                                   dims.cp, cfg.parallelism.context_mode, cfg.model.seq_len)

    # 6. device
    chunks = [chunk.to(device) for chunk in chunks]

    # The unique parameters (a tied weight is one parameter), for the gradient exchange.
    unique: dict[int, nn.Parameter] = {}
    for chunk in chunks:
        for p in chunk.parameters():
            unique.setdefault(id(p), p)
    params = list(unique.values())
    if dims.tp > 1:
        tp_rank = dims.axis_rank("tp")

        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return vocab_parallel_cross_entropy(logits.float(), targets, comm, tp_rank, dims.tp)
    else:
        def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    return ParallelModel(chunks, layer_ranges, params, loss_fn)
