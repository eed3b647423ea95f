"""What one training step really uses, per category, to set beside the MemoryController's estimate.

The estimate (``estimate.py``, the cost model's ``sim/memory.py``) is a formula; this is the
measurement it is checked against, taken at one step of the run (the first one trained), so the
rest of the run pays nothing for it.

- Model states (parameters, gradients, optimizer state): ``held.py``'s exact count of the tensors
  this rank holds, each storage once.
- Activations: the tensors autograd saves for the backward pass, seen through
  ``torch.autograd.graph.saved_tensors_hooks``: each storage is counted once however many views of
  it are saved, from the moment it is first saved until the last node saving it has run its backward
  (the graph drops the packed object, and with it the count); the peak of that sum over the step is
  the measurement. The gradient a pipeline backward receives is counted too, for as long as that
  backward runs (``holding``). Parameters (and ZeRO-3's gathered weights, which parameters point
  into) are left out: they are counted with the model states or the gathered working set. Under
  recompute, what the step saves is the recomputed modules' inputs (``torch.utils.checkpoint`` saves
  them outside its own hooks, so they are seen here); the re-forward's working set, which checkpoint
  keeps to itself, is measured by running one recomputed module's forward once more under these
  hooks (the first one of the step, with the RNG state forked so dropout draws are untouched) and
  counting the storages it saves that were not saved already. The gradient of the logits, alive
  while the backward pass starts, is counted when it appears (a hook on the loss's input) on top of
  what is saved at that moment.
- Gathered working set (ZeRO-3): the largest sum of the parameters' storages seen while the step
  saves tensors (the gathered layers and root parameters; the shards are model state).
- Communication buffers: under ZeRO-2 and 3, the largest gradient bucket (a full-size buffer is
  filled and reduce-scattered per bucket), or, where they reduce once per step, every bucket
  (the whole gradient accumulates over the step); error-feedback state of a gradient
  compressor; on a CPU device, optimizer offload's streaming buffers (host memory, which there
  is the device's).

On CUDA the total is also ``torch.cuda.max_memory_allocated`` over the step (``device.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mcpar.comm.compression_state import CompressionState
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.controllers.memory import recompute
from mcpar.controllers.memory.held import model_state_bytes
from mcpar.device import peak_memory_since_reset, reset_peak_memory

if TYPE_CHECKING:
    from mcpar.controllers.communication.exchanges import GradExchange
    from mcpar.controllers.memory.param_store import ParameterStore
    from mcpar.controllers.memory.plan import MemoryPlan
    from mcpar.parallel.parallelize import ParallelModel
    from mcpar.parallel.pipeline import PipelineExecutor
    from mcpar.parallel.weight_grad import WeightGradStore

ROWS = ("parameters", "gradients", "optimizer state", "activations", "communication buffers",
        "gathered working set")


def _identity(t: Any) -> Any:
    return t


class _Saved:
    """What the graph keeps instead of a saved tensor: the tensor and a release of its count when
    the graph drops it."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: SavedBytes, ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self) -> None:
        self.meter.release(self.ptr)


class SavedBytes:
    """Live bytes of the storages the autograd graph saves (each once), and their peak."""

    def __init__(self, excluded: Callable[[], set[int]], already: set[int] | None = None):
        self.excluded = excluded  # storages counted elsewhere (parameters)
        self.already = already or set()  # storages an enclosing meter counts already
        self.refs: dict[int, list[int]] = {}  # data_ptr -> [bytes, saved references]
        self.live = 0
        self.peak = 0

    def pack(self, t: torch.Tensor) -> _Saved | torch.Tensor:
        storage = t.untyped_storage()
        ptr, nbytes = storage.data_ptr(), storage.nbytes()
        if not nbytes or ptr in self.already or ptr in self.excluded():
            return t
        entry = self.refs.get(ptr)
        if entry is None:
            self.refs[ptr] = [nbytes, 1]
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        else:
            entry[1] += 1
        return _Saved(self, ptr, t)

    @staticmethod
    def unpack(packed: _Saved | torch.Tensor) -> torch.Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def release(self, ptr: int) -> None:
        entry = self.refs[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self.refs[ptr]
            self.live -= entry[0]

    def note_transient(self, nbytes: int) -> None:
        """A tensor alive now beside the saved ones (the logits' gradient)."""
        self.peak = max(self.peak, self.live + nbytes)

    def hooks(self) -> contextlib.AbstractContextManager:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


class MemoryMeter:
    """Measures the first step of this rank run under ``step()``; later ones run untouched."""

    def __init__(self, params: list[torch.nn.Parameter], device: torch.device):
        self.params = params
        self.device = device
        self.measured = False
        self.active: SavedBytes | None = None
        self.activations = 0
        self.working = 0  # the largest re-forward working set
        self.gathered = 0
        self.device_peak = 0
        self._probed = False
        # A split schedule's store of what W tasks need (set by the trainer): held between a B
        # and its W, so counted with the activations.
        self.weight_grads: WeightGradStore | None = None

    def _param_storages(self) -> set[int]:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes()
                    for p in self.params}
        self.gathered = max(self.gathered, sum(storages.values()))
        return set(storages)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.measured:
            yield
            return
        self.measured = True
        self.active = SavedBytes(self._param_storages)
        self.gathered = 0
        reset_peak_memory(self.device)
        recompute.set_reforward_probe(self._probe)
        store = self.weight_grads
        if store is not None:
            store.pack, store.unpack = self.active.pack, self.active.unpack
        try:
            with self.active.hooks():
                yield
        finally:
            recompute.set_reforward_probe(None)
            if store is not None:
                store.pack = store.unpack = _identity
            self.activations = self.active.peak + self.working
            self.device_peak = peak_memory_since_reset(self.device)
            self.active = None

    def _probe(self, forward: Callable[..., torch.Tensor], args: tuple) -> None:
        """One recomputed module's forward once more, its new saved storages counted."""
        if self._probed or self.active is None:
            return
        self._probed = True
        probe = SavedBytes(self._param_storages, already=set(self.active.refs))
        cuda = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), probe.hooks():
            out = forward(*args)
        del out
        self.working = probe.peak

    @contextlib.contextmanager
    def holding(self, tensor: torch.Tensor | None) -> Iterator[None]:
        """``tensor`` counted with the activations while the block runs, its storage once with
        the saved ones: a tensor a task holds beside what autograd saves (the gradient a
        pipeline backward receives, alive through that backward under every schedule, and
        under a split one kept on for W as its last layer's output gradient)."""
        meter = self.active
        packed = meter.pack(tensor) if meter is not None and tensor is not None else None
        try:
            yield
        finally:
            del packed  # the count drops with it (``_Saved.__del__``)

    def wrap_loss(self, loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        """The loss, with the backward's first transients counted while a step is measured: at
        each node between the loss and the logits, the gradients it takes and gives beside what
        is saved at that moment (the log-softmax's: its saved output, the gradient arriving and
        the one leaving, each the logits' size)."""
        def loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
            out = loss_fn(logits, targets)
            meter = self.active
            if meter is not None and out.grad_fn is not None:
                for node in _nodes_between(out.grad_fn, logits.grad_fn):
                    node.register_hook(lambda given, taken, m=meter: m.note_transient(
                        _new_bytes((*given, *taken), m.refs)))
            return out
        return loss

    def rows(self, held: dict[str, int], sync: DataParallelGradSync, zero_stage: int,
             feedback: Iterable[torch.Tensor] = (), posted_receives: int = 0) -> dict[str, int]:
        """Measured bytes per category (and the total) of this rank. ``feedback``: the
        compressor's error-feedback tensors; ``posted_receives``: the most bytes of pipeline
        receive buffers the executor had posted at once (``PipelineStats.posted_peak_bytes``)."""
        comm = sum(t.untyped_storage().nbytes() for t in feedback) + posted_receives
        if self.device.type == "cpu":  # offload's host buffers are this device's memory
            comm += held.get("offload buffers", 0)
        if zero_stage >= 2 and sync.buckets:
            sizes = [b.numel * b.params[0].element_size() for b in sync.buckets]
            # Reducing after every backward, the largest full bucket, filled then reduced; once
            # per step, every bucket's whole gradient, accumulated over the step's backwards.
            comm += max(sizes) if sync.reduce_every_backward else sum(sizes)
        rows = {**{k: held.get(k, 0) for k in ROWS[:3]}, "activations": self.activations,
                "communication buffers": comm,
                # Outside ZeRO-3 the parameters' storages are the parameters themselves.
                "gathered working set": self.gathered if zero_stage >= 3 else 0}
        rows["total"] = sum(rows.values())
        if self.device.type == "cuda":
            rows["device peak"] = self.device_peak
        return rows


class _PlannedMemory(Protocol):
    @property
    def memory(self) -> MemoryPlan: ...


class MeasuredRun(Protocol):
    """What ``trainer_memory`` reads of the run it measures (the Trainer is one), read-only."""

    @property
    def meter(self) -> MemoryMeter: ...
    @property
    def pm(self) -> ParallelModel: ...
    @property
    def grad_sync(self) -> DataParallelGradSync: ...
    @property
    def optimizer(self) -> torch.optim.Optimizer: ...
    @property
    def grad_exchange(self) -> GradExchange: ...
    @property
    def store(self) -> ParameterStore | None: ...
    @property
    def plan(self) -> _PlannedMemory: ...
    @property
    def comm(self) -> CommunicationController: ...

    @property
    def executor(self) -> PipelineExecutor: ...

    @property
    def post_validation_copy_bytes(self) -> int: ...


def trainer_memory(trainer: MeasuredRun) -> dict[str, dict[str, int]]:
    """``memory_summary`` of a Trainer (its meter, model states, gradient sync and plan)."""
    store = trainer.store
    held = model_state_bytes(trainer.pm.params, trainer.grad_sync, trainer.optimizer,
                             store.held_tensors() if store is not None else ([], []))
    # Post-validation's copy of the step's weights, gradients and optimizer state, held from an
    # update into the next step, is counted with the optimizer state (as the estimate counts it).
    held["optimizer state"] = held.get("optimizer state", 0) + trainer.post_validation_copy_bytes
    feedback = CompressionState(trainer.optimizer, trainer.grad_exchange.compressor).tensors()
    measured = trainer.meter.rows(held, trainer.grad_sync, trainer.plan.memory.zero_stage,
                                  [t for t in feedback.values() if t.dim()],
                                  trainer.executor.last_stats.posted_peak_bytes)
    estimate = trainer.plan.memory.estimate
    return memory_summary(estimate.rows() + estimate.off_device_rows(), measured, trainer.comm)


def _nodes_between(top: Any, bottom: Any) -> list[Any]:
    """The autograd nodes from ``top`` down to (not including) ``bottom``: the loss's own."""
    found, todo, seen = [], [top], set()
    while todo:
        node = todo.pop()
        if node is None or node is bottom or id(node) in seen:
            continue
        seen.add(id(node))
        found.append(node)
        todo += [n for n, _ in node.next_functions]
    return found


def _new_bytes(tensors: Iterable[torch.Tensor | None], counted: dict[int, list[int]]) -> int:
    """Bytes of the distinct storages of ``tensors`` not among ``counted``."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tensors if t is not None}
    return sum(n for ptr, n in storages.items() if ptr not in counted)


def memory_summary(estimate: list[tuple[str, int]], measured: dict[str, int],
                   comm: CommunicationController) -> dict[str, dict[str, int]]:
    """``summary.json``'s ``memory``: the estimate and the measurement of the rank whose measured
    total is the largest, side by side per category."""
    names = list(measured)
    rows = comm.all_gather(torch.tensor([measured[n] for n in names], dtype=torch.float64),
                           axis="world")
    largest = max(rows, key=lambda row: float(row[names.index("total")]))
    return {"estimate": dict(estimate),
            "measured": {n: int(v) for n, v in zip(names, largest.tolist(), strict=True)}}
