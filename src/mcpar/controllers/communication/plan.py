"""The CommunicationController's plan: which gradient exchange a job runs, decided once.

``plan_communication`` reads the config's ``controllers.communication`` section (and what the
other controllers decided: the data degree, the ZeRO stage) and returns a frozen ``CommPlan``;
the runtime builds from the plan (``grad_exchange.build_grad_exchange``) and never reads the
section again. Under ZeRO (stage 1-3) the MemoryController's shards decide: a reduce-scatter
into each rank's shard. Otherwise the codec's registry entry says what it runs and what its
build needs (``settings``); its rules are its entry's ``problems``, applied here for configs
and by the cost model and the planner for layouts.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from mcpar.config import JobConfig
from mcpar.controllers.communication.codecs import RuntimeCodec
from mcpar.errors import problem
from mcpar.registry.codec import CODECS, LAYOUT_KEYS, ExchangeFacts, codec_problems


@dataclass(frozen=True)
class CommPlan:
    """The planned gradient exchange of a job (``plan.json``'s ``grad_exchange``)."""

    strategy: str  # 'none', 'reduce_scatter' (ZeRO), or the codec's: 'allreduce', 'onebit', ...
    topology: str  # the data axis' algorithm: 'flat', 'hierarchical' or 'hybrid'
    codec: str  # the registered codec: what crosses the wire
    bucket_size_mb: float
    overlap: bool  # buckets start reducing from the backward pass
    zero_stage: int  # the MemoryController's, which a reduce-scatter exchange serves
    # What the codec's build reads (its entry's ``settings``), e.g. PowerSGD's rank.
    codec_settings: dict[str, object] = field(default_factory=dict, hash=False)

    def to_json(self) -> dict[str, object]:
        return {"strategy": self.strategy, "topology": self.topology, "codec": self.codec,
                "bucket_size_mb": self.bucket_size_mb, "overlap": self.overlap,
                **({"codec_settings": self.codec_settings} if self.codec_settings else {})}


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


def communication_problems(cfg: JobConfig, dp: int) -> list[str]:
    """Combinations of compression, optimizer, topology and layout that cannot work."""
    comm, opt, cluster = cfg.controllers.communication, cfg.optimization, cfg.cluster
    problems: list[str] = []
    if opt.optimizer == "onebit_adam" and comm.compression not in ("none", "1bit"):
        problems.append(problem(
            "controllers.communication.compression",
            f"{comm.compression!r} cannot be combined with optimization.optimizer "
            "'onebit_adam', which compresses the momentum in 1 bit itself; use compression "
            "'1bit' or optimizer 'adamw'",
        ))
    if uses_onebit_adam(cfg):
        if opt.freeze_step >= cfg.training.steps:
            problems.append(problem(
                "optimization.freeze_step",
                f"{opt.freeze_step} is not below training.steps {cfg.training.steps}: 1-bit "
                "Adam would never compress; use about 15-25% of the steps",
            ))
    if comm.compression == "powersgd" and comm.powersgd_start_step >= cfg.training.steps:
        problems.append(problem(
            "controllers.communication.powersgd_start_step",
            f"{comm.powersgd_start_step} is not below training.steps {cfg.training.steps}: "
            "PowerSGD would never compress",
        ))
    problems += codec_config_problems(cfg, dp)  # the codec's own rules (its registry entry)
    link = [cluster.intra_node_bandwidth_gbps, cluster.intra_node_latency_us,
            cluster.inter_node_bandwidth_gbps, cluster.inter_node_latency_us]
    if any(v is not None for v in link) and any(v is None for v in link):
        problems.append(problem(
            "cluster", "give all four of intra/inter_node_bandwidth_gbps and "
            "intra/inter_node_latency_us, or none (they are then measured)",
        ))
    return problems


def plan_communication(cfg: JobConfig, dp: int, zero_stage: int) -> CommPlan:
    """The controller's choice of gradient exchange for this config, data degree and the
    MemoryController's ZeRO stage."""
    comm = cfg.controllers.communication
    settings: dict[str, object] = {}
    if dp == 1:
        strategy, codec = "none", "none"
    elif zero_stage > 0:
        strategy, codec = "reduce_scatter", "none"
    else:
        codec = config_codec(cfg)
        entry = CODECS.get(codec)
        strategy = entry.strategy if isinstance(entry, RuntimeCodec) else "allreduce"
        settings = entry.settings(comm.model_dump())
    topology = comm.topology if dp > 1 else "flat"
    return CommPlan(strategy, topology, codec, comm.bucket_size_mb, comm.overlap, zero_stage,
                    settings)
