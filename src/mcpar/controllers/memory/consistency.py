"""Replica consistency: the tensors that should be equal on several ranks are compared.

Data-parallel replicas hold the same parameters after every step (all-reduced gradients, or
ZeRO-1/2's all-gathered shards); so do the norms and biases that tensor parallelism replicates,
and the replicas of each expert ('edp'). A bit flipped in memory or on a link (silent data
corruption) makes them drift apart without any error. Every ``consistency_interval`` steps each
rank sums the bits of each such tensor (its elements viewed as integers, so one flipped bit
changes the sum) and the sums are all-gathered over the axis that should agree; a tensor whose
sums differ is reported by name with the step and the ranks that disagree with the majority,
logged in ``recovery.jsonl``, and the step raises ``ReplicaMismatch``: the launcher restarts
the job from the last valid checkpoint (``training.max_restarts``; with 0 the run stops).

Not checked: ZeRO-3's parameters (each rank holds a different shard: nothing is replicated).
The cost is one pass over the parameters and one small all-gather per axis (``seconds``).
"""

from __future__ import annotations

import time
from collections import Counter

import torch

from mcpar.comm.communicator import Communicator
from mcpar.parallel.expert import is_expert_sharded
from mcpar.parallel.tensor import TP_SHARDED_ATTR

_INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}


class ReplicaMismatch(RuntimeError):
    """Replicas of a tensor disagree; the message names it, the step and the ranks."""


def bit_sum(t: torch.Tensor) -> int:
    """The sum of ``t``'s elements read as integers of their width: one flipped bit moves it."""
    flat = t.detach().contiguous().view(-1)
    return int(flat.view(_INT_VIEW[flat.element_size()]).sum(dtype=torch.int64))


class ReplicaConsistency:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], comm: Communicator):
        self.comm = comm
        # (axis, names, tensors): the tensors that must agree over each axis.
        by_axis: dict[str, list[tuple[str, torch.nn.Parameter]]] = {}
        for name, p in named_params:
            if is_expert_sharded(p):
                by_axis.setdefault("edp", []).append((name, p))
                continue
            by_axis.setdefault("dp", []).append((name, p))
            if not hasattr(p, TP_SHARDED_ATTR):
                by_axis.setdefault("tp", []).append((name, p))
        self.groups = [(axis, members) for axis, members in by_axis.items()
                       if comm.axis_size(axis) > 1]
        self.seconds = 0.0
        self.checks = 0

    def check(self, step: int) -> list[dict[str, object]]:
        """Compare the replicas; the mismatches found (each: tensor, step, axis, ranks)."""
        start = time.perf_counter()
        found: list[dict[str, object]] = []
        for axis, members in self.groups:
            sums = torch.tensor([bit_sum(p) for _, p in members], dtype=torch.int64)
            rows = self.comm.all_gather(sums, axis=axis)
            ranks = self.comm.group_ranks(axis)
            table = torch.stack(rows)  # [axis ranks, tensors]
            for i in torch.nonzero((table != table[0]).any(dim=0)).flatten().tolist():
                majority, _ = Counter(table[:, i].tolist()).most_common(1)[0]
                bad = [ranks[r] for r in range(len(ranks)) if int(table[r, i]) != majority]
                found.append({"tensor": members[i][0], "step": step, "axis": axis,
                              "ranks": bad})
        self.seconds += time.perf_counter() - start
        self.checks += 1
        return found
