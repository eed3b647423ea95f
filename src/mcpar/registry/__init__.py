"""One registry per decision: pipeline schedules, gradient codecs, model families (and the
memory options as they move in). An entry is the one place that knows its name, its problems
for a layout, its cost and memory terms and its build; the config, the plan, the runtime,
``mcpar check``, the cost model and the planner all ask the registry and never test a name.

The containers and the entries' contracts live here, at the bottom of the layering, so that the
cost model (below the controllers) can price an entry it does not import. The built-in entries
live with the controller that owns the decision (``controllers/compute/pipeline_schedules.py``,
``controllers/communication/codecs.py``) or in their family's package (``models/<family>/``)
and are loaded on the first lookup, the way a plug-in system loads its entry points; a plug-in
registers its own with ``register``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, Generic, Protocol, TypeVar

from pydantic import AfterValidator

# A layout field (the simulator's Layout spells them so) -> its config key.
LAYOUT_KEYS = {
    "tp": "parallelism.tensor", "pp": "parallelism.pipeline",
    "cp": "parallelism.context", "context_mode": "parallelism.context_mode",
    "vp": "parallelism.virtual_stages", "dp": "parallelism.data", "ep": "parallelism.experts",
    "seq_parallel": "parallelism.sequence_parallel",
    "schedule": "parallelism.schedule",
    "zero_stage": "controllers.memory.zero_stage",
    "recompute": "controllers.memory.activation_checkpointing",
    "compression": "controllers.communication.compression",
    "topology": "controllers.communication.topology",
    "allocation": "controllers.memory.allocation",
    "weight_gather": "controllers.communication.weight_gather",
    "scheduler": "controllers.compute.scheduler",
    "optimizer": "optimization.optimizer",
    "global_batch": "optimization.global_batch_size",
    "micro_batch": "optimization.micro_batch_size",
    "gradient_accumulation": "optimization.gradient_accumulation", "precision": "training.dtype",
    "num_gpus": "parallelism",
}


class Named(Protocol):
    name: str


T = TypeVar("T", bound=Named)

# The module whose import registers every built-in entry (see the docstring).
BUILTINS = "mcpar.controllers.registered"
_builtins_loaded = False


class Registry(Generic[T]):
    """Entries of one decision, by name, in registration order."""

    def __init__(self, what: str, key: str):
        self.what = what  # "pipeline schedule"
        self.key = key  # the config key that names an entry
        self._entries: dict[str, T] = {}

    def register(self, entry: T, *, replace: bool = False) -> T:
        if entry.name in self._entries and not replace:
            raise ValueError(f"{self.what} {entry.name!r} is registered already")
        self._entries[entry.name] = entry
        return entry

    def unregister(self, name: str) -> None:
        self._entries.pop(name, None)

    def _loaded(self) -> dict[str, T]:
        # Once per process: the planner and the cost model look entries up per layout.
        global _builtins_loaded
        if not _builtins_loaded:
            importlib.import_module(BUILTINS)
            _builtins_loaded = True
        return self._entries

    def __contains__(self, name: object) -> bool:
        return name in self._loaded()

    def __iter__(self) -> Iterator[T]:
        return iter(list(self._loaded().values()))

    def names(self) -> tuple[str, ...]:
        return tuple(self._loaded())

    def get(self, name: str) -> T:
        """The entry called `name`; KeyError with ``unknown(name)`` as its text."""
        try:
            return self._loaded()[name]
        except KeyError:
            raise KeyError(self.unknown(name)) from None

    def unknown(self, name: str) -> str:
        """The problem text for a name nobody registered."""
        return f"unknown {self.what} {name!r}; choose one of {', '.join(map(repr, self.names()))}"


class RegisteredName(AfterValidator):
    """``Annotated[str, RegisteredName(REGISTRY)]``: a config field naming an entry of REGISTRY
    (any registered one, plug-ins included), checked when the config is validated; the
    generated reference lists the built-in names."""

    def __init__(self, registry: Registry[Any]):
        def check(name: str) -> str:
            if name not in registry:
                raise ValueError(registry.unknown(name))
            return name

        super().__init__(check)
        object.__setattr__(self, "registry", registry)
