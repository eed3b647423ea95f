"""Global gradient-norm clipping over a tensor- and pipeline-parallel model.

``torch.nn.utils.clip_grad_norm_`` sees only this rank's parameters. The true norm sums the squares
of every parameter once: tensor-sharded parameters are summed over the tensor axis, replicated ones
(identical on every tensor rank once their gradients are synchronized) are counted once, and
stages add up over the pipeline axis; expert-parallel weights add up over the expert axis (and
the tensor axis, which splits their width). Data-parallel replicas already hold the same averaged
gradients, so that axis is left alone, except under ZeRO (``data_sharded``), where each replica
holds its own shard of them: the sums then add up over the shards' axis ('dp', or 'dp_cp'
under context parallelism; experts: over their replicas, 'edp') too.
"""

from __future__ import annotations

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.parallel.expert import is_expert_sharded
from mcpar.parallel.tensor import is_tp_sharded


def stage_sum_of_squares(params: list[nn.Parameter], comm: Communicator,
                         data_sharded: bool = False, shard_axis: str = "dp") -> torch.Tensor:
    """The sum of the squares of the gradients of this rank's pipeline stage (float64, one
    element): summed over the axes inside the stage (tensor, ZeRO's shards, experts), not over
    the pipeline. ``shard_axis``: what ZeRO shards the dense gradients over ('dp', or 'dp_cp'
    under context parallelism: the MemoryController's plan says)."""
    dense = [p for p in params if p.grad is not None and not is_expert_sharded(p)]
    sharded = [p.grad for p in dense if is_tp_sharded(p)]
    replicated = [p.grad for p in dense if not is_tp_sharded(p)]
    experts = [p.grad for p in params if p.grad is not None and is_expert_sharded(p)]

    def sum_of_squares(tensors: list[torch.Tensor]) -> torch.Tensor:
        if not tensors:
            return torch.zeros(1, dtype=torch.float64)
        norm = torch.nn.utils.get_total_norm(tensors, norm_type=2.0, foreach=True)
        return norm.detach().double().pow(2).reshape(1).cpu()

    total = sum_of_squares(sharded)
    comm.all_reduce(total, axis="tp")
    total += sum_of_squares(replicated)
    if data_sharded:
        comm.all_reduce(total, axis=shard_axis)
    if experts:
        # Expert weights are split over ep (different experts) and, under tp, by width.
        expert_total = sum_of_squares(experts)
        comm.all_reduce(expert_total, axis="tp")
        comm.all_reduce(expert_total, axis="ep")
        if data_sharded:
            comm.all_reduce(expert_total, axis="edp")
        total += expert_total
    return total


def clip_with_norm(params: list[nn.Parameter], max_norm: float, norm: torch.Tensor) -> None:
    """Scale the gradients by torch's clip coefficient for the global ``norm`` (0: no clip)."""
    grads = [p.grad for p in params if p.grad is not None]
    if max_norm > 0 and grads:
        # torch's own scaling step, given the norm over the whole mesh.
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm.to(grads[0].device),
                                            foreach=True)


def clips(max_norm: float, norm: float) -> bool:
    """Whether ``clip_with_norm`` changes the gradients: torch's coefficient
    ``max_norm / (norm + 1e-6)``, clamped at 1, is below 1 (at 1 the scaling multiplies by one,
    which changes no value)."""
    return max_norm > 0 and max_norm / (norm + 1e-6) < 1.0  # float64, as torch computes it


def clip_grad_norm(params: list[nn.Parameter], max_norm: float,
                   comm: Communicator, data_sharded: bool = False,
                   shard_axis: str = "dp") -> float:
    """Scale gradients so that their global norm is at most `max_norm` (0 = don't clip).
    ``shard_axis``: as ``stage_sum_of_squares``.

    Returns the global norm before clipping.
    """
    total = stage_sum_of_squares(params, comm, data_sharded, shard_axis)
    comm.all_reduce(total, axis="pp")
    norm = total.sqrt().squeeze(0)
    clip_with_norm(params, max_norm, norm)
    return float(norm)
