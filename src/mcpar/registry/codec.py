"""The contract of a gradient codec entry (the built-ins: ``controllers/communication/
codecs.py``): what crosses the data-parallel wire, the rules it runs under, and its terms.

One entry per codec holds:
- ``problems(facts)``: every combination the codec cannot run with, as (layout field, text);
  ``mcpar check``, ``mcpar train``, ``mcpar simulate`` and the planner all apply these and only
  these, so they accept and refuse the same layouts with the same words. ``LAYOUT_KEYS`` turns
  a field into the config key a config's problem names;
- ``price(wire)``: seconds and encoding work of the replicated (ZeRO 0) gradient exchange,
  composed from the cost model's collective primitives (``Wire``);
- ``wire_grad_bytes`` / ``error_state_bytes`` and the parameter store's terms: what the cost
  model and the memory model count for it;
- the runtime build lives on the controller's subclass (``RuntimeCodec``), since the cost model
  below the controllers must price a codec it cannot build.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from mcpar.registry import LAYOUT_KEYS, Registry

__all__ = ["CODECS", "LAYOUT_KEYS", "ExchangeFacts", "GradientCodec", "Wire", "WireCost"]

INT8_BYTES = 1.0 + 4.0 / 256  # one byte per element plus an fp32 scale per 256-element block



@dataclass(frozen=True)
class ExchangeFacts:
    """What a codec's rules look at, taken from a config or from a simulated layout alike."""

    dp: int
    ep: int = 1
    zero_stage: int = 0
    topology: str = "flat"  # flat | hierarchical | hybrid (the simulator's 'auto')
    allocation: str = "default"  # default | topology_aware (the hierarchical parameter store)
    onebit_optimizer: bool = False  # optimization.optimizer is onebit_adam

    @property
    def store(self) -> bool:
        return self.allocation == "topology_aware"


@dataclass(frozen=True)
class WireCost:
    comm_s: float  # seconds on the wire
    encode_s: float = 0.0  # compression work on the critical path
    overlappable: bool = True  # started bucket by bucket from the backward pass


class Wire(Protocol):
    """The cost model's view of one replicated gradient exchange (one parameter group)."""

    count: float  # gradient elements this rank exchanges
    calls: int  # collective calls (buckets)
    grad_bytes: float  # bytes per element of the gradient as the codec leaves it
    hierarchical: bool  # the data axis' algorithm is not the flat ring
    low_rank: int  # the rank a low-rank codec is priced at

    def all_reduce(self, nbytes: float) -> float: ...  # one call of `nbytes`
    def all_gather(self, nbytes: float) -> float: ...
    def onebit_all_reduce(self, values: float) -> float: ...  # 1-bit compressed, `values` long
    def stream(self, nbytes: float) -> float: ...  # a memory-bound pass over `nbytes`
    def gemm_seconds(self, flops: float) -> float: ...
    def low_rank_values(self, rank: int) -> float: ...  # P and Q elements at this rank


class GradientCodec:
    """A gradient codec. Subclasses set ``name`` and override what differs from 'none'."""

    name: str = ""
    summary: str = ""

    def settings(self, section: Mapping[str, object]) -> dict[str, object]:
        """What the codec's build needs from the config's ``controllers.communication`` section
        (as a dict), read once when the job is planned and carried by the plan."""
        return {}

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        return []

    def wire_grad_bytes(self, grad_bytes: float, store: bool) -> float:
        """Bytes per gradient element on the data-parallel exchange."""
        return grad_bytes

    def price(self, wire: Wire) -> WireCost:
        """The replicated (ZeRO 0) exchange: by default a bucketed all-reduce."""
        return WireCost(wire.calls * wire.all_reduce(wire.count * wire.grad_bytes / wire.calls))

    def error_state_bytes(self, params: float, dp_group: int) -> float:
        """Per-rank state the codec keeps between steps (error feedback), in bytes."""
        return 0.0

    # The hierarchical parameter store's inter-node gradient stage (ZeRO-3, topology_aware).
    def store_grad_bytes(self, grad_bytes: float) -> float:
        return grad_bytes

    store_all_to_all: bool = False  # the stage is an all-to-all (else a ring reduce-scatter)

    def store_error_bytes(self, shard_params: float) -> float:
        return 0.0

    def worth_pricing(self, precision: str, zero_stage: int, store: bool) -> bool:
        """Whether the planner should try it (a 16-bit cast of 16-bit gradients buys nothing)."""
        return True


CODECS: Registry[GradientCodec] = Registry("gradient codec",
                                           "controllers.communication.compression")


def codec_problems(codec: str, facts: ExchangeFacts) -> list[tuple[str, str]]:
    """The codec's rules for `facts` (an unknown name is one problem)."""
    if codec not in CODECS:
        return [("compression", CODECS.unknown(codec))]
    return CODECS.get(codec).problems(facts)
