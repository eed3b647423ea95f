"""Fault injection for tests and benches: what a test asks a run to suffer, behind one object.

Production builds none: :meth:`FaultInjector.from_env` returns None unless a ``MCPAR_FAULT_*``
variable is set, and the trainer only calls the object it is handed. The variables:

- ``MCPAR_FAULT_NONFINITE_STEPS`` ("3,4"): 1-based steps whose loss is made NaN;
- ``MCPAR_FAULT_STALL_STEP``: the 1-based step at which the faulty rank hangs (its peers must
  time out), on the job's first start only (a restarted job runs normally);
- ``MCPAR_FAULT_BITFLIP_STEP``: before this 1-based step (first start only), one exponent bit
  of one element flips on the faulty rank, in ``MCPAR_FAULT_BITFLIP_TARGET``: ``param`` (the
  default: the first parameter's first element, a replicated tensor unless ZeRO-3), ``shard``
  (the first element of the rank's own ZeRO shard: a ZeRO-1/2 owner's updated elements, a
  ZeRO-3 parameter shard) or ``update`` (the first parameter again, but right after the
  previous step's update, before its checksum is recorded: a change no check can attribute);
- ``MCPAR_FAULT_RANK``: the rank that suffers them (default 0).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
BITFLIP_TARGETS = ("param", "shard", "update")


def _flip(t: torch.Tensor) -> None:
    """Silent data corruption: an exponent bit of ``t``'s first element (fp32)."""
    with torch.no_grad():
        bits = t.view(-1)[:1].view(torch.int32)
        bits ^= 1 << 24


@dataclass
class FaultInjector:
    rank: int = 0
    nonfinite_steps: frozenset[int] = frozenset()
    stall_step: int = 0
    bitflip_step: int = 0  # before this 1-based step, one bit of a parameter flips on ``rank``
    bitflip_target: str = "param"  # "param", "shard" or "update"
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
        target = env.get("MCPAR_FAULT_BITFLIP_TARGET", "param") or "param"
        if target not in BITFLIP_TARGETS:
            raise ValueError(f"MCPAR_FAULT_BITFLIP_TARGET {target!r}: one of {BITFLIP_TARGETS}")
        return cls(rank=int(env.get("MCPAR_FAULT_RANK", "0")), nonfinite_steps=nonfinite,
                   stall_step=stall, bitflip_step=flip, bitflip_target=target)

    def before_step(self, step: int, rank: int,
                    params: list[torch.nn.Parameter] | None = None,
                    shards: list[torch.Tensor] | None = None) -> None:
        """Called at the start of every 0-based step on every rank (with its parameters and
        the ZeRO shards it owns)."""
        self._step = step
        if step + 1 == self.stall_step and rank == self.rank:
            time.sleep(3600)  # this rank hangs; its peers must time out
        if step + 1 == self.bitflip_step and rank == self.rank:
            if self.bitflip_target == "param" and params:
                _flip(params[0].data)
            elif self.bitflip_target == "shard":
                if not shards:
                    raise ValueError("MCPAR_FAULT_BITFLIP_TARGET shard: this rank owns no "
                                     "ZeRO shard (zero_stage 0)")
                _flip(shards[0])

    def after_update(self, step: int, rank: int, params: list[torch.nn.Parameter]) -> None:
        """Called after every 0-based step's update, before its checksums are recorded."""
        if (step + 2 == self.bitflip_step and rank == self.rank
                and self.bitflip_target == "update"):
            _flip(params[0].data)

    def wrap_loss(self, loss_fn: LossFn, rank: int) -> LossFn:
        """``loss_fn``, whose loss is NaN on the faulty rank at the chosen steps."""
        if rank != self.rank or not self.nonfinite_steps:
            return loss_fn

        def faulty(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            loss = loss_fn(logits, targets)
            return loss * float("nan") if self._step + 1 in self.nonfinite_steps else loss

        return faulty
