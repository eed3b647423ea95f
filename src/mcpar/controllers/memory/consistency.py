"""Replica consistency: corrupted tensors are found and blamed on the rank that holds them.

A bit flipped in memory or on a link (silent data corruption) raises no error. Two checks find
it, both on the bits of each tensor summed as integers of their width (``bit_sum``: one flipped
bit moves the sum):

Own checksum (every step, no communication)
    Between the end of one optimizer step and the start of the next update nothing may change
    a parameter: the forward and backward passes only read it. Each rank records the bit sums
    of the tensors it holds right after every update (after the MoE balancer too), and
    recomputes them just before the next update (``before_update``), before a ZeRO-1/2 owner's
    updated shard is all-gathered to the replicas again. A rank whose tensor moved in that
    window holds the corrupted copy; the finding is kept (on the device, no synchronisation)
    until the next check. Checked so: every replicated parameter; the shard each ZeRO-1/2 rank
    owns and updates (a flip there reaches every replica at the next all-gather, after which the
    replicas agree on the corrupt value: only the owner's own checksum sees it); each ZeRO-3
    rank's parameter shard (nothing else holds those elements).
Replica comparison (every ``consistency_interval`` steps)
    The sums of the tensors that should agree over an axis (data replicas; the norms and biases
    tensor parallelism replicates; each expert's replicas, 'edp'; the ZeRO-3 node caches of the
    ranks at the same place of every node, 'dp_inter') are all-gathered over it, with each
    rank's own-checksum findings (over the world for the shards).

A finding is reported in ``recovery.jsonl`` (``replica_mismatch``: tensor, step, axis, ranks,
``attribution``, and ``changed_at``, the step whose update was about to read the corruption)
and the step raises ``ReplicaMismatch``: the launcher restarts the job from the last valid
checkpoint (``optimization.checkpoint.max_restarts``; with 0 the run stops). ``attribution``:

- ``checksum``: the ranks whose own checksum moved; certain;
- ``majority``: replicas differ, no own checksum moved, and a strict majority (more than half
  of the axis) agrees: the others are blamed (three or more replicas);
- ``unknown`` (``ranks`` null): replicas differ, no own checksum moved and there is no strict
  majority (two replicas, or a tie): the job still restarts, and no rank is named rather than a
  guess. This is what a change that no window covers gives: one during the update itself (a
  flipped gradient, optimizer state or arithmetic on one rank), or between the update and the
  record taken just after it.

Not checked: the optimizer's moments and offloaded fp32 masters (no replica holds them alike and
the update changes them every step); gradients. A node cache with two nodes can only say
``unknown``. The cost: two passes over what a rank holds per step (device kernels, no sync) and,
per check, one small all-gather per axis (``seconds``, all of it timed).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from mcpar.comm.communicator import Communicator
from mcpar.parallel.expert import is_expert_sharded
from mcpar.parallel.tensor import TP_SHARDED_ATTR

_INT_VIEW = {4: torch.int32, 2: torch.int16, 8: torch.int64, 1: torch.uint8}


class ReplicaMismatch(RuntimeError):
    """Replicas of a tensor disagree; the message names it, the step and the ranks."""


def bit_sum(t: torch.Tensor) -> int:
    """The sum of ``t``'s elements read as integers of their width: one flipped bit moves it."""
    return int(_bit_sum(t))


def _bit_sum(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().contiguous().view(-1)
    return flat.view(_INT_VIEW[flat.element_size()]).sum(dtype=torch.int64)


def attribute(sums: list[int], moved: list[bool]) -> tuple[list[int] | None, str] | None:
    """Who holds the corrupt copy, by axis position, and how that is known; None when the
    replicas agree and no own checksum moved. ``sums``: each replica's bit sum; ``moved``:
    whether its own checksum moved since its last update."""
    if any(moved):
        return [r for r, m in enumerate(moved) if m], "checksum"
    if len(set(sums)) == 1:
        return None
    value, count = Counter(sums).most_common(1)[0]
    if 2 * count > len(sums):  # a strict majority; a tie is never broken
        return [r for r, s in enumerate(sums) if s != value], "majority"
    return None, "unknown"


@dataclass
class _Group:
    """Tensors (indices into the checked list) compared over ``axis``; ``compare``: False for
    shards, which only their own checksum checks (its findings gathered over the world)."""

    axis: str
    members: list[int] = field(default_factory=list)
    compare: bool = True


class ReplicaConsistency:
    def __init__(self, named_params: list[tuple[str, torch.nn.Parameter]], comm: Communicator,
                 shards: list[tuple[str, str, torch.Tensor]] | None = None,
                 caches: list[tuple[str, torch.Tensor]] | None = None):
        """``named_params``: the replicated parameters; ``shards``: (name, axis, tensor) of
        what this rank alone holds and updates (ZeRO); ``caches``: ZeRO-3's node caches
        (compared over 'dp_inter' only: gathers rewrite them, so no own checksum)."""
        self.comm = comm
        self.names: list[str] = []
        self.tensors: list[torch.Tensor] = []
        by_axis: dict[str, _Group] = {}
        for name, p in named_params:
            i = self._add(name, p)
            if is_expert_sharded(p):
                by_axis.setdefault("edp", _Group("edp")).members.append(i)
                continue
            by_axis.setdefault("dp", _Group("dp")).members.append(i)
            if not hasattr(p, TP_SHARDED_ATTR):
                by_axis.setdefault("tp", _Group("tp")).members.append(i)
        self.groups = [g for g in by_axis.values() if comm.axis_size(g.axis) > 1]
        self.tracked = len(self.tensors)  # those with an own checksum: all but the caches
        shard_group = _Group("world", compare=False)
        self.shard_axis: dict[int, str] = {}
        for name, axis, t in shards or []:
            i = self._add(name, t)
            shard_group.members.append(i)
            self.shard_axis[i] = axis
            self.tracked += 1
        if shard_group.members and comm.axis_size("world") > 1:
            self.groups.append(shard_group)
        cache_group = _Group("dp_inter")
        for name, t in caches or []:
            cache_group.members.append(self._add(name, t))
        if cache_group.members and comm.axis_size("dp_inter") > 1:
            self.groups.append(cache_group)
        self.views: list[torch.Tensor | None] = [None] * len(self.tensors)
        self.recorded: torch.Tensor | None = None
        self.changed_at: torch.Tensor | None = None  # per tracked tensor: step, or -1
        self.seconds = 0.0  # all of it: the own checksums and the checks
        self.checksum_seconds = 0.0  # the own checksums' part (every step)
        self.checks = 0
        self.record()

    def _add(self, name: str, t: torch.Tensor) -> int:
        self.names.append(name)
        self.tensors.append(t)
        return len(self.tensors) - 1

    def _sums(self, count: int | None = None) -> torch.Tensor:
        """The bit sums of the first ``count`` tensors (all by default), on their device."""
        n = len(self.tensors) if count is None else count
        if not n:
            return torch.zeros(0, dtype=torch.int64)
        return torch.stack([self._int_view(i).sum(dtype=torch.int64) for i in range(n)])

    def _int_view(self, i: int) -> torch.Tensor:
        """Tensor i's elements as integers: a view kept between steps (one kernel per sum),
        made again when the tensor's storage moved (``p.data`` replaced)."""
        t = self.tensors[i]
        view = self.views[i]
        if view is None or view.data_ptr() != t.data_ptr() or view.numel() != t.numel():
            flat = t.detach().view(-1)  # parameters and shards are contiguous
            view = self.views[i] = flat.view(_INT_VIEW[flat.element_size()])
        return view

    def record(self) -> None:
        """After an update: the own checksums the next ``before_update`` compares with."""
        start = time.perf_counter()
        self.recorded = self._sums(self.tracked)
        if self.changed_at is None:
            self.changed_at = torch.full_like(self.recorded, -1)
        self._timed(start)

    def before_update(self, step: int) -> None:
        """Before the update of 1-based ``step``: a tracked tensor whose sum moved since the
        last record was corrupted on this rank (kept until the next check)."""
        start = time.perf_counter()
        assert self.recorded is not None and self.changed_at is not None
        moved = (self._sums(self.tracked) != self.recorded) & (self.changed_at < 0)
        self.changed_at = torch.where(moved, torch.full_like(self.changed_at, step),
                                      self.changed_at)
        self._timed(start)

    def _timed(self, start: float) -> None:
        seconds = time.perf_counter() - start
        self.seconds += seconds
        self.checksum_seconds += seconds

    def check(self, step: int) -> list[dict[str, object]]:
        """Compare the replicas and gather the own-checksum findings; the mismatches found
        (each: tensor, step, axis, ranks, attribution, changed_at)."""
        start = time.perf_counter()
        assert self.changed_at is not None
        sums = self._sums()
        changed = torch.cat([self.changed_at,
                             torch.full((len(self.tensors) - self.tracked,), -1,
                                        dtype=torch.int64, device=self.changed_at.device)])
        found: list[dict[str, object]] = []
        for group in self.groups:
            idx = torch.tensor(group.members, dtype=torch.long, device=sums.device)
            row = torch.cat([sums[idx], changed[idx]]).cpu()
            table = torch.stack(self.comm.all_gather(row, axis=group.axis))  # [ranks, 2 k]
            ranks = self.comm.group_ranks(group.axis)
            k = len(group.members)
            for col, i in enumerate(group.members):
                at = table[:, k + col].tolist()
                col_sums = table[:, col].tolist() if group.compare else [0] * len(ranks)
                verdict = attribute(col_sums, [a >= 0 for a in at])
                if verdict is None:
                    continue
                blamed, how = verdict
                found.append({
                    "tensor": self.names[i], "step": step,
                    "axis": self.shard_axis.get(i, group.axis) if not group.compare
                    else group.axis,
                    "shard": not group.compare,
                    "ranks": None if blamed is None else [ranks[r] for r in blamed],
                    "attribution": how,
                    "changed_at": min((a for a in at if a >= 0), default=None),
                    # Under ZeRO-1/2 an owner's corrupt shard reaches every replica.
                    "replicas_agree": group.compare and len(set(col_sums)) == 1})
        if not found:  # the findings were reported with the mismatch; else start afresh
            self.changed_at = torch.full_like(self.changed_at, -1)
        self.seconds += time.perf_counter() - start
        self.checks += 1
        return found
