"""Dynamic batch splitting (``controllers.compute.batch_splitting: dynamic``).

The ComputeController measures this rank's forward+backward time at two micro-batch sizes on the
real model (its own pipeline chunks, tensor collectives included), fits
``time(b) = fixed_cost + per_sequence * b``, takes the slowest rank's figures (the pipeline moves at
the pace of its slowest stage), and picks the number of micro-batches that minimizes the modelled
step time within the memory budget (``choose_num_microbatches``). Every rank reaches the same
choice from the same reduced numbers. The choice makes a new plan (``JobPlan.with_split``): the
run directory's ``plan.json`` and ``summary.json`` record it; the config is left as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from mcpar.comm.communicator import Communicator
from mcpar.config import JobConfig
from mcpar.controllers.compute.plan import ComputePlan
from mcpar.device import autocast, memory_budget_bytes, synchronize
from mcpar.registry.schedule import DEFAULT_SCHEDULE, SCHEDULES
from mcpar.sim.memory import format_bytes
from mcpar.topology import ParallelDims

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

REPEATS = 3  # timed repeats per size, after one untimed warm-up
# The forward's share of a forward + backward (the backward computes two gradients).
FORWARD_SHARE = 1 / 3


def modelled_step_time(num_microbatches: int, micro_time_s: float, pp: int,
                       virtual_stages: int, schedule: str) -> float:
    """Step time of `num_microbatches` micro-batches whose forward+backward on one stage takes
    `micro_time_s`: the registered schedule's span over equal stages (m slots of work plus
    the pipeline's fill and drain, for the built-ins)."""
    if pp == 1:
        return num_microbatches * micro_time_s
    return SCHEDULES.get(schedule).span(num_microbatches, micro_time_s, pp * micro_time_s,
                                        [micro_time_s] * pp, virtual_stages, FORWARD_SHARE)


@dataclass
class SplitChoice:
    num_microbatches: int
    micro_batch_size: int
    modelled_step_s: float
    table: list[tuple[int, float, float, bool]]  # (m, step seconds, memory bytes, fits)


def choose_num_microbatches(
    rank_batch: int, fixed_cost_s: float, per_sequence_s: float, pp: int, virtual_stages: int,
    schedule: str, memory_bytes: Callable[[int, int], float], budget_bytes: float,
    allowed: Callable[[int], bool],
) -> SplitChoice:
    """The micro-batch count that minimizes the modelled step time within the memory budget.

    A micro-batch of b sequences is modelled as ``fixed_cost_s + per_sequence_s * b`` (measured):
    fewer, larger micro-batches pay the fixed cost less often but lengthen the pipeline's fill and
    drain and hold more activations. ``memory_bytes(m, b)`` is the per-rank estimate.
    """
    table = []
    for m in range(1, rank_batch + 1):
        if rank_batch % m or not allowed(m):
            continue
        b = rank_batch // m
        step = modelled_step_time(m, fixed_cost_s + per_sequence_s * b, pp, virtual_stages,
                                  schedule)
        mem = memory_bytes(m, b)
        table.append((m, step, mem, mem <= budget_bytes))
    fitting = [row for row in table if row[3]]
    if not fitting:
        raise ValueError("no micro-batch split fits the memory budget")
    m, step, _, _ = min(fitting, key=lambda row: (row[1], row[0]))
    return SplitChoice(m, rank_batch // m, step, table)


def _time_forward_backward(cfg: JobConfig, chunks: list[nn.Module], loss_fn: LossFn,
                           device: torch.device, activation_shape: tuple[int, ...],
                           micro_batch_size: int) -> float:
    """Median seconds of one forward+backward of this rank's chunks on a synthetic micro-batch."""
    gen = torch.Generator().manual_seed(0)
    seq, vocab = cfg.model.seq_len, cfg.model.vocab_size
    tokens = torch.randint(0, vocab, (micro_batch_size, seq), generator=gen).to(device)
    activations = torch.randn(activation_shape, generator=gen).to(device)
    times = []
    for _ in range(REPEATS + 1):
        synchronize(device)
        start = time.perf_counter()
        for chunk in chunks:
            x = tokens if chunk.is_first else activations.clone().requires_grad_(True)
            with autocast(device, cfg.training.dtype):
                out = chunk(x)
            if chunk.is_last:
                loss_fn(out, tokens).backward()
            else:
                out.backward(torch.ones_like(out))
        synchronize(device)
        times.append(time.perf_counter() - start)
    return sorted(times[1:])[len(times[1:]) // 2]


def choose_split(cfg: JobConfig, plan: ComputePlan, budget_gb: float | None, dims: ParallelDims,
                 chunks: list[nn.Module], loss_fn: LossFn,
                 device: torch.device, comm: Communicator, local_world_size: int,
                 activation_shape: Callable[[int], tuple[int, ...]],
                 memory_bytes: Callable[[int, int], float]) -> tuple[SplitChoice, str]:
    """The micro-batch split of ``cfg``'s global batch that this rank and its peers measure
    best (every rank reaches the same choice); and a one-line report. ``memory_bytes(m, b)``:
    the MemoryController's per-rank estimate with m micro-batches of b sequences. The
    gradients the measurement leaves are zeroed; nothing is synchronized (no bucket is armed).
    ``budget_gb``: the MemoryController's budget (None: the device's capacity)."""
    opt = cfg.optimization
    assert opt.global_batch_size is not None
    rank_batch = opt.global_batch_size // dims.dp
    sizes = (1, min(rank_batch, 4))
    try:
        t_small, t_large = (_time_forward_backward(cfg, chunks, loss_fn, device,
                                                   activation_shape(b), b) for b in sizes)
    finally:
        for chunk in chunks:
            for p in chunk.parameters():
                if p.grad is not None:
                    p.grad.zero_()  # in place: a gradient is a view into its bucket
    per_sequence = max(0.0, (t_large - t_small) / (sizes[1] - sizes[0])) if sizes[1] > 1 else 0.0
    fixed = max(0.0, t_small - per_sequence)
    figures = torch.tensor([fixed, per_sequence], dtype=torch.float64)
    comm.all_reduce(figures, axis="world", op="max")
    fixed, per_sequence = float(figures[0]), float(figures[1])

    budget = budget_gb * 2**30 if budget_gb else memory_budget_bytes(device, local_world_size)

    choice = choose_num_microbatches(rank_batch, fixed, per_sequence, dims.pp,
                                     plan.virtual_stages, plan.schedule or DEFAULT_SCHEDULE,
                                     memory_bytes, budget, plan.split_allowed)
    options = ", ".join(f"m={m}: {step * 1e3:.0f} ms{'' if fits else ' (over budget)'}"
                        for m, step, _, fits in choice.table)
    return choice, (
        f"dynamic batch splitting: {choice.num_microbatches} micro-batches of "
        f"{choice.micro_batch_size} sequences (measured {fixed * 1e3:.1f} ms + "
        f"{per_sequence * 1e3:.2f} ms/sequence per micro-batch; modelled step "
        f"{choice.modelled_step_s * 1e3:.0f} ms; budget {format_bytes(budget)}; {options})")
