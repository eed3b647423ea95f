"""1-bit Adam's state: the per-parameter views of its flat buffers, its state dicts, and its
error storage read back per element across data degrees.

``OneBitAdam`` keeps one flat momentum and one flat variance for all its parameters; torch's
optimizer API and mcpar's checkpoints see AdamW-shaped per-parameter state. This mixin keeps
the two in step: it binds every parameter's ``state`` entries to slices of the flat buffers,
takes over state a loader wrote from outside (fresh tensors, or a step written in place), and
writes and reads ``state_dict``. ``error_layout`` and ``load_flat_errors`` are the optimizer's
side of ``comm/onebit_reshard.py``.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch

from mcpar.comm.onebit_reshard import fill_errors, ranges_table


class OneBitState:
    """State methods of ``OneBitAdam`` (which holds the attributes they use)."""

    # The attributes OneBitAdam sets up (flat buffers, layout, segments, error storages).
    _layout: list[tuple[torch.nn.Parameter, int, int]]
    _exp_avg: torch.Tensor
    _exp_avg_sq: torch.Tensor
    _step_tensor: torch.Tensor
    _step_count: int
    _denom: torch.Tensor | None
    _world: int
    _intra: int
    _current: int
    _exchange_axis: str
    _segments: list[Any]
    _storages: tuple[Any, Any]
    _errors: Any  # the current error storage (a property of OneBitAdam)
    state: Any
    param_groups: list[dict[str, Any]]
    comm: Any
    freeze_step: int

    def error_layout(self) -> dict[str, torch.Tensor]:
        """What reads this rank's error buffers back per element (``onebit_reshard.py``): the
        segments' ranges of the flat momentum and the exchange's (world, rank, intra)."""
        axis = self._exchange_axis
        return {"ranges": ranges_table([seg.ranges for seg in self._segments]),
                "exchange": torch.tensor([self.comm.axis_size(axis), self.comm.axis_rank(axis),
                                          self._intra],
                                         dtype=torch.int64)}

    @torch.no_grad()
    def load_flat_errors(self, worker: torch.Tensor, server: torch.Tensor) -> None:
        """Set the current error storage from per-element errors of the flat momentum (another
        data degree's, merged by ``onebit_reshard.ErrorMerge``): each segment's worker errors,
        and the server errors of the chunk this rank serves; padding zero."""
        if self._intra != 1:
            raise ValueError("1-bit errors of a hierarchical data axis are a node's shard's")
        for storage in self._storages:
            storage.worker.zero_()
            storage.server.zero_()
        fill_errors([seg.ranges for seg in self._segments],
                    [seg.errors[self._current] for seg in self._segments], worker, server,
                    self.comm.axis_rank(self._exchange_axis))

    def _bind_state(self) -> None:
        """Point every parameter's state at its slices of the flat buffers."""
        self._step_tensor.fill_(float(self._step_count))
        for p, offset, numel in self._layout:
            self.state[p] = {
                "step": self._step_tensor,
                "exp_avg": self._exp_avg[offset:offset + numel].view_as(p),
                "exp_avg_sq": self._exp_avg_sq[offset:offset + numel].view_as(p),
            }

    def _is_bound(self) -> bool:
        m_base, v_base = self._exp_avg.data_ptr(), self._exp_avg_sq.data_ptr()
        itemsize = self._exp_avg.element_size()
        for p, offset, _ in self._layout:
            state = self.state.get(p)
            if (not state or state.get("step") is not self._step_tensor
                    or state.get("exp_avg") is None or state.get("exp_avg_sq") is None
                    or state["exp_avg"].data_ptr() != m_base + offset * itemsize
                    or state["exp_avg_sq"].data_ptr() != v_base + offset * itemsize):
                return False
        return True

    def _adopt_external_state(self) -> None:
        """Take over per-parameter state that code outside the optimizer put in ``self.state``
        (a checkpoint loader filling fresh tensors in place), then bind the views again.

        Without this the flat buffers would silently ignore such a load. The error buffers are
        not per-parameter: a loader that does not restore them leaves them as they are.
        """
        if self._is_bound():
            # Moments written in place land in the flat buffers; a step written into the shared
            # step tensor (a reshard fills every parameter's 'step') is taken over here.
            if int(self._step_tensor) != self._step_count:
                self._step_count = int(self._step_tensor)
                self._denom = None
            return
        step = None
        for p, offset, numel in self._layout:
            state = self.state.get(p) or {}
            for key, flat in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                value = state.get(key)
                target = flat[offset:offset + numel]
                if value is None:
                    target.zero_()
                else:
                    target.copy_(value.reshape(-1))
            if step is None and "step" in state:
                step = int(state["step"])
        self._step_count = step if step is not None else 0
        self._denom = None
        self._bind_state()

    def state_dict(self) -> dict[str, Any]:
        """AdamW-shaped per-parameter state plus ``'onebit'``: step, world size and this rank's
        error buffers (references to the live tensors, as torch's state_dict gives)."""
        state = super().state_dict()
        state["onebit"] = {
            "step": self._step_count,
            "world": self._world,
            "freeze_step": self.freeze_step,
            "worker_error": self._errors.worker,
            "server_error": self._errors.server,
        }
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore hyperparameters, moments, step and error buffers from :meth:`state_dict`.

        Error buffers saved under another data-parallel size cannot be reused (their padding and
        chunking differ); they are reset to zero with a warning, as DeepSpeed always does.
        """
        if "onebit" not in state_dict:
            raise ValueError("not a OneBitAdam state dict (no 'onebit' entry)")
        saved_state = state_dict["state"]
        # The base class restores and checks the groups; the moments are copied below, into
        # the flat buffers, without its cast to the parameter dtype.
        super().load_state_dict({"state": {}, "param_groups": state_dict["param_groups"]})
        for group in self.param_groups:
            check_hyperparameters(group)
        for index, (_, offset, numel) in enumerate(self._layout):
            saved = saved_state.get(index, {})
            for key, flat in (("exp_avg", self._exp_avg), ("exp_avg_sq", self._exp_avg_sq)):
                target = flat[offset:offset + numel]
                if key in saved:
                    if saved[key].numel() != numel:
                        raise ValueError(f"parameter {index}: saved {key} has "
                                         f"{saved[key].numel()} elements, expected {numel}")
                    target.copy_(saved[key].reshape(-1))
                else:
                    target.zero_()
        onebit = state_dict["onebit"]
        self._step_count = int(onebit["step"])
        worker, server = onebit["worker_error"], onebit["server_error"]
        if (int(onebit["world"]) == self._world and worker.shape == self._errors.worker.shape
                and server.shape == self._errors.server.shape):
            self._errors.worker.copy_(worker)
            self._errors.server.copy_(server)
        else:
            warnings.warn(f"1-bit Adam error buffers were saved with {onebit['world']} "
                          f"data-parallel ranks, this run has {self._world}: reset to zero",
                          stacklevel=2)
            self._errors.worker.zero_()
            self._errors.server.zero_()
        self._denom = None
        self._bind_state()


def check_hyperparameters(group: dict[str, Any]) -> None:
    beta1, beta2 = group["betas"]
    if not 0.0 <= beta1 < 1.0 or not 0.0 <= beta2 < 1.0:
        raise ValueError(f"betas must lie in [0, 1), got {group['betas']}")
    if group["lr"] < 0:
        raise ValueError(f"lr must be >= 0, got {group['lr']}")
    if group["eps"] < 0:
        raise ValueError(f"eps must be >= 0, got {group['eps']}")
    if group["weight_decay"] < 0:
        raise ValueError(f"weight_decay must be >= 0, got {group['weight_decay']}")
