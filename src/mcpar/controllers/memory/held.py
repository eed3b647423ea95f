"""What a rank really holds: model-state bytes counted from the tensors themselves.

The MemoryController's estimate (``estimate.py``) is a formula; this is the measurement it is
checked against. Each storage is counted once, whatever views of it exist (a ZeRO stage-1
gradient shard is a slice of the full gradient buffer; parameters are views of flat buffers).
Under optimizer offload the state's in-memory part (its streaming buffers, or the host store) is
counted apart, as "offload buffers".
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from mcpar.controllers.communication.grad_sync import DataParallelGradSync


def _storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    total = 0
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def model_state_bytes(params: list[torch.nn.Parameter], sync: DataParallelGradSync,
                      optimizer: torch.optim.Optimizer,
                      stored: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], []),
                      ) -> dict[str, int]:
    """Bytes of parameters, gradients and optimizer state this rank holds right now;
    ``stored``: ZeRO-3's parameter store (shards, node caches; a freed layer holds nothing)."""
    seen: set[int] = set()
    grads: list[torch.Tensor] = [b.buffer for b in sync.buckets]
    grads += [b.shard for b in sync.buckets if b.shard is not None]
    grads += [p.grad for p in params if p.grad is not None] + stored[1]
    state = [t for s in optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    held = {"parameters": _storage_bytes([*params, *stored[0]], seen),
            "gradients": _storage_bytes(grads, seen),
            "optimizer state": _storage_bytes(state, seen)}
    if hasattr(optimizer.state, "engine"):
        # Offloaded (``offload.py``): what the state holds in memory is the stream's buffers
        # (nvme) or the host store (cpu); the state itself is off the device.
        held["offload buffers"] = held["optimizer state"]
        held["optimizer state"] = 0
    return held
