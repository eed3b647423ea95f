"""The CommunicationController's choice of gradient exchange, and its build.

The controller chooses ONE strategy when the job is planned (:func:`plan_grad_exchange`,
recorded in the run's ``plan.json``) and builds it with the job (:func:`build_grad_exchange`).
Under ZeRO (stage 1-3) the MemoryController's shards decide: a reduce-scatter into each rank's
shard. Otherwise the codec's registry entry (``codecs.py``, or a plug-in) builds its exchange;
the rules a codec runs under are its entry's ``problems``, applied here for configs and by the
cost model and the planner for layouts.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from mcpar.config import JobConfig
from mcpar.controllers.communication.codecs import ExchangeContext, RuntimeCodec
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.exchanges import GradExchange, ReduceScatterExchange
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.errors import problem
from mcpar.registry.codec import CODECS, LAYOUT_KEYS, ExchangeFacts, codec_problems


@dataclass(frozen=True)
class GradExchangePlan:
    """The planned gradient exchange of a job."""

    strategy: str  # 'none', 'reduce_scatter' (ZeRO), or the codec's: 'allreduce', 'onebit', ...
    topology: str  # the data axis' algorithm: 'flat', 'hierarchical' or 'hybrid'
    codec: str  # the registered codec: what crosses the wire
    bucket_size_mb: float
    overlap: bool  # buckets start reducing from the backward pass

    def to_json(self) -> dict[str, object]:
        return asdict(self)


def uses_onebit_adam(cfg: JobConfig) -> bool:
    """1-bit Adam runs when either key asks for it: it is AdamW whose momentum is exchanged
    in 1 bit past the freeze step."""
    return (cfg.controllers.communication.compression == "1bit"
            or cfg.optimization.optimizer == "onebit_adam")


def config_codec(cfg: JobConfig) -> str:
    """The codec a config runs: its compression, or 1-bit when the optimizer asks for it."""
    return "1bit" if uses_onebit_adam(cfg) else cfg.controllers.communication.compression


def exchange_facts(cfg: JobConfig, dp: int) -> ExchangeFacts:
    ctl = cfg.controllers
    return ExchangeFacts(dp=dp, ep=cfg.parallelism.experts, zero_stage=ctl.memory.zero_stage,
                         topology=ctl.communication.topology, allocation=ctl.memory.allocation,
                         onebit_optimizer=cfg.optimization.optimizer == "onebit_adam")


def codec_config_problems(cfg: JobConfig, dp: int) -> list[str]:
    """The codec entry's rules for this config, each naming its config key (the optimizer's,
    where 1-bit Adam was asked for by the optimizer alone)."""
    keys = dict(LAYOUT_KEYS)
    if cfg.controllers.communication.compression == "none":
        keys["compression"] = "optimization.optimizer"
    return [problem(keys[field], text)
            for field, text in codec_problems(config_codec(cfg), exchange_facts(cfg, dp))]


def plan_grad_exchange(cfg: JobConfig, dp: int) -> GradExchangePlan:
    """The controller's choice of gradient exchange for this config and data degree."""
    comm = cfg.controllers.communication
    if dp == 1:
        strategy, codec = "none", "none"
    elif cfg.controllers.memory.zero_stage > 0:
        strategy, codec = "reduce_scatter", "none"
    else:
        codec = config_codec(cfg)
        entry = CODECS.get(codec)
        strategy = entry.strategy if isinstance(entry, RuntimeCodec) else "allreduce"
    topology = comm.topology if dp > 1 else "flat"
    return GradExchangePlan(strategy, topology, codec, comm.bucket_size_mb, comm.overlap)


def build_grad_exchange(plan: GradExchangePlan, cfg: JobConfig, comm: CommunicationController,
                        sync: DataParallelGradSync, optimizer: torch.optim.Optimizer,
                        seed: int) -> tuple[GradExchange, str]:
    """The planned strategy, wired into ``sync``; and a line for the start-up log saying what
    runs."""
    exchange: GradExchange
    if plan.strategy == "reduce_scatter":
        exchange = ReduceScatterExchange(comm)
        text = (f"gradient exchange: ZeRO stage {cfg.controllers.memory.zero_stage}, "
                f"reduce-scatter over {comm.axis_size('dp')} data-parallel ranks")
    else:
        entry = CODECS.get(plan.codec)
        if not isinstance(entry, RuntimeCodec):
            raise ValueError(f"gradient codec {plan.codec!r} is priced only: it has no build")
        exchange, text = entry.build(ExchangeContext(cfg, plan.topology, comm, sync, optimizer,
                                                     seed))
    sync.set_exchange(exchange)
    return exchange, text
