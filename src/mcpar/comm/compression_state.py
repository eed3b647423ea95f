"""Per-rank compression state in checkpoints: 1-bit Adam's error buffers and PowerSGD's.

These tensors differ between data-parallel replicas (each rank's compression error is its own),
so the FaultRecoveryManager stores them under ``rank<r>/`` keys for every rank, whatever the
checkpoint strategy; without them a resumed run would restart error feedback from zero and not
be bitwise identical to one that never stopped. (1-bit Adam's momentum, frozen variance and step
are ordinary per-parameter optimizer state and are saved as AdamW's are.)

On a resume with another data degree (the model's other degrees kept), 1-bit Adam's errors are
redistributed per element (``onebit_reshard.py``): each rank also saves its model
coordinate and its buffers' segment ranges, so that the old ranks of this rank's coordinate can
be read back one at a time. PowerSGD's errors are not: they are kept per bucket matrix, whose
shapes follow the bucket plan of the layout, and restart from zero (the load's log says so).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from mcpar.comm.onebit_reshard import ErrorMerge
from mcpar.comm.powersgd import PowerSGDCompressor, SavedGroup

# The mesh axes whose ranks say which parameters a rank holds (its model coordinate): ranks that
# differ only on the data axis hold the same ones.
MODEL_AXES = ("pp", "tp", "ep", "cp")


class CompressionState:
    """Names the compression tensors of this rank for saving, and restores them after a load."""

    def __init__(self, optimizer: torch.optim.Optimizer, powersgd: PowerSGDCompressor | None,
                 coord: tuple[int, ...] = ()):
        """``coord``: this rank's model coordinate (its ranks on the axes other than data):
        the old ranks that held the same parameters share it."""
        self.optimizer = optimizer
        self.powersgd = powersgd
        self.coord = coord

    def tensors(self) -> dict[str, torch.Tensor]:
        """Live tensors to save, by name relative to this rank's prefix."""
        out: dict[str, torch.Tensor] = {}
        errors = getattr(self.optimizer, "error_buffers", None)
        if errors is not None:
            out["onebit/worker_error"] = errors.worker
            out["onebit/server_error"] = errors.server
            out["onebit/coord"] = torch.tensor(self.coord, dtype=torch.int64)
            out.update({f"onebit/{k}": v for k, v in self.optimizer.error_layout().items()})
        if self.powersgd is not None:
            for key, group in self.powersgd.state_dict().items():
                out[f"powersgd/{key}/iteration"] = torch.tensor([group["iteration"]],
                                                                dtype=torch.int64)
                for index, matrix in group["matrices"].items():
                    out[f"powersgd/{key}/{index}/error"] = matrix["error"]
                    out[f"powersgd/{key}/{index}/q"] = matrix["q"]
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Restore from the tensors a checkpoint held under this rank's prefix."""
        errors = getattr(self.optimizer, "error_buffers", None)
        if errors is not None and "onebit/worker_error" in tensors:
            for name, live in (("worker_error", errors.worker), ("server_error", errors.server)):
                saved = tensors[f"onebit/{name}"]
                if saved.shape != live.shape:
                    raise ValueError(f"saved 1-bit Adam {name} has shape {tuple(saved.shape)}, "
                                     f"this layout needs {tuple(live.shape)}")
                live.copy_(saved)
        if self.powersgd is not None:
            state: dict[int, SavedGroup] = {}
            for name, tensor in tensors.items():
                parts = name.split("/")
                if parts[0] != "powersgd":
                    continue
                group = state.setdefault(int(parts[1]), {"iteration": 0, "matrices": {}})
                if parts[2] == "iteration":
                    group["iteration"] = int(tensor.item())
                else:
                    group["matrices"].setdefault(int(parts[2]), {})[parts[3]] = tensor
            self.powersgd.load_state_dict(state)


    def reshard(self, read_rank: Callable[[int], dict[str, torch.Tensor]], old_world: int,
                same_model: bool, same_experts: bool) -> list[str]:
        """Carry what survives a change of the data degree alone (``same_model``: the other
        degrees kept) from the old ranks' tensors (``read_rank(r)``: rank r's, by name relative
        to its prefix); the names carried."""
        errors = getattr(self.optimizer, "error_buffers", None)
        if errors is None or not same_model:
            return []
        merge = ErrorMerge(self.optimizer.numel)
        try:
            for rank in range(old_world):
                saved = read_rank(rank)
                if "onebit/ranges" not in saved:
                    return []  # written before the errors could be read back per element
                if tuple(saved["onebit/coord"].tolist()) != self.coord:
                    continue
                merge.add(saved["onebit/worker_error"], saved["onebit/server_error"],
                          saved["onebit/ranges"], saved["onebit/exchange"])
            self.optimizer.load_flat_errors(*merge.result())
        except ValueError:
            return []  # another flat layout or a hierarchical axis: the errors restart
        return ["compression_errors"]


class RankState(Protocol):
    """Per-rank state a checkpoint keeps under ``rank<r>/`` keys (compression errors)."""

    def tensors(self) -> dict[str, torch.Tensor]: ...
    def load(self, tensors: dict[str, torch.Tensor]) -> None: ...


class RankStateGroup:
    """Several per-rank states saved under one rank prefix; each part names its own tensors
    (distinct names) and picks its own out of what a checkpoint holds."""

    def __init__(self, parts: list[RankState]) -> None:
        self.parts = parts

    def tensors(self) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for part in self.parts:
            out.update(part.tensors())
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for part in self.parts:
            part.load(tensors)

    def reshard(self, read_rank: Callable[[int], dict[str, torch.Tensor]], old_world: int,
                same_model: bool, same_experts: bool) -> list[str]:
        """Each part's carry across a layout change (parts without one carry nothing)."""
        carried: list[str] = []
        for part in self.parts:
            carry = getattr(part, "reshard", None)
            if carry is not None:
                carried += carry(read_rank, old_world, same_model=same_model,
                                 same_experts=same_experts)
        return carried
