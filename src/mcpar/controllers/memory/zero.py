"""ZeRO stages 1 and 2: the MemoryController shards optimizer state (and gradients) over the
data axis.

Why hand-written
    torch's ``fully_shard`` (FSDP2) shards parameters module by module and issues its own
    per-module collectives on its own streams and groups: the CommunicationController could not
    count, order or (later) compress them, and it has no stage that shards only the optimizer
    state. ``ZeroRedundancyOptimizer`` shards whole parameters (uneven shards, a broadcast per
    parameter). DeepSpeed's ZeRO is an engine of its own. Here the unit of sharding is the
    gradient bucket the data-parallel sync already has, so a ZeRO step issues exactly one
    reduce-scatter and one all-gather per bucket, through the CommunicationController.

Layout
    Each gradient bucket (``grad_sync.py``) is padded to a multiple of its reduction degree n
    (the data degree; an expert bucket's replica count). Its parameters are moved into one flat
    buffer laid out like the bucket's gradient, so element i of the flat gradient is the
    gradient of element i of the flat parameters. The rank at position r of the axis owns
    elements [r S, (r + 1) S) of every bucket (S = padded size / n).

Step
    1. backward: each bucket is reduce-scattered (averaged) into this rank's gradient shard
       (stage 1: from the full gradient buffer, once per step; stage 2: per micro-batch, from a
       buffer that lives only until its reduce-scatter is done; see ``grad_sync.py``);
    2. clipping over the shards (the norm sums over the data axis as well);
    3. AdamW on the rank's shard: one "piece" per parameter that meets the shard, a view of the
       flat parameters whose gradient is a view of the shard, so that weight decay stays per
       parameter and the update is element for element the unsharded AdamW's;
    4. each bucket's updated shard is all-gathered into the flat parameters of every replica.

What a rank holds (fp32, P parameters, data degree n; ``held.py`` counts it): stage 0 16 P
bytes; stage 1 4 P (parameters) + 4 P (gradients; the shard is a slice of them) + 8 P / n (two
AdamW moments); stage 2 4 P + 4 P / n + 8 P / n, plus, during a backward pass, the gradients of
the buckets not yet reduced and the buffers in flight. Buckets are padded to a multiple of n
(at most n - 1 elements each).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.config import JobConfig
from mcpar.controllers.communication.grad_exchange import uses_onebit_adam
from mcpar.controllers.communication.grad_sync import DataParallelGradSync, GradBucket
from mcpar.errors import problem
from mcpar.parallel.expert import EXPERT_SHARDED_ATTR
from mcpar.parallel.tensor import SEQUENCE_PARALLEL_ATTR, TP_SHARDED_ATTR

# What a piece inherits from its parameter: how clipping and the sequence-parallel sync treat it.
INHERITED_ATTRS = (TP_SHARDED_ATTR, EXPERT_SHARDED_ATTR, SEQUENCE_PARALLEL_ATTR)


class ShardPiece(nn.Parameter):
    """The part of one parameter that falls in this rank's shard of its bucket."""

    source: nn.Parameter  # the model's parameter
    start: int  # the piece's first element, in the parameter's flattened elements
    end: int


def _pieces(bucket: GradBucket, flat: torch.Tensor, rank: int) -> list[ShardPiece]:
    assert bucket.shard is not None
    size = bucket.shard.numel()
    lo_shard = rank * size
    pieces = []
    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
        lo, hi = max(offset, lo_shard), min(offset + p.numel(), lo_shard + size)
        if lo >= hi:
            continue
        piece = ShardPiece(flat[lo:hi])
        piece.grad = bucket.shard[lo - lo_shard:hi - lo_shard]
        piece.source, piece.start, piece.end = p, lo - offset, hi - offset
        for attr in INHERITED_ATTRS:
            if hasattr(p, attr):
                setattr(piece, attr, getattr(p, attr))
        pieces.append(piece)
    return pieces


class ZeroAdamW(torch.optim.AdamW):
    """AdamW over this rank's shard of every gradient bucket; ``step`` also all-gathers the
    updated parameters. Its ``param_groups`` hold the pieces (``ShardPiece``), so clipping and
    checkpoints see exactly the state this rank owns."""

    def __init__(self, sync: DataParallelGradSync, comm: Communicator, stage: int, lr: float,
                 betas: tuple[float, float], weight_decay: float):
        self.comm = comm
        self.stage = stage
        self.buckets = sync.buckets
        self.flats: list[torch.Tensor] = []
        decay: list[ShardPiece] = []
        no_decay: list[ShardPiece] = []
        for bucket in self.buckets:
            assert bucket.shard is not None, "the sync was built without ZeRO shards"
            flat = torch.zeros(bucket.numel, dtype=bucket.shard.dtype, device=bucket.shard.device)
            with torch.no_grad():
                for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                    view = flat[offset:offset + p.numel()]
                    view.copy_(p.detach().reshape(-1))
                    p.data = view.view_as(p)  # the model now computes with the flat buffer
            self.flats.append(flat)
            for piece in _pieces(bucket, flat, comm.axis_rank(bucket.axis)):
                # Weight decay on matrices only, as for the unsharded optimizer.
                (decay if piece.source.dim() >= 2 else no_decay).append(piece)
        super().__init__([{"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas)

    @property
    def pieces(self) -> list[ShardPiece]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        super().step()
        for bucket, flat in zip(self.buckets, self.flats, strict=True):
            size = flat.numel() // bucket.degree
            rank = self.comm.axis_rank(bucket.axis) if bucket.degree > 1 else 0
            mine = flat[rank * size:(rank + 1) * size].clone()
            self.comm.all_gather_into(flat, mine, axis=bucket.axis)


@dataclass(frozen=True)
class GroupPlacement:
    """Where one group of parameters and its training state live on a rank."""

    group: str  # 'dense' or 'experts'
    axis: str  # the replicas it is sharded (or reduced) over: 'dp' or 'edp'
    degree: int  # how many replicas
    parameters: str
    gradients: str
    optimizer_state: str


@dataclass(frozen=True)
class MemoryPlacement:
    """The MemoryController's placement decision: per parameter group, what each rank holds."""

    zero_stage: int
    groups: tuple[GroupPlacement, ...]

    def to_json(self) -> dict[str, object]:
        return {"zero_stage": self.zero_stage, "groups": [asdict(g) for g in self.groups]}

    def report_lines(self) -> list[str]:
        lines = [f"memory placement: ZeRO stage {self.zero_stage}"]
        for g in self.groups:
            lines.append(f"  {g.group} ({g.degree} replica{'s' if g.degree > 1 else ''} over "
                         f"'{g.axis}'): parameters "
                         f"{g.parameters}; gradients {g.gradients}; AdamW state "
                         f"{g.optimizer_state}")
        return lines


def plan_placement(cfg: JobConfig, dp: int, ep: int) -> MemoryPlacement:
    """What each rank holds of every parameter group under ``cfg``'s ZeRO stage."""
    stage = cfg.controllers.memory.zero_stage
    groups = [("dense", "dp", dp)]
    if ep > 1:
        groups.append(("experts", "edp", dp // ep))
    placed = []
    for name, axis, n in groups:
        shard = f"a 1/{n} shard"
        placed.append(GroupPlacement(
            name, axis, n, parameters="a full copy",
            gradients=("a full copy (all-reduced)" if stage == 0 else
                       f"a full buffer, reduce-scattered into {shard} once per step"
                       if stage == 1 else
                       f"{shard} (each bucket reduce-scattered and freed per backward)"),
            optimizer_state="a full copy" if stage == 0 else shard))
    return MemoryPlacement(stage, tuple(placed))


def zero_problems(cfg: JobConfig, dp: int) -> list[str]:
    """ZeRO settings this version cannot honour as described; each names its key."""
    stage = cfg.controllers.memory.zero_stage
    if stage == 0:
        return []
    key = "controllers.memory.zero_stage"
    comm, par = cfg.controllers.communication, cfg.parallelism
    problems = []
    if stage == 3:
        problems.append(problem(key, "3 (parameters sharded and gathered per layer) is not "
                                "available for training in this version; use 1 or 2"))
    if dp == 1:
        problems.append(problem(key, f"{stage} shards over the data-parallel ranks and this "
                                "layout has data 1, so nothing would be sharded; use more "
                                "data-parallel ranks or zero_stage 0"))
    if comm.compression != "none" and not uses_onebit_adam(cfg):  # 1-bit: plan.py says why
        problems.append(problem("controllers.communication.compression",
                                f"{comm.compression!r} is not applied to ZeRO's reduce-scatter "
                                "in this version; use compression 'none' with zero_stage > 0"))
    if comm.topology != "flat":
        problems.append(problem("controllers.communication.topology",
                                f"{comm.topology!r}: ZeRO's reduce-scatter and all-gather run "
                                "flat over the data axis in this version; use topology 'flat' "
                                "with zero_stage > 0"))
    if cfg.controllers.compute.scheduler != "static":
        problems.append(problem("controllers.compute.scheduler",
                                f"{cfg.controllers.compute.scheduler!r} migrates experts with "
                                "their optimizer state, which ZeRO shards; use 'static' with "
                                "zero_stage > 0"))
    if stage == 2 and par.virtual_stages > 1:
        problems.append(problem("parallelism.virtual_stages",
                                f"{par.virtual_stages} chunks per rank with zero_stage 2 (which "
                                "reduces after every backward) is not supported in this "
                                "version; use virtual_stages 1 or zero_stage 1"))
    return problems
