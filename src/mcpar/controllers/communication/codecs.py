"""The built-in gradient codecs, registered by name (the contract: ``mcpar.registry.codec``).

Each entry is the one place that knows its codec: the rules it runs under (``problems``), what
the cost and memory models count for it, and the exchange it builds for a run (``build``).

- ``none``: the bucketed all-reduce of full-precision gradients;
- ``fp16`` / ``bf16``: the same all-reduce, cast to 16 bits on the wire (bf16 is also the
  hierarchical parameter store's inter-node codec under ZeRO-3);
- ``1bit``: 1-bit Adam (error-compensated signs of the momentum, ``comm/compression.py``);
- ``powersgd``: rank-r factors with error feedback (``comm/powersgd.py``), flat over the data
  axis: a hierarchical PowerSGD would compress only what crosses nodes, which does not exist;
- ``int8``: the parameter store's inter-node gradient reduce-scatter, block-quantized with error
  feedback (ZeRO-3 with ``allocation: topology_aware`` only).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from mcpar.config import JobConfig
from mcpar.registry.codec import (
    CODECS,
    INT8_BYTES,
    ExchangeFacts,
    GradientCodec,
    Wire,
    WireCost,
)

# The entries' rules and prices are read without torch (`mcpar check`, the planner); each
# build imports the runtime it builds.
if TYPE_CHECKING:
    import torch

    from mcpar.controllers.communication.controller import CommunicationController
    from mcpar.controllers.communication.exchanges import GradExchange, OneBitExchange
    from mcpar.controllers.communication.grad_sync import DataParallelGradSync


@dataclass(frozen=True)
class ExchangeContext:
    """What a codec's build gets: the job, its plan's terms, the controller, the sync it
    drives, the optimizer."""

    cfg: JobConfig  # the job's model, optimization and parallelism (the plan has the rest)
    topology: str  # the data axis' planned algorithm
    overlap: bool  # buckets may reduce from the backward pass
    settings: Mapping[str, object]  # the entry's ``settings``, read when the job was planned
    comm: CommunicationController
    sync: DataParallelGradSync
    optimizer: torch.optim.Optimizer
    seed: int


class RuntimeCodec(GradientCodec):
    """A codec that trains: its entry builds the replicated (ZeRO 0) gradient exchange."""

    strategy = "allreduce"  # the exchange's name in plan.json

    def build(self, ctx: ExchangeContext) -> tuple[GradExchange, str]:
        from mcpar.controllers.communication.exchanges import AllReduceExchange

        exchange = AllReduceExchange(ctx.comm)
        return exchange, f"gradient exchange: {ctx.topology} all-reduce"

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        if self.name != "none" and facts.dp == 1:
            return [("compression", "compression acts on the data-parallel exchange, and this "
                     "layout has data 1; use more data-parallel ranks or compression 'none' / "
                     "optimizer 'adamw'")]
        return []


def _not_under_zero(name: str, facts: ExchangeFacts) -> list[tuple[str, str]]:
    if facts.zero_stage > 0:
        return [("compression", f"{name!r} is not applied to ZeRO's reduce-scatter; use "
                 "compression 'none' with zero_stage > 0")]
    return []


def _needs_store(name: str, facts: ExchangeFacts) -> list[tuple[str, str]]:
    if facts.zero_stage > 0 and not facts.store:
        return [("compression", f"{name!r} applies to the hierarchical parameter store's "
                 "inter-node reduce-scatter; set controllers.memory.allocation 'topology_aware' "
                 "(zero_stage 3) or compression 'none'")]
    return []


class NoCodec(RuntimeCodec):
    name = "none"
    summary = "full-precision gradients, bucketed all-reduce"


class Cast16(RuntimeCodec):
    """A 16-bit cast of each bucket on the wire."""

    def build(self, ctx: ExchangeContext) -> tuple[GradExchange, str]:
        from mcpar.controllers.communication.exchanges import AllReduceExchange

        return (AllReduceExchange(ctx.comm, self.name),
                f"gradient exchange: {ctx.topology} all-reduce, {self.name} on the wire")

    def wire_grad_bytes(self, grad_bytes: float, store: bool) -> float:
        # With the store, the cast applies to its inter-node stage only (store_grad_bytes).
        return grad_bytes if store else min(grad_bytes, 2.0)

    def store_grad_bytes(self, grad_bytes: float) -> float:
        return min(grad_bytes, 2.0)


class Fp16(Cast16):
    name = "fp16"
    summary = "gradients cast to fp16 on the all-reduce"

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        return super().problems(facts) + _not_under_zero(self.name, facts)

    def worth_pricing(self, precision: str, zero_stage: int, store: bool) -> bool:
        # fp16 training's gradients are 16-bit already below stage 2; the store casts in bf16.
        return precision == "fp16" and zero_stage >= 2 and not store


class Bf16(Cast16):
    name = "bf16"
    summary = "gradients cast to bf16 on the all-reduce (or the store's inter-node stage)"

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        return super().problems(facts) + _needs_store(self.name, facts)

    def worth_pricing(self, precision: str, zero_stage: int, store: bool) -> bool:
        if precision == "fp16":
            return zero_stage >= 2 and store
        return not (precision == "fp32" and zero_stage < 2)


class OneBit(RuntimeCodec):
    name = "1bit"
    summary = "1-bit Adam: error-compensated signs of the momentum past the freeze step"
    strategy = "onebit"

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        problems = super().problems(facts)
        if facts.zero_stage > 0:
            problems.append(("zero_stage", "1-bit Adam needs the whole momentum on every "
                             "data-parallel rank and cannot shard optimizer state; use "
                             "zero_stage 0"))
        return problems

    def build(self, ctx: ExchangeContext) -> tuple[GradExchange, str]:
        from mcpar.controllers.communication.exchanges import onebit_exchange
        from mcpar.optim.onebit_adam import OneBitAdam

        if not isinstance(ctx.optimizer, OneBitAdam):
            raise ValueError("the onebit gradient exchange needs the OneBitAdam optimizer")
        exchange: OneBitExchange
        exchange, text = onebit_exchange(ctx.cfg, ctx.overlap, ctx.comm, ctx.sync,
                                         ctx.optimizer)
        return exchange, text

    def price(self, wire: Wire) -> WireCost:
        comm = wire.calls * wire.onebit_all_reduce(wire.count / wire.calls)
        # Error feedback, sign packing and unpacking: a few fp32 passes over the buffer. The
        # momentum is exchanged inside the optimizer step, after the backward: nothing hides it.
        return WireCost(comm, wire.stream(7 * 4.0 * wire.count), overlappable=False)

    def error_state_bytes(self, params: float, dp_group: int) -> float:
        return 4.0 * params * (1 + 1 / dp_group)  # worker + server error


class PowerSGD(RuntimeCodec):
    name = "powersgd"
    summary = "rank-r factors with error feedback (PowerSGD), flat over the data axis"
    strategy = "powersgd"

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        problems = super().problems(facts) + _not_under_zero(self.name, facts)
        if facts.topology != "flat":
            problems.append(("topology", f"{facts.topology!r} cannot be combined with "
                             "compression 'powersgd', which runs over the whole data axis in "
                             "one group; use topology 'flat' with PowerSGD, or compression "
                             "'1bit' / 'fp16' / 'bf16' with a hierarchical topology"))
        return problems

    def settings(self, section: Mapping[str, object]) -> dict[str, object]:
        return {"powersgd_rank": section["powersgd_rank"],
                "powersgd_start_step": section["powersgd_start_step"]}

    def build(self, ctx: ExchangeContext) -> tuple[GradExchange, str]:
        from mcpar.comm.powersgd import PowerSGDCompressor
        from mcpar.controllers.communication.exchanges import PowerSGDExchange

        rank, start = ctx.settings["powersgd_rank"], ctx.settings["powersgd_start_step"]
        assert isinstance(rank, int) and isinstance(start, int)
        compressor = PowerSGDCompressor(rank, start_iter=start, seed=ctx.seed)
        return (PowerSGDExchange(ctx.comm, compressor),
                f"gradient exchange: PowerSGD rank {compressor.rank}, flat over "
                f"{ctx.comm.axis_size('dp')} data-parallel ranks")

    def price(self, wire: Wire) -> WireCost:
        rank = wire.low_rank
        values = wire.low_rank_values(rank)
        comm = 2 * wire.calls * wire.all_reduce(4.0 * values / wire.calls)
        # P = M Q and Q = M^T P over every gradient matrix (2 n m r FLOPs each), plus error
        # feedback passes.
        return WireCost(comm, wire.gemm_seconds(4.0 * rank * wire.count)
                        + wire.stream(5 * 4.0 * wire.count))

    def error_state_bytes(self, params: float, dp_group: int) -> float:
        return 4.0 * params  # error feedback


class Int8(RuntimeCodec):
    name = "int8"
    summary = "the parameter store's inter-node reduce-scatter in int8 with error feedback"
    store_all_to_all = True

    def problems(self, facts: ExchangeFacts) -> list[tuple[str, str]]:
        problems = super().problems(facts)
        if facts.zero_stage == 0:
            problems.append(("compression", "'int8' compresses the hierarchical parameter "
                             "store's inter-node reduce-scatter; set zero_stage 3 and "
                             "allocation 'topology_aware', or use fp16/bf16/1bit/powersgd"))
        problems += _needs_store(self.name, facts)
        if facts.ep > 1:
            problems.append(("compression", "'int8' is not applied to expert weights' "
                             "reduce-scatter; use 'bf16' or 'none' with parallelism.experts > 1"))
        return problems

    def store_grad_bytes(self, grad_bytes: float) -> float:
        return INT8_BYTES

    def store_error_bytes(self, shard_params: float) -> float:
        # qgZ's error feedback: fp32 residuals of the shard each rank quantizes.
        return 4.0 * shard_params


for _codec in (NoCodec(), Fp16(), Bf16(), OneBit(), PowerSGD(), Int8()):
    CODECS.register(_codec)
