"""Tensor parallelism (Megatron-style), with optional sequence parallelism.

Mechanism. Within a block, the first linear of each pair is split by output features
(column-parallel) and the second by input features (row-parallel), so the activation between them
stays local and the pair costs one reduction of its output:

- attention: ``qkv`` keeps, for each of q, k and v, the rows of heads
  [r*H/tp, (r+1)*H/tp); attention then runs on H/tp local heads; ``proj`` takes their columns;
- MLP: ``fc`` keeps a slice of the inner features, ``proj`` the matching input columns;
- token embedding: each rank holds a vocabulary slice, looks up only the ids it owns (zeros
  elsewhere) and the partial sums are reduced; the position embedding is added after the reduction;
- output head: split over the vocabulary and never gathered: it returns local logits
  [batch, seq, V/tp], which ``vocab_parallel_cross_entropy`` turns into the exact loss with three
  small reductions over [batch, seq] instead of gathering [batch, seq, V].

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
(four autograd Functions, three modules, one loss), and the shapes stay plain tensors.

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
from mcpar.models.gpt import MLP, TokenEmbedding

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

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 comm: Communicator, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.comm = comm
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _enter_parallel_region(x, self.comm, self.sequence_parallel)
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"in={inp}, local_out={out}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """y = g(x_local @ W_local^T) + b: partial products summed over tp, then the whole bias."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None,
                 comm: Communicator, sequence_parallel: bool):
        super().__init__()
        self.weight = weight
        self.register_parameter("bias", bias)
        self.comm = comm
        self.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _leave_parallel_region(F.linear(x, self.weight), self.comm, self.sequence_parallel)
        # Added after the reduction, or every rank's copy would be counted tp times.
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        out, inp = self.weight.shape
        return (f"local_in={inp}, out={out}, bias={self.bias is not None}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelTokenEmbedding(nn.Module):
    """Token embedding split over the vocabulary, then the replicated position embedding.

    Keeps the attribute names of TokenEmbedding (``tok``, ``pos``, ``dropout``) so parameter
    names, and with them checkpoints and optimizer groups, stay those of the full model.
    """

    def __init__(self, tok: nn.Embedding, pos: nn.Embedding, dropout: nn.Module,
                 comm: Communicator, tp_rank: int, tp: int, sequence_parallel: bool):
        super().__init__()
        self.tok = tok
        self.pos = pos
        self.dropout = dropout
        self.comm = comm
        self.tp_rank = tp_rank
        self.tp = tp
        self.sequence_parallel = sequence_parallel

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        local_vocab = self.tok.num_embeddings
        local_ids = tokens - self.tp_rank * local_vocab
        foreign = (local_ids < 0) | (local_ids >= local_vocab)
        # Another rank owns these ids: look up a valid row, then zero it, so the sum over tp
        # holds exactly one embedding per token.
        x = self.tok(local_ids.masked_fill(foreign, 0)).masked_fill(foreign.unsqueeze(-1), 0.0)
        x = _leave_parallel_region(x, self.comm, self.sequence_parallel)
        seq = tokens.shape[1]
        start, stop = 0, seq
        if self.sequence_parallel:
            # This rank now holds positions [r*seq/tp, (r+1)*seq/tp) of the sequence.
            start, stop = self.tp_rank * seq // self.tp, (self.tp_rank + 1) * seq // self.tp
        positions = torch.arange(start, stop, device=tokens.device)
        return self.dropout(x + self.pos(positions))


# --- applying it ----------------------------------------------------------------------------

def _shard(tensor: torch.Tensor, dim: int, tp_rank: int, tp: int) -> nn.Parameter:
    # A copy, not a view: the full tensor can then be freed.
    piece = tensor.detach().chunk(tp, dim=dim)[tp_rank].clone()
    p = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    setattr(p, TP_SHARDED_ATTR, True)
    return p


def _shard_per_projection(tensor: torch.Tensor, tp_rank: int, tp: int) -> nn.Parameter:
    """Rows q|k|v of a fused QKV weight or bias: the same head slice of each of q, k and v."""
    fused = tensor.detach().view(3, tensor.shape[0] // 3, *tensor.shape[1:])
    piece = fused.chunk(tp, dim=1)[tp_rank].reshape(-1, *tensor.shape[1:]).clone()
    p = nn.Parameter(piece, requires_grad=tensor.requires_grad)
    setattr(p, TP_SHARDED_ATTR, True)
    return p


def _mark_sequence_parallel(params: Iterable[nn.Parameter]) -> None:
    for p in params:
        setattr(p, SEQUENCE_PARALLEL_ATTR, True)


def _validate(module: nn.Module, comm: Communicator, tp_rank: int, tp: int,
              sequence_parallel: bool) -> None:
    if tp < 1 or not 0 <= tp_rank < tp:
        raise ValueError(f"tensor-parallel rank {tp_rank} is not in [0, {tp})")
    for i, block in enumerate(module.blocks):
        if isinstance(block.attn.qkv, ColumnParallelLinear):
            raise ValueError("the module is already tensor-parallel")
        if block.attn.num_heads % tp:
            raise ValueError(f"block {i}: {block.attn.num_heads} attention heads are not "
                             f"divisible by tensor-parallel degree {tp}")
        if isinstance(block.mlp, MLP) and block.mlp.fc.out_features % tp:
            raise ValueError(f"block {i}: MLP width {block.mlp.fc.out_features} is not "
                             f"divisible by tensor-parallel degree {tp}")
    vocab = (module.embed.tok.num_embeddings if module.embed is not None
             else module.head.out.out_features if module.head is not None else 0)
    if vocab % tp:
        raise ValueError(f"vocabulary size {vocab} is not divisible by tensor-parallel degree {tp}")
    if module.embed is not None and not isinstance(module.embed, TokenEmbedding):
        raise ValueError(f"cannot shard embedding {type(module.embed).__name__}")
    # A stage without the embedding cannot see seq_len; reduce_scatter_along checks it at run time.
    if sequence_parallel and module.embed is not None and module.embed.pos.num_embeddings % tp:
        raise ValueError(f"sequence parallelism: seq_len {module.embed.pos.num_embeddings} is "
                         f"not divisible by tensor-parallel degree {tp}")
    if comm is not None and dist.is_initialized() and (comm.axis_size("tp") != tp
                                  or comm.dims.axis_rank("tp") != tp_rank):
        raise ValueError(f"tp rank {tp_rank} of {tp} does not match the mesh: rank "
                         f"{comm.dims.axis_rank('tp')} of {comm.axis_size('tp')}")


def shard_dense_mlp(mlp: nn.Module, comm: Communicator, tp_rank: int, tp: int,
                    sequence_parallel: bool) -> None:
    """An MLP's ``fc`` column-parallel and ``proj`` row-parallel, in place."""
    mlp.fc = ColumnParallelLinear(_shard(mlp.fc.weight, 0, tp_rank, tp),
                                  _shard(mlp.fc.bias, 0, tp_rank, tp), comm, sequence_parallel)
    mlp.proj = RowParallelLinear(_shard(mlp.proj.weight, 1, tp_rank, tp), mlp.proj.bias,
                                 comm, sequence_parallel)
    if sequence_parallel and mlp.proj.bias is not None:
        _mark_sequence_parallel([mlp.proj.bias])


def apply_tensor_parallel(module: nn.Module, comm: Communicator, tp_rank: int, tp: int,
                          sequence_parallel: bool) -> None:
    """Replace, in place, the pieces of a GPT or StageModule with this rank's tp shards.

    The module must hold the full, initialized model (the same on every rank). Afterwards it
    computes the same function as the full model, except that the head (if any) returns local
    logits [batch, seq, vocab/tp] for ``vocab_parallel_cross_entropy``, and under sequence
    parallelism activations between pieces are [batch, seq/tp, hidden].
    """
    _validate(module, comm, tp_rank, tp, sequence_parallel)
    sp = sequence_parallel
    tied = (module.embed is not None and module.head is not None
            and module.head.out.weight is module.embed.tok.weight)

    if module.embed is not None:
        old = module.embed
        tok = nn.Embedding.from_pretrained(_shard(old.tok.weight, 0, tp_rank, tp), freeze=False)
        setattr(tok.weight, TP_SHARDED_ATTR, True)  # from_pretrained wraps it in a new Parameter
        module.embed = VocabParallelTokenEmbedding(tok, old.pos, old.dropout, comm, tp_rank, tp,
                                                   sp)
        if sp:
            _mark_sequence_parallel(old.pos.parameters())

    for block in module.blocks:
        attn, mlp = block.attn, block.mlp
        attn.qkv = ColumnParallelLinear(
            _shard_per_projection(attn.qkv.weight, tp_rank, tp),
            _shard_per_projection(attn.qkv.bias, tp_rank, tp), comm, sp)
        attn.proj = RowParallelLinear(_shard(attn.proj.weight, 1, tp_rank, tp), attn.proj.bias,
                                      comm, sp)
        attn.num_heads //= tp
        # A MoE layer's experts and shared expert are sharded by parallel/expert.py.
        if isinstance(mlp, MLP):
            shard_dense_mlp(mlp, comm, tp_rank, tp, sp)
        if sp:
            _mark_sequence_parallel([*block.ln_attn.parameters(), *block.ln_mlp.parameters()])
            _mark_sequence_parallel(p for p in (attn.proj.bias,) if p is not None)

    if module.head is not None:
        head = module.head
        # Tied: the embedding's vocabulary slice is exactly the head's, so one Parameter serves.
        weight = (module.embed.tok.weight if tied
                  else _shard(head.out.weight, 0, tp_rank, tp))
        head.out = ColumnParallelLinear(weight, None, comm, sp)
        if sp:
            _mark_sequence_parallel(head.ln_final.parameters())
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
