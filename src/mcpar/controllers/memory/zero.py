"""ZeRO stages 1 and 2: the MemoryController shards optimizer state (and gradients) over the
data axis. (Stage 3 shards the parameters too: ``param_store.py``; its optimizer is this one,
over the store's shards.)

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

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.controllers.communication.grad_sync import DataParallelGradSync, GradBucket
from mcpar.controllers.memory.offload import OffloadAdamW, OffloadSpec
from mcpar.controllers.memory.param_store import ParameterStore
from mcpar.parallel.expert import EXPERT_SHARDED_ATTR
from mcpar.parallel.tensor import SEQUENCE_PARALLEL_ATTR, TP_SHARDED_ATTR

# What a piece inherits from its parameter: how clipping and the sequence-parallel sync treat it.
INHERITED_ATTRS = (TP_SHARDED_ATTR, EXPERT_SHARDED_ATTR, SEQUENCE_PARALLEL_ATTR)


class ShardPiece(nn.Parameter):
    """The part of one parameter that falls in this rank's shard of its bucket."""

    source: nn.Parameter  # the model's parameter
    start: int  # the piece's first element, in the parameter's flattened elements
    end: int


def _pieces(bucket: GradBucket, owned: torch.Tensor, rank: int) -> list[ShardPiece]:
    """The pieces of ``owned``, this rank's elements [rank S, (rank + 1) S) of the bucket's
    flat parameters (a view of them, or stage 3's shard)."""
    assert bucket.shard is not None
    size = bucket.shard.numel()
    lo_shard = rank * size
    pieces = []
    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
        lo, hi = max(offset, lo_shard), min(offset + p.numel(), lo_shard + size)
        if lo >= hi:
            continue
        piece = ShardPiece(owned[lo - lo_shard:hi - lo_shard])
        piece.grad = bucket.shard[lo - lo_shard:hi - lo_shard]
        piece.source, piece.start, piece.end = p, lo - offset, hi - offset
        for attr in INHERITED_ATTRS:
            if hasattr(p, attr):
                setattr(piece, attr, getattr(p, attr))
        pieces.append(piece)
    return pieces


class ZeroAdamW(OffloadAdamW):
    """AdamW over this rank's shard of every gradient bucket; ``step`` also all-gathers the
    updated parameters. Its ``param_groups`` hold the pieces (``ShardPiece``), so clipping and
    checkpoints see exactly the state this rank owns. With ``offload``, the pieces' state is
    offloaded and their update streamed (``offload.py``)."""

    def __init__(self, sync: DataParallelGradSync, comm: Communicator, stage: int, lr: float,
                 betas: tuple[float, float], weight_decay: float,
                 store: ParameterStore | None = None, offload: OffloadSpec | None = None):
        """``store``: stage 3's parameter store, whose shards the pieces are (the next forward
        gathers them: no all-gather after the step)."""
        self.comm = comm
        self.stage = stage
        self.store = store
        self.buckets = sync.buckets
        self.flats: list[torch.Tensor] = []
        decay: list[ShardPiece] = []
        no_decay: list[ShardPiece] = []
        for bucket in self.buckets:
            assert bucket.shard is not None, "the sync was built without ZeRO shards"
            rank = comm.axis_rank(bucket.axis) if bucket.degree > 1 else 0
            size = bucket.numel // bucket.degree
            if store is not None:
                owned = store.primary[bucket.index]
            else:
                flat = torch.zeros(bucket.numel, dtype=bucket.shard.dtype,
                                   device=bucket.shard.device)
                with torch.no_grad():
                    for p, offset in zip(bucket.params, bucket.offsets, strict=True):
                        view = flat[offset:offset + p.numel()]
                        view.copy_(p.detach().reshape(-1))
                        p.data = view.view_as(p)  # the model now computes with the flat buffer
                self.flats.append(flat)
                owned = flat[rank * size:(rank + 1) * size]
            for piece in _pieces(bucket, owned, rank):
                # Weight decay on matrices only, as for the unsharded optimizer.
                (decay if piece.source.dim() >= 2 else no_decay).append(piece)
        super().__init__([{"params": decay, "weight_decay": weight_decay},
                          {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=betas,
                         offload=offload)

    @property
    def pieces(self) -> list[ShardPiece]:
        return [p for group in self.param_groups for p in group["params"]]

    def owned_shards(self) -> list[tuple[str, str, torch.Tensor]]:
        """(name, axis, elements) of each bucket's shard this rank updates (stage 3: the
        store's); the consistency check keeps a checksum of each (``consistency.py``)."""
        if self.store is not None:
            return self.store.owned_shards()
        out = []
        for bucket, flat in zip(self.buckets, self.flats, strict=True):
            size = flat.numel() // bucket.degree
            rank = self.comm.axis_rank(bucket.axis) if bucket.degree > 1 else 0
            out.append((f"bucket{bucket.index}.shard", bucket.axis,
                        flat[rank * size:(rank + 1) * size]))
        return out

    @torch.no_grad()
    def step(self, closure: None = None) -> None:  # type: ignore[override]
        super().step()
        if self.store is not None:
            self.store.after_step()
            return
        for bucket, flat in zip(self.buckets, self.flats, strict=True):
            size = flat.numel() // bucket.degree
            rank = self.comm.axis_rank(bucket.axis) if bucket.degree > 1 else 0
            mine = flat[rank * size:(rank + 1) * size].clone()
            self.comm.all_gather_into(flat, mine, axis=bucket.axis)
