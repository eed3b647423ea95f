"""Fault injection for tests and benches: what a test asks a run to suffer, behind one object.

Production builds none: :meth:`FaultInjector.from_env` returns None unless a ``MCPAR_FAULT_*``
variable is set, and the trainer only calls the object it is handed. The variables:

- ``MCPAR_FAULT_NONFINITE_STEPS`` ("3,4"): 1-based steps whose loss is made NaN;
- ``MCPAR_FAULT_STALL_STEP``: the 1-based step at which the faulty rank hangs (its peers must
  time out), on the job's first start only (a restarted job runs normally);
- ``MCPAR_FAULT_RANK``: the rank that suffers them (default 0).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class FaultInjector:
    rank: int = 0
    nonfinite_steps: frozenset[int] = frozenset()
    stall_step: int = 0
    bitflip_step: int = 0  # before this 1-based step, one bit of a parameter flips on ``rank``
    _step: int = 0  # the current 0-based step, set by before_step

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> FaultInjector | None:
        env = os.environ if environ is None else environ
        nonfinite = frozenset(int(v) for v in env.get("MCPAR_FAULT_NONFINITE_STEPS", "")
                              .split(",") if v.strip())
        # The stall is injected on the first start of the job only.
        first_start = env.get("MCPAR_RESTART_COUNT", "0") in ("", "0")
        stall = int(env.get("MCPAR_FAULT_STALL_STEP", "0") or 0) if first_start else 0
        flip = int(env.get("MCPAR_FAULT_BITFLIP_STEP", "0") or 0) if first_start else 0
        if not nonfinite and not stall and not flip:
            return None
        return cls(rank=int(env.get("MCPAR_FAULT_RANK", "0")), nonfinite_steps=nonfinite,
                    stall_step=stall, bitflip_step=flip)

    def before_step(self, step: int, rank: int,
                    params: list[torch.nn.Parameter] | None = None) -> None:
        """Called at the start of every 0-based step on every rank (with its parameters)."""
        self._step = step
        if step + 1 == self.stall_step and rank == self.rank:
            time.sleep(3600)  # this rank hangs; its peers must time out
        if step + 1 == self.bitflip_step and rank == self.rank and params:
            # Silent data corruption: an exponent bit of the first parameter's first element.
            with torch.no_grad():
                bits = params[0].data.view(-1)[:1].view(torch.int32)
                bits ^= 1 << 24

    def wrap_loss(self, loss_fn: LossFn, rank: int) -> LossFn:
        """``loss_fn``, whose loss is NaN on the faulty rank at the chosen steps."""
        if rank != self.rank or not self.nonfinite_steps:
            return loss_fn

        def faulty(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(logits, targets)
            return loss * float("nan") if self._step + 1 in self.nonfinite_steps else loss

        return faulty
