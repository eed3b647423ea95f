"""This rank's tensors of a new layout, filled from a checkpoint one saved piece at a time.

A resume on another layout needs, for every element this rank holds, the saved value of the same
element of the full model. Instead of putting the whole model back together first (every saved
piece, then full parameters and moments: several times the model on every host), each saved
piece is matched, as it is read, against this rank's local tensors of the same global parameter,
and its matching elements are written straight into the live parameters and optimizer state.

This rank's tensors are kept as runs, not per-element codes: a local tensor is a slice of one
global parameter (a pipeline stage's whole tensor, a tensor-parallel block of rows or columns,
an expert rank's experts), so its element codes (``reshard.coordinate_codes``) are a few
stretches of consecutive elements. A saved element finds its run by binary search over the
runs' starts. The host holds the runs, a coverage bit per element and kind, and one saved
coordinate's tensors with one batch of their codes at a time.

Experts the balancer had moved are matched through their saved placement: slot s of a layer held
expert ``expert_of_slot[s]``, so a code of slot s is taken as that expert's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from mcpar.checkpoint.reshard import ELEMENT_BITS

_ELEMENT_MASK = (1 << ELEMENT_BITS) - 1

# Where one kind of a local tensor's values go: (start, end, tensor) pieces of its flattened
# elements (one whole piece, or a ZeRO shard's range of the optimizer state).
Sink = list[tuple[int, int, torch.Tensor]]


@dataclass
class Runs:
    """One local tensor as stretches of consecutive elements of one global parameter, sorted
    by their first element: [start, end) held from local position ``local``."""

    parameter: int
    numel: int
    starts: torch.Tensor
    ends: torch.Tensor
    local: torch.Tensor

    @classmethod
    def of(cls, codes: torch.Tensor) -> Runs:
        flat = codes.reshape(-1)
        parameter = int(flat[0]) >> ELEMENT_BITS
        if int(flat[-1]) >> ELEMENT_BITS != parameter or \
                not bool(((flat >> ELEMENT_BITS) == parameter).all()):
            raise ValueError("a local tensor holds elements of several parameters")
        elements = flat & _ELEMENT_MASK
        breaks = torch.nonzero(elements[1:] - elements[:-1] != 1).reshape(-1) + 1
        local = torch.cat([torch.zeros(1, dtype=torch.int64), breaks])
        lengths = torch.diff(local, append=torch.tensor([flat.numel()]))
        starts = elements[local]
        order = torch.argsort(starts)
        return cls(parameter, flat.numel(), starts[order], (starts + lengths)[order],
                   local[order])

    def positions(self, elements: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(local positions of the ``elements`` held here, mask of those elements)."""
        run = torch.searchsorted(self.starts, elements, right=True) - 1
        inside = run >= 0
        run.clamp_(min=0)
        inside &= elements < self.ends[run]
        run = run[inside]
        return self.local[run] + (elements[inside] - self.starts[run]), inside


class ShardTargets:
    """This rank's local tensors as runs, the live tensors each kind of value (``param``,
    ``exp_avg``, ...) is written to, and which elements have been written."""

    def __init__(self, codes: Iterable[tuple[str, torch.Tensor]]) -> None:
        """``codes``: this rank's (local tensor name, element codes), e.g. a coordinate's
        ``coordinate_codes``; each is turned into runs as it comes."""
        self.runs: dict[str, Runs] = {}
        self.by_parameter: dict[int, list[str]] = {}
        for name, local in codes:
            if local.numel():
                runs = self.runs[name] = Runs.of(local)
                self.by_parameter.setdefault(runs.parameter, []).append(name)
        self.sinks: dict[str, dict[str, Sink]] = {}
        self.covered: dict[tuple[str, str], torch.Tensor] = {}

    def add_kind(self, kind: str, sinks: dict[str, Sink]) -> None:
        for name, pieces in sinks.items():
            for _, _, tensor in pieces:
                if not tensor.is_contiguous():
                    raise ValueError(f"{name}'s {kind} is not contiguous; it cannot be "
                                     "written in place")
        self.sinks[kind] = sinks
        for name in sinks:
            if name in self.runs:
                self.covered[(kind, name)] = torch.zeros(self.runs[name].numel,
                                                         dtype=torch.bool)

    @torch.no_grad()
    def scatter(self, kind: str, codes: torch.Tensor, values: torch.Tensor) -> None:
        """Write the elements of a saved piece (its codes and values) that this rank holds."""
        codes, values = codes.reshape(-1), values.reshape(-1)
        sinks = self.sinks[kind]
        parameters = codes >> ELEMENT_BITS
        first = int(parameters[0])
        single = bool((parameters == first).all())  # a saved tensor is one parameter's slice
        for number in [first] if single else torch.unique(parameters).tolist():
            names = [n for n in self.by_parameter.get(number, []) if n in sinks]
            if not names:
                continue
            elements, saved = codes & _ELEMENT_MASK, values
            if not single:
                mine = parameters == number
                elements, saved = elements[mine], values[mine]
            for name in names:
                at, inside = self.runs[name].positions(elements)
                if at.numel() == 0:
                    continue
                found = saved[inside]
                for start, end, tensor in sinks[name]:
                    keep = (at >= start) & (at < end)
                    tensor.view(-1)[at[keep] - start] = found[keep].to(tensor.dtype)
                self.covered[(kind, name)][at] = True

    def missing(self, kind: str) -> int:
        """Elements of ``kind`` that no saved piece held."""
        return sum(int((~covered).sum()) for (k, _), covered in self.covered.items()
                   if k == kind)


def expert_order_codes(codes: torch.Tensor, expert_of_slot: torch.Tensor,
                       full_numel: int) -> torch.Tensor:
    """Codes of a saved expert weight (slots in the first dimension of its full tensor of
    ``full_numel`` elements) as codes of the experts the slots held."""
    per_slot = full_numel // expert_of_slot.numel()
    elements = codes & _ELEMENT_MASK
    slots = torch.div(elements, per_slot, rounding_mode="floor")
    experts = expert_of_slot.to(torch.int64)[slots]
    return (codes - elements) + experts * per_slot + elements % per_slot
