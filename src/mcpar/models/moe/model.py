"""MoE: the GPT of ``models/gpt`` whose blocks route each token to top-k of E expert MLPs.

Each block's MLP is a ``MoELayer``:

- ``Router``: a linear gate scores every expert, with a softmax over experts (Switch) or a sigmoid
  per expert (DeepSeek-V3). The top-k experts are chosen on ``score + expert_bias``; the bias
  (a buffer, never trained by gradients) is the auxiliary-loss-free balancing of DeepSeek-V3: after
  each step it moves every expert by ``router_bias_update_rate`` towards balance, by the sign of
  its load error over the global batch. The chosen experts' *unbiased* scores weight their
  outputs (renormalized to sum 1 when top_k > 1).
- Switch-style auxiliary loss ``E / (k S) * sum_e f_e P_e``, computed per sequence and averaged
  over sequences (DeepSeek-V3's sequence-wise form): a mean over sequences splits over micro-batches
  and data-parallel ranks exactly as the language-model loss does, so every layout computes the
  same loss. It enters the backward pass through ``_AddAuxLossGrad`` (the output is unchanged, the
  loss's gradient is injected), so pipeline stages need not carry it to the last stage. Under
  context parallelism a rank sees 1/n of every sequence: the expert counts are summed over the
  context ranks (``sum_over_context``), and since the loss is linear in the mean probabilities,
  each rank takes its tokens' share of them; the shares add up to the sequence's loss, which the
  gradient exchange's average over the context ranks would divide by n, so each share counts n
  times.
- Capacity: with ``capacity_factor`` each expert takes at most ``ceil(cf x T x k / E)`` of the T
  tokens of one rank's micro-batch, in token order; the rest are dropped (their residual passes
  unchanged) and counted. ``None`` is dropless.
- ``Experts``: E bias-free GELU MLPs stored as two stacked weights ``[E, hidden, ffn]`` and
  ``[E, ffn, hidden]``; rows are sorted by expert. Where the device and torch have it (CUDA,
  ``device.grouped_mm_unavailable``), all experts run as one grouped matmul per weight, whose
  group offsets stay on the device (no host synchronization per layer, no graph break under
  ``torch.compile``); elsewhere each expert runs one matmul pair on its rows in a Python loop,
  the fallback and the reference the grouped path is tested against. Expert parallelism
  (parallel/expert.py) swaps this module for one that holds a subset of the experts and
  exchanges the rows with all-to-all; nothing here knows about it.
- optional shared expert: a dense MLP every token goes through (GPT's ``MLP``).

The top-k outputs of a token are combined in a fixed order (slot k = 0, 1, ...) whatever the
placement of experts, so moving experts between ranks does not change the arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mcpar.config import ModelConfig
from mcpar.device import autocast_dtype, grouped_mm, grouped_mm_unavailable
from mcpar.models.gpt.model import GPT, MLP, Block


class _AddAuxLossGrad(torch.autograd.Function):
    """Identity on ``x``; in the backward pass, gives ``aux`` the gradient ``scale``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.aux_shape = aux.shape
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        return grad, torch.full(ctx.aux_shape, ctx.scale, dtype=grad.dtype,
                                device=grad.device), None


class Router(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.score = cfg.router_score
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        # Selection bias of auxiliary-loss-free balancing: saved with the model, not trained.
        self.register_buffer("expert_bias", torch.zeros(cfg.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """For tokens [T, hidden]: (weights [T, k], experts [T, k], scores [T, E])."""
        logits = self.gate(x).float()
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        chosen = torch.topk(scores.detach() + self.expert_bias, self.top_k, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        return weights, chosen, scores


# Which expert kernel runs: "auto" (grouped where ``grouped_mm_unavailable`` allows), or forced
# ("grouped" | "loop") by a test or a benchmark comparing the two on one device.
_KERNEL = {"mode": "auto"}


def set_expert_kernel(mode: str) -> None:
    if mode not in ("auto", "grouped", "loop"):
        raise ValueError(f"expert kernel {mode!r}: auto, grouped or loop")
    _KERNEL["mode"] = mode


def _compute_dtype(rows: torch.Tensor) -> torch.dtype:
    return autocast_dtype(rows.device.type) or rows.dtype


def expert_kernel(device_type: str, dtype: torch.dtype, widths: tuple[int, ...] = ()) -> str:
    """"grouped" or "loop": what ``expert_mlps`` runs for rows of ``dtype`` on this device.
    ``widths``: the weights' matrix sizes (the grouped kernel wants 16-byte aligned strides)."""
    mode = _KERNEL["mode"]
    if mode != "auto":
        return mode
    if any(w * torch.finfo(dtype).bits % 128 for w in widths):
        return "loop"
    return "loop" if grouped_mm_unavailable(device_type, dtype) else "grouped"


def describe_expert_kernel(device_type: str, dtype: torch.dtype) -> str:
    """One line for the log: which kernel the experts use here, and why not grouped."""
    if expert_kernel(device_type, dtype) == "grouped":
        return f"MoE experts: one grouped matmul per weight ({device_type}, {dtype})"
    why = grouped_mm_unavailable(device_type, dtype) or "the matrices are not 16-byte aligned"
    return f"MoE experts: Python loop over the experts (fallback: {why})"


def expert_mlps(rows: torch.Tensor, counts: list[int] | torch.Tensor, fc_weight: torch.Tensor,
                proj_weight: torch.Tensor) -> torch.Tensor:
    """Run expert i's MLP on the i-th run of ``counts[i]`` rows (rows sorted by expert):
    one grouped matmul per weight where available, else the loop (``loop_expert_mlps``).
    ``counts`` may be a device tensor: the grouped path never reads it on the host."""
    dtype = _compute_dtype(rows)
    widths = (fc_weight.shape[-2], fc_weight.shape[-1])
    if expert_kernel(rows.device.type, dtype, widths) == "grouped":
        return grouped_expert_mlps(rows, counts, fc_weight, proj_weight)
    return _loop_eagerly(rows, counts, fc_weight, proj_weight)


@torch.compiler.disable
def _loop_eagerly(rows: torch.Tensor, counts: list[int] | torch.Tensor, fc_weight: torch.Tensor,
                  proj_weight: torch.Tensor) -> torch.Tensor:
    """The loop, never traced by ``torch.compile``: its row counts are data, on which a compiled
    graph would specialize, compiling anew for every routing until dynamo gave up."""
    return loop_expert_mlps(rows, counts if isinstance(counts, list) else counts.tolist(),
                            fc_weight, proj_weight)


def grouped_expert_mlps(rows: torch.Tensor, counts: list[int] | torch.Tensor,
                        fc_weight: torch.Tensor, proj_weight: torch.Tensor) -> torch.Tensor:
    """All experts' MLPs as two grouped matmuls; the groups end at ``cumsum(counts)``. An
    expert with no rows is an empty group; the output stays connected to ``rows``."""
    dtype = _compute_dtype(rows)
    if isinstance(counts, list):
        counts = torch.tensor(counts, dtype=torch.int32).to(rows.device, non_blocking=True)
    offsets = counts.cumsum(0).to(torch.int32)
    hidden = F.gelu(grouped_mm(rows.to(dtype), fc_weight.to(dtype), offsets))
    return grouped_mm(hidden, proj_weight.to(dtype), offsets)


def loop_expert_mlps(rows: torch.Tensor, counts: list[int], fc_weight: torch.Tensor,
                     proj_weight: torch.Tensor) -> torch.Tensor:
    """Expert i's MLP on its rows, one expert at a time: the fallback and the reference.

    An expert with no rows still runs (on an empty matrix): the output must stay connected to
    ``rows`` in the autograd graph, or under expert parallelism a rank that received nothing
    would skip the backward all-to-all that its peers wait in."""
    outs = []
    for i, piece in enumerate(rows.split(counts)):
        hidden = F.gelu(piece @ fc_weight[i].to(piece.dtype))
        outs.append(hidden @ proj_weight[i].to(piece.dtype))
    return torch.cat(outs)


class GroupedWeight(nn.Module):
    """One weight per expert, stacked: ``weight`` [E, in, out]."""

    def __init__(self, num_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, in_features, out_features))


class Experts(nn.Module):
    """Every expert on this rank: rows in any order -> each row through its expert's MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts = cfg.num_experts
        self.fc = GroupedWeight(cfg.num_experts, cfg.hidden_size, cfg.ffn_size)
        self.proj = GroupedWeight(cfg.num_experts, cfg.ffn_size, cfg.hidden_size)

    def forward(self, tokens: torch.Tensor, token_index: torch.Tensor,
                expert_index: torch.Tensor) -> torch.Tensor:
        """Rows ``tokens[token_index[i]]`` through expert ``expert_index[i]``, in entry order."""
        order = torch.argsort(expert_index, stable=True)
        # Left on the device: the grouped kernel takes them as offsets, the loop reads them.
        counts = torch.bincount(expert_index, minlength=self.num_experts)
        out = expert_mlps(tokens[token_index[order]], counts, self.fc.weight, self.proj.weight)
        return out[torch.argsort(order)]


class MoELayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.num_experts, self.top_k = cfg.num_experts, cfg.top_k
        self.capacity_factor = cfg.capacity_factor
        self.aux_loss_coef = cfg.aux_loss_coef
        self.router = Router(cfg)
        self.experts = Experts(cfg)
        self.shared = MLP(cfg) if cfg.shared_expert else None
        # Gradient of the auxiliary loss per unit: the trainer sets 1 / micro-batches, the
        # factor it divides the language-model loss by.
        self.aux_grad_scale = 1.0
        # Context parallelism (parallel/context.py): the ranks one sequence is split over, and
        # an in-place sum over them (set by it; nothing here knows the communicator).
        self.context_shards = 1
        self.sum_over_context: Callable[[torch.Tensor], None] | None = None
        # Routing statistics of the current step (training forward passes only), kept on the
        # model's device so that counting them never waits for the device; the routing
        # controller reads them once per step. Not persistent: not part of a checkpoint.
        self.register_buffer("step_counts", torch.zeros(cfg.num_experts, dtype=torch.int64),
                             persistent=False)
        self.register_buffer("step_dropped", torch.zeros((), dtype=torch.int64),
                             persistent=False)

    def _keep_within_capacity(self, experts: torch.Tensor) -> torch.Tensor:
        """Mask of the (token, slot) entries each expert can take, first come first served."""
        num_tokens = experts.shape[0]
        capacity = math.ceil(self.capacity_factor * num_tokens * self.top_k / self.num_experts)
        flat = experts.reshape(-1)
        onehot = F.one_hot(flat, self.num_experts)
        position = (onehot.cumsum(0) * onehot).sum(-1) - 1  # arrival order within its expert
        return position < capacity

    def _aux_loss(self, scores: torch.Tensor, experts: torch.Tensor, batch: int) -> torch.Tensor:
        """Mean over sequences of E / (k S) sum_e count_e P_e (Switch, per sequence)."""
        probs = scores if self.router.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        probs = probs.view(batch, -1, self.num_experts)
        seq = probs.shape[1]
        counts = F.one_hot(experts.view(batch, -1), self.num_experts).sum(1).to(probs.dtype)
        if self.context_shards == 1:
            fraction = counts * self.num_experts / (self.top_k * seq)
            return (fraction * probs.mean(1)).sum(-1).mean()
        assert self.sum_over_context is not None
        self.sum_over_context(counts)  # the whole sequence's counts (no gradient flows there)
        seq *= self.context_shards
        fraction = counts * self.num_experts / (self.top_k * seq)
        share = probs.sum(1) / seq  # this rank's part of the sequence's mean probabilities
        return (fraction * share).sum(-1).mean() * self.context_shards

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, hidden = x.shape
        tokens = x.reshape(-1, hidden)
        weights, experts, scores = self.router(tokens)
        num_tokens = tokens.shape[0]
        token_index = torch.arange(num_tokens, device=x.device).repeat_interleave(self.top_k)
        expert_index = experts.reshape(-1)
        keep = None
        if self.capacity_factor is not None:
            keep = self._keep_within_capacity(experts)
            token_index, expert_index = token_index[keep], expert_index[keep]
        routed = self.experts(tokens, token_index, expert_index)
        if keep is not None:
            full = routed.new_zeros((num_tokens * self.top_k, hidden))
            routed = full.index_put((keep.nonzero().squeeze(1),), routed)
        # Fixed combination order over the k slots, whatever the experts' placement.
        out = (routed.view(num_tokens, self.top_k, hidden)
               * weights.unsqueeze(-1).to(routed.dtype)).sum(1).view(batch, seq, hidden)
        if self.shared is not None:
            out = out + self.shared(x)
        if self.training:
            with torch.no_grad():
                self.step_counts += torch.bincount(experts.reshape(-1),
                                                   minlength=self.num_experts)
                if keep is not None:
                    self.step_dropped += (~keep).sum()
            if self.aux_loss_coef > 0 and torch.is_grad_enabled():
                aux = self.aux_loss_coef * self._aux_loss(scores, experts, batch)
                out = _AddAuxLossGrad.apply(out, aux, self.aux_grad_scale)
        return out

    def reset_step_stats(self) -> None:
        self.step_counts.zero_()
        self.step_dropped.zero_()


def moe_block(cfg: ModelConfig) -> Block:
    """GPT's pre-norm block with a MoE layer as its MLP (same attribute names)."""
    return Block(cfg, mlp=MoELayer)


def build_moe(cfg: ModelConfig, seed: int) -> GPT:
    model = GPT(cfg, block=moe_block)
    model.init_weights(seed)
    return model


def moe_layers(module: nn.Module) -> list[MoELayer]:
    return [m for m in module.modules() if isinstance(m, MoELayer)]


def join_context_routing(layer: MoELayer, shards: int,
                         sum_over_context: Callable[[torch.Tensor], None]) -> None:
    """Context parallelism's hook (``ContextParallelPlan.join_routing``): `layer` sees 1/`shards`
    of every sequence, and `sum_over_context` sums a tensor in place over the context ranks."""
    layer.context_shards = shards
    layer.sum_over_context = sum_over_context
