"""Tensor parallelism (Megatron-style), with optional sequence parallelism.

Mechanism. Within a block, the first linear of each pair is split by output features
(column-parallel) and the second by input features (row-parallel), so the activation between them
stays local and the pair costs one reduction of its output:

- attention: a fused q|k|v projection keeps, for each of q, k and v, the rows of heads
  [r*H/tp, (r+1)*H/tp); attention then runs on H/tp local heads; the output projection takes
  their columns;
- MLP: the first linear keeps a slice of the inner features, the second the matching input
  columns;
- token embedding: each rank holds a vocabulary slice, looks up only the ids it owns (zeros
  elsewhere) and the partial sums are reduced; a learned position embedding stays replicated and
  is added after the reduction;
- output head: split over the vocabulary and never gathered: it returns local logits
  [batch, seq, V/tp], which ``vocab_parallel_cross_entropy`` turns into the exact loss with three
  small reductions over [batch, seq] instead of gathering [batch, seq, V].

Which modules those are is the model's business: its spec carries a ``TensorParallelPlan``
(mcpar.models.plan) of dotted paths inside each piece (a block's fused q|k|v linear, fused 3;
the embedding's table; the head's output linear), and ``apply_tensor_parallel`` only follows
the plan. Nothing here names a model's attributes.

Two conjugate operators carry the communication. Without sequence parallelism the residual
stream is replicated: ``f`` (before a column-parallel linear) is identity forward / all-reduce
backward, ``g`` (after a row-parallel linear) is all-reduce forward / identity backward. With
sequence parallelism the residual stream is split along the sequence (dim 1 of [batch, seq,
hidden]): ``f`` all-gathers along the sequence (reduce-scatter backward) and ``g`` reduce-scatters
(all-gather backward); an all-reduce is a reduce-scatter plus an all-gather, so the bytes are the
same, but LayerNorm, dropout and the residual adds run on 1/tp of the tokens and their activations
take 1/tp of the memory.

Why hand-written rather than DTensor / ``parallelize_module``: every collective must go through
mcpar's Communicator, on the "tp" axis, so that bytes and time are counted per axis and
the collectives can later be compressed or run hierarchically. DTensor issues its collectives from
inside its dispatch, where the controller cannot see, count or replace them. The pieces are few
(four autograd Functions, four modules, one loss), and the shapes stay plain tensors.

Contracts for the rest of the job:
- ``is_tp_sharded(p)``: p holds this rank's slice (gradient norms must sum its squares over tp;
  checkpoints must gather or save it per rank). Every other parameter is replicated over tp.
- under sequence parallelism, replicated parameters that act on the sequence shard (LayerNorms,
  position embedding, row-parallel biases) have partial gradients on each rank: call
  ``sync_sequence_parallel_grads`` after the backward pass (after the data-parallel gradient
  sync has completed, since both write the same ``.grad``) and before clipping or the step.
- dropout on the replicated stream (no sequence parallelism) needs the same RNG state on every tp
  rank, or the replicas would diverge; with the same seed and the same calls it stays in step.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.parallel.weight_grad import WeightGradStore, split_linear

SEQ_DIM = 1  # activations are [batch, seq, hidden]
TP_SHARDED_ATTR = "_mcpar_tp_sharded"
SEQUENCE_PARALLEL_ATTR = "_mcpar_sequence_parallel"


def is_tp_sharded(p: nn.Parameter) -> bool:
    """True when `p` holds this rank's slice of a parameter split over the tp axis."""
    return bool(getattr(p, TP_SHARDED_ATTR, False))


# --- the communication operators ------------------------------------------------------------
# The comm controller rides along as a non-tensor argument; autograd returns None for it.

class _CopyToTensorParallel(torch.autograd.Function):
    """f without SP: the replicated input feeds every rank's slice; their gradients add up."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        # The all-reduce works in place and needs a dense buffer: never touch autograd's tensor.
        grad = grad.clone(memory_format=torch.contiguous_format)
        ctx.comm.all_reduce(grad, axis="tp", op="sum")
        return grad, None


class _ReduceFromTensorParallel(torch.autograd.Function):
    """g without SP: sum the partial outputs; the (replicated) gradient passes through."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        out = x.clone(memory_format=torch.contiguous_format)
        comm.all_reduce(out, axis="tp", op="sum")
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _GatherAlongSequence(torch.autograd.Function):
    """f with SP: every rank needs the whole sequence; each keeps the sum of its shard's grads."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return comm.all_gather_along(x, SEQ_DIM, axis="tp")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.reduce_scatter_along(grad, SEQ_DIM, axis="tp"), None


class _ReduceScatterAlongSequence(torch.autograd.Function):
    """g with SP: sum the partial outputs but keep only this rank's sequence shard."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:
        ctx.comm = comm
        return comm.reduce_scatter_along(x, SEQ_DIM, axis="tp")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.comm.all_gather_along(grad, SEQ_DIM, axis="tp"), None


def _enter_parallel_region(x: torch.Tensor, comm: Communicator,
                           sequence_parallel: bool) -> torch.Tensor:
    if comm.axis_size("tp") == 1:
        return x
    fn = _GatherAlongSequence if sequence_parallel else _CopyToTensorParallel
    return fn.apply(x, comm)


def _leave_parallel_region(x: torch.Tensor, comm: Communicator,
                           sequence_parallel: bool) -> torch.Tensor:
    if comm.axis_size("tp") == 1:
        return x
    fn = _ReduceScatterAlongSequence if sequence_parallel else _ReduceFromTensorParallel
    return fn.apply(x, comm)


def enter_tensor_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """f on a replicated input (identity forward, gradient summed over tp backward)."""
    return _enter_parallel_region(x, comm, sequence_parallel=False)


def leave_tensor_parallel(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """g on partial outputs (summed over tp forward, identity backward)."""
    return _leave_parallel_region(x, comm, sequence_parallel=False)


# --- sharded modules ------------------------------------------------------------------------

class ColumnParallelLinear(nn.Module):
    """y[..., local outputs] = f(x) @ W_local^T + b_local: this rank's slice of the outputs."""

    # Set by ``split_weight_grads`` under a schedule that splits the backward.
    weight_grad_store: WeightGradStore | None = None
    defers_bias = True  # the bias' gradient is W's too

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 comm: Communicator, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.comm = comm
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter_parallel_region(x, self.comm, self.sequence_parallel)
        return split_linear(self, x)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"in={inp}, local_out={out}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = g(x_local @ W_local^T) + b: partial products summed over tp, then the whole bias."""

    weight_grad_store: WeightGradStore | None = None
    # The bias is added after the reduction, outside the split product: B computes its gradient.
    defers_bias = False

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 comm: Communicator, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.comm = comm
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _leave_parallel_region(split_linear(self, x, bias=False), self.comm,
                                   self.sequence_parallel)
        # Added after the reduction, or every rank's copy would be counted tp times.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"local_in={inp}, out={out}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding table split over the vocabulary: this rank holds rows
    ``[tp_rank*V/tp, (tp_rank+1)*V/tp)``, looks up only the ids it owns (zeros elsewhere) and the
    partial lookups are summed over tp (reduce-scattered along the sequence under SP)."""

    def __init__(self, weight: nn.Parameter, comm: Communicator, tp_rank: int,
                 sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.comm = comm
        self.tp_rank = tp_rank
        self.sequence_parallel = sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local_vocab = self.weight.shape[0]
        local_ids = tokens - self.tp_rank * local_vocab
        foreign = (local_ids < 0) | (local_ids >= local_vocab)
        # Another rank owns these ids: look up a valid row, then zero it, so the sum over tp
        # holds exactly one embedding per token.
        x = F.embedding(local_ids.masked_fill(foreign, 0), self.weight)
        x = x.masked_fill(foreign.unsqueeze(-1), 0.0)
        return _leave_parallel_region(x, self.comm, self.sequence_parallel)

    def extra_repr(self) -> str:
        rows, dim = self.weight.shape
        return f"local_vocab={rows}, dim={dim}, sequence_parallel={self.sequence_parallel}"


class SequenceShardPositions(nn.Module):
    """A replicated position embedding under sequence parallelism: of the position ids of the
    whole sequence it is given, it looks up only those of this rank's shard
    ``[tp_rank*seq/tp, (tp_rank+1)*seq/tp)`` (the rows the sharded activations hold). It keeps
    the table's Parameter, so parameter names stay those of the full model."""

    def __init__(self, table: nn.Embedding, tp_rank: int, tp: int):
        super().__init__()
        self.weight = table.weight
        self.tp_rank, self.tp = tp_rank, tp
        self.lookup_options = dict(padding_idx=table.padding_idx, max_norm=table.max_norm,
                                   norm_type=table.norm_type,
                                   scale_grad_by_freq=table.scale_grad_by_freq,
                                   sparse=table.sparse)

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        seq = positions.shape[-1]
        local = positions.narrow(-1, self.tp_rank * seq // self.tp, seq // self.tp)
        return F.embedding(local, self.weight, **self.lookup_options)


# --- applying it ----------------------------------------------------------------------------
# A plan (mcpar.models.plan, carried by the model's spec) names the modules by dotted paths
# relative to a piece of the model; these helpers are the only way this file reaches into it.

def resolve(root: nn.Module, path: str) -> Any:
    """The attribute at dotted ``path`` below ``root`` (``""``: root itself); None if a module
    on the way is None (an optional submodule the model does not have). A name that does not
    exist is an error: the plan does not describe this model."""
    if not path:
        return root
    target: Any = root
    for name in path.split("."):
        if not hasattr(target, name):
            raise ValueError(f"{type(root).__name__} has no '{path}' ('{name}' is missing): "
                             "the model's parallel plan does not match its modules")
        target = getattr(target, name)
        if target is None:
            return None
    return target


def replace(root: nn.Module, path: str, value: Any) -> None:
    """Set the attribute at dotted ``path`` below ``root`` (a module or a plain value)."""
    owner, _, name = path.rpartition(".")
    setattr(resolve(root, owner) if owner else root, name, value)


def _shard(tensor: torch.Tensor, dim: int, tp_rank: int, tp: int) -> nn.Parameter:
    # A copy, not a view: the full tensor can then be freed.
    piece = tensor.detach().chunk(tp, dim=dim)[tp_rank].clone()
    p = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    setattr(p, TP_SHARDED_ATTR, True)
    return p


def _shard_per_projection(tensor: torch.Tensor, fused: int, tp_rank: int,
                          tp: int) -> nn.Parameter:
    """Rows of ``fused`` projections stacked in one weight or bias (q|k|v): the same slice of
    each projection."""
    if fused == 1:
        return _shard(tensor, 0, tp_rank, tp)
    stacked = tensor.detach().view(fused, tensor.shape[0] // fused, *tensor.shape[1:])
    piece = stacked.chunk(tp, dim=1)[tp_rank].reshape(-1, *tensor.shape[1:]).clone()
    p = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    setattr(p, TP_SHARDED_ATTR, True)
    return p


def _mark_sequence_parallel(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        setattr(p, SEQUENCE_PARALLEL_ATTR, True)


def _check_block(index: int, block: nn.Module, plan: Any, tp: int) -> None:
    for path in plan.heads:
        heads = resolve(block, path)
        if heads % tp:
            raise ValueError(f"block {index}: {heads} attention heads ({path}) are not divisible "
                             f"by tensor-parallel degree {tp}")
    for column in plan.column:
        linear = resolve(block, column.path)
        if linear is None:
            continue
        if isinstance(linear, ColumnParallelLinear):
            raise ValueError("the module is already tensor-parallel")
        width = linear.weight.shape[0] // column.fused
        if width % tp:
            raise ValueError(f"block {index}: {column.path} width {width} is not divisible by "
                             f"tensor-parallel degree {tp}")
    for path in plan.row:
        linear = resolve(block, path)
        width = 0 if linear is None else linear.weight.shape[1]
        if width % tp:
            raise ValueError(f"block {index}: {path} input width {width} is not divisible by "
                             f"tensor-parallel degree {tp}")


def _validate(pieces: tuple, plan: Any, comm: Communicator, tp_rank: int, tp: int,
              sequence_parallel: bool) -> None:
    embedding, blocks, head = pieces[:3]
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp})")
    for i, block in enumerate(blocks):
        _check_block(i, block, plan.block, tp)
    table = resolve(embedding, plan.embedding.vocab) if embedding is not None else None
    if embedding is not None and not isinstance(table, nn.Embedding):
        raise ValueError(f"cannot shard embedding {type(table).__name__} "
                         f"({plan.embedding.vocab}) over the vocabulary")
    vocab = (table.num_embeddings if table is not None
             else resolve(head, plan.output.projection).weight.shape[0] if head is not None else 0)
    if vocab % tp:
        raise ValueError(f"vocabulary size {vocab} is not divisible by tensor-parallel degree {tp}")
    # A stage without the embedding cannot see seq_len; reduce_scatter_along checks it at run time.
    if sequence_parallel and embedding is not None and plan.embedding.positions is not None:
        seq_len = resolve(embedding, plan.embedding.positions).num_embeddings
        if seq_len % tp:
            raise ValueError(f"sequence parallelism: seq_len {seq_len} is not divisible by "
                             f"tensor-parallel degree {tp}")
    if comm is not None and dist.is_initialized() and (comm.axis_size("tp") != tp
                                  or comm.dims.axis_rank("tp") != tp_rank):
        raise ValueError(f"tp rank {tp_rank} of {tp} does not match the mesh: rank "
                         f"{comm.dims.axis_rank('tp')} of {comm.axis_size('tp')}")


def shard_block(block: nn.Module, plan: Any, comm: Communicator, tp_rank: int, tp: int,
                sequence_parallel: bool) -> None:
    """Shard, in place, the linears a ``BlockPlan`` names below ``block``: column-parallel ones
    by output features (fused projections each on their own), row-parallel ones by input
    features; divide its head counts by tp; under SP, mark its norms and row-parallel biases
    (replicated, acting on a sequence shard). A path through a None module is skipped."""
    sp = sequence_parallel
    for column in plan.column:
        linear = resolve(block, column.path)
        if linear is None:
            continue
        bias = (None if linear.bias is None
                else _shard_per_projection(linear.bias, column.fused, tp_rank, tp))
        replace(block, column.path, ColumnParallelLinear(
            _shard_per_projection(linear.weight, column.fused, tp_rank, tp), bias, comm, sp))
    for path in plan.row:
        linear = resolve(block, path)
        if linear is None:
            continue
        replace(block, path, RowParallelLinear(_shard(linear.weight, 1, tp_rank, tp),
                                               linear.bias, comm, sp))
        if sp and linear.bias is not None:
            _mark_sequence_parallel([linear.bias])
    for path in plan.heads:
        replace(block, path, resolve(block, path) // tp)
    if sp:
        for path in plan.norms:
            _mark_sequence_parallel(resolve(block, path).parameters())


def apply_tensor_parallel(stage: nn.Module, plan: Any, comm: Communicator, tp_rank: int,
                          tp: int, sequence_parallel: bool) -> None:
    """Replace, in place, the modules that ``plan`` (a ``TensorParallelPlan`` of the model's
    spec) names in the pieces of ``stage`` (a ``StageModule``; a whole model is the one stage
    of ``cut_model(model, [(0, layers)], 0)``) with this rank's tp shards.

    The stage must hold the full, initialized model's pieces (the same on every rank).
    Afterwards it computes the same function as before, except that the head (if any) returns
    local logits [batch, seq, vocab/tp] for ``vocab_parallel_cross_entropy``, and under sequence
    parallelism activations between pieces are [batch, seq/tp, hidden].
    """
    pieces = stage.pieces()
    _validate(pieces, plan, comm, tp_rank, tp, sequence_parallel)
    embedding, blocks, head, names = pieces
    sp = sequence_parallel

    def swap(piece: int, path: str, module: nn.Module) -> None:
        # An empty path is the piece itself (an embedding piece that is the bare table).
        if path:
            replace(pieces[piece], path, module)
        else:
            setattr(stage, names[piece], module)

    table = resolve(embedding, plan.embedding.vocab) if embedding is not None else None
    output = resolve(head, plan.output.projection) if head is not None else None
    tied = table is not None and output is not None and output.weight is table.weight

    if embedding is not None:
        table_shard = _shard(table.weight, 0, tp_rank, tp)
        swap(0, plan.embedding.vocab, VocabParallelEmbedding(table_shard, comm, tp_rank, sp))
        if sp and plan.embedding.positions is not None:
            positions = resolve(embedding, plan.embedding.positions)
            _mark_sequence_parallel(positions.parameters())
            swap(0, plan.embedding.positions, SequenceShardPositions(positions, tp_rank, tp))

    for block in blocks:
        shard_block(block, plan.block, comm, tp_rank, tp, sp)

    if head is not None:
        # Tied: the embedding's vocabulary slice is exactly the head's, so one Parameter serves.
        weight = table_shard if tied else _shard(output.weight, 0, tp_rank, tp)
        bias = None if output.bias is None else _shard(output.bias, 0, tp_rank, tp)
        swap(2, plan.output.projection, ColumnParallelLinear(weight, bias, comm, sp))
        if sp:
            for path in plan.output.norms:
                _mark_sequence_parallel(resolve(head, path).parameters())
    # Without SP nothing needs a gradient sync over tp: every replicated parameter sees the full,
    # identical activations and, thanks to f's all-reduce, the full, identical upstream gradient.


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, local_logits: torch.Tensor, targets: torch.Tensor,
                comm: Communicator, tp_rank: int) -> torch.Tensor:
        logits = local_logits.float()
        local_vocab = logits.shape[-1]
        # The global max keeps exp() in range. It cancels out of the loss, so it is a constant
        # for autograd.
        logits_max = logits.amax(dim=-1)
        comm.all_reduce(logits_max, axis="tp", op="max")
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()

        local_targets = targets - tp_rank * local_vocab
        owned = (local_targets >= 0) & (local_targets < local_vocab)
        local_targets = local_targets.masked_fill(~owned, 0)
        target_logit = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1)
        # Exactly one rank owns each target; the others contribute 0 to the sum.
        target_logit = target_logit.masked_fill(~owned, 0.0)

        # Both sums in one collective: one latency instead of two, the same bytes.
        sums = torch.stack([exp.sum(dim=-1), target_logit])
        comm.all_reduce(sums, axis="tp", op="sum")
        sum_exp, target_logit = sums[0], sums[1]
        loss = (sum_exp.log() - target_logit).mean()

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_targets, owned)
        ctx.num_tokens = targets.numel()
        ctx.input_dtype = local_logits.dtype
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_targets, owned = ctx.saved_tensors
        # d loss / d logit = softmax - onehot(target); the onehot lives on the owning rank only.
        onehot = owned.to(softmax.dtype).unsqueeze(-1)
        grad = softmax.scatter_add(-1, local_targets.unsqueeze(-1), -onehot)
        grad = grad * (grad_loss / ctx.num_tokens)
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(local_logits: torch.Tensor, targets: torch.Tensor,
                                 comm: Communicator, tp_rank: int,
                                 tp: int) -> torch.Tensor:
    """Mean token cross-entropy from vocabulary-sharded logits, without gathering them.

    `local_logits` [batch, seq, vocab/tp] are this rank's columns ``[tp_rank*vocab/tp, ...)``;
    `targets` [batch, seq] are the full target ids, the same on every tp rank. With tp == 1 this
    equals ``F.cross_entropy`` on the flattened logits.
    """
    if targets.shape != local_logits.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match logits "
                         f"{tuple(local_logits.shape)} without their vocabulary dim")
    if not 0 <= tp_rank < tp:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp})")
    return _VocabParallelCrossEntropy.apply(local_logits, targets, comm, tp_rank)


def sync_sequence_parallel_grads(params: Iterable[nn.Parameter],
                                 comm: Communicator) -> None:
    """Sum over tp the partial gradients of replicated parameters that act on sequence shards.

    One flat buffer, one all-reduce. No-op when tp is 1 or no parameter is marked (no sequence
    parallelism).
    """
    if comm.axis_size("tp") == 1:
        return
    seen: set[int] = set()
    marked: list[nn.Parameter] = []
    for p in params:
        if getattr(p, SEQUENCE_PARALLEL_ATTR, False) and p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            marked.append(p)
    if not marked:
        return
    for p in marked:
        # Every rank must send a buffer of the same size; a missing gradient is a zero one.
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = torch.cat([p.grad.reshape(-1) for p in marked])
    comm.all_reduce(flat, axis="tp", op="sum")
    offset = 0
    for p in marked:
        n = p.grad.numel()
        # copy_ rather than rebinding .grad: it may be a view into a data-parallel bucket.
        p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
        offset += n
