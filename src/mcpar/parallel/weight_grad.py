"""The backward split in two: B (the input's gradient, on the pipeline's critical path) now,
W (the weight gradients of the linear layers) later, as the zero-bubble schedules order them.

Mechanism: each linear layer of a chunk that runs under a split schedule computes its output
with its weight (and bias) detached from autograd, so autograd's backward of the chunk (the B
task) produces the gradient of the chunk's input and of every non-linear parameter (norms,
embeddings, experts' batched weights) but not the linear weights'. A small autograd Function on
the layer's output keeps, during that backward, the layer's input and the gradient of its
output in the store, under the (chunk, micro-batch) of the B task running. The W task of that
(chunk, micro-batch) computes ``grad_out^T @ input`` (and the bias' sum) per layer and hands it
to autograd on the weight itself (``torch.autograd.backward``), so the gradient accumulates into
``.grad`` and the gradient sync's post-accumulate hooks fire exactly as after a plain backward.

Why here and not autograd's graph (the input-path / weight-path split of
``torch.distributed.pipelining``): the inputs a W needs are saved with ``save_for_backward``,
so under activation recompute they are the recomputed ones and nothing else is kept; the weight
path never runs twice; and the layers that are not linear need nothing.

Numerics: the input's gradient is autograd's own (the same kernel as an unsplit backward); a
weight's gradient is the same product computed by one ``mm`` here instead of inside autograd's
linear backward, so per-step losses match an unsplit backward to rounding (the tests hold them
within 1e-6), and exactly where the two products take the same kernel.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

Key = tuple[int, int]  # (local chunk, micro-batch)


class WeightGradStore:
    """The weight-gradient work of the backward passes run split, until their W task."""

    def __init__(self) -> None:
        self.capturing: Key | None = None  # the B task running, if any
        # (layer, its input, its output's gradient, whether W computes the bias' gradient too);
        # the tensors as ``pack`` returned them.
        self._pending: dict[Key, list[tuple[nn.Module, Any, Any, bool]]] = {}
        # What the store keeps is activation memory between a B and its W: a memory meter sets
        # these to its saved-tensor pack / unpack so that it counts them
        # (``controllers/memory/measure.py``).
        self.pack: Callable[[torch.Tensor], Any] = _identity
        self.unpack: Callable[[Any], torch.Tensor] = _identity

    def keep(self, layer: nn.Module, x: torch.Tensor, grad_out: torch.Tensor,
             with_bias: bool) -> None:
        if self.capturing is None:
            raise RuntimeError("a split linear layer ran its backward outside a B task: under "
                               "a zero-bubble schedule every backward is the executor's")
        self._pending.setdefault(self.capturing, []).append(
            (layer, self.pack(x), self.pack(grad_out), with_bias))

    def run(self, key: Key) -> None:
        """The W task of ``key``: every weight gradient its B kept, accumulated into .grad."""
        for layer, packed_x, packed_grad, with_bias in self._pending.pop(key, []):
            x, grad_out = self.unpack(packed_x), self.unpack(packed_grad)
            weight: torch.Tensor = layer.weight  # type: ignore[assignment]
            bias: torch.Tensor | None = layer.bias if with_bias else None  # type: ignore[assignment]
            g2 = grad_out.reshape(-1, grad_out.shape[-1])
            x2 = x.reshape(-1, x.shape[-1]).to(g2.dtype)
            tensors = [weight]
            grads = [g2.t().mm(x2).to(weight.dtype)]
            if bias is not None:
                tensors.append(bias)
                grads.append(g2.sum(0).to(bias.dtype))
            torch.autograd.backward(tensors, grads)
            del x, grad_out, packed_x, packed_grad  # released now, not at the next layer

    def pending(self) -> int:
        return sum(len(v) for v in self._pending.values())

    def clear(self) -> None:
        self._pending.clear()
        self.capturing = None


def _identity(t: Any) -> Any:
    return t


class _KeepForWeightGrad(torch.autograd.Function):
    """Identity on a linear layer's output; in backward, keeps (input, output gradient)."""

    @staticmethod
    def forward(ctx: Any, out: torch.Tensor, x: torch.Tensor, layer: nn.Module,
                store: WeightGradStore, with_bias: bool) -> torch.Tensor:
        ctx.save_for_backward(x)
        ctx.layer, ctx.store, ctx.with_bias = layer, store, with_bias
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (x,) = ctx.saved_tensors
        ctx.store.keep(ctx.layer, x, grad_out, ctx.with_bias)
        return grad_out, None, None, None, None


def split_linear(layer: nn.Module, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """``layer``'s linear map of ``x``; its weight gradient deferred when the layer is split.
    ``bias=False``: the caller adds the bias itself (a row-parallel layer, after its reduce)."""
    weight: torch.Tensor = layer.weight  # type: ignore[assignment]
    b: torch.Tensor | None = layer.bias if bias else None  # type: ignore[assignment]
    store: WeightGradStore | None = getattr(layer, "weight_grad_store", None)
    if store is None or not torch.is_grad_enabled():
        return F.linear(x, weight, b)
    device = x.device.type
    if torch.is_autocast_enabled(device):
        # The input autocast would cast (and autograd save): W keeps that copy, not a second.
        x = x.to(torch.get_autocast_dtype(device))
    out = F.linear(x, weight.detach(), None if b is None else b.detach())
    return _KeepForWeightGrad.apply(out, x, layer, store, b is not None)


def _split_linear_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return split_linear(self, x)


def split_weight_grads(chunk: nn.Module, store: WeightGradStore,
                       keep_whole: nn.Module | None = None) -> list[nn.Parameter]:
    """Defer the weight gradients of ``chunk``'s linear layers to ``store``; the parameters
    whose gradients now come from W tasks (the others still come from B). The layers inside
    ``keep_whole`` keep their whole backward in B: the trainer passes the output head, whose
    output gradient ([tokens, vocab], the step's largest tensor) would otherwise be held from
    each B to its W. Measured peak activations over ranks at pipeline 4, m 8, against 1F1B's:
    a 4-layer, hidden-64 GPT (one block per stage, so the last stage's logits dominate) 1.44x
    with the head deferred, 1.21x with it kept whole; the bubble bench's 8-layer, hidden-128
    GPT 1.03x.

    ``nn.Linear`` layers get this forward; a layer of mcpar's own that calls ``split_linear``
    (the tensor-parallel linears) opts in by having a ``weight_grad_store`` attribute, and says
    with ``defers_bias`` whether its bias goes through the split product (a row-parallel layer
    adds it after its reduce, so B computes that gradient)."""
    deferred: list[nn.Parameter] = []
    whole = {id(m) for m in keep_whole.modules()} if keep_whole is not None else set()
    for module in chunk.modules():
        if id(module) in whole:
            continue
        if isinstance(module, nn.Linear):
            module.forward = types.MethodType(_split_linear_forward, module)  # type: ignore[method-assign]
        elif not hasattr(module, "weight_grad_store"):
            continue
        module.weight_grad_store = store
        owned = (module.weight, module.bias) if getattr(module, "defers_bias", True) \
            else (module.weight,)
        deferred += [p for p in owned if isinstance(p, nn.Parameter) and p.requires_grad]
    return deferred
