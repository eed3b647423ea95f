"""What this build can train, and a clear refusal for what it cannot.

The schema accepts the whole MCP configuration (so plans of the seed's 1024-device layout can be
checked, and the seed's file, which names no model, loads), but ``mcpar train`` must never accept
a setting and then silently ignore it. Two kinds of refusals live here, both with the key and the
value that works:
- settings whose mechanism has not landed (they leave the list as their mechanisms land);
- combinations that have nothing to act on in a real run (an expert axis without experts, a load
  balancer without expert ranks to balance) or that this version does not combine (gradient
  compression with expert parallelism).
"""

from __future__ import annotations

import importlib.util

from mcpar.config import JobConfig
from mcpar.errors import problem


def unsupported_settings(cfg: JobConfig) -> list[str]:
    """One problem line per setting `mcpar train` cannot honour in this version."""
    ctl = cfg.controllers
    checks: list[tuple[str, object, object]] = [
        # (key, value in the config, the value that works today)
        ("controllers.memory.allocation", ctl.memory.allocation, "default"),
        ("controllers.memory.offload", ctl.memory.offload, "none"),
        ("controllers.memory.activation_checkpointing", ctl.memory.activation_checkpointing,
         "none"),
    ]
    problems = [
        problem(key, f"{value!r} is not available for training in this version; use {works!r}")
        for key, value, works in checks
        if value != works
    ]
    return problems + expert_problems(cfg) + environment_problems(cfg)


def environment_problems(cfg: JobConfig) -> list[str]:
    """What a worker would only notice once started (and the launcher would restart the job
    for): optional packages a setting needs, and settings the data source would ignore."""
    problems = []
    if cfg.training.tensorboard and importlib.util.find_spec("tensorboard") is None:
        problems.append(problem(
            "training.tensorboard", "needs the tensorboard package, which is not installed; "
            "pip install 'mcpar[tensorboard]' or set training.tensorboard=false"))
    if (cfg.optimization.checkpoint.compression == "zstd"
            and importlib.util.find_spec("zstandard") is None
            and importlib.util.find_spec("pyzstd") is None):
        problems.append(problem(
            "optimization.checkpoint.compression", "'zstd' needs the zstandard package, which "
            "is not installed; pip install 'mcpar[zstd]' or set it to 'none'"))
    if cfg.data.token_dtype is not None and not cfg.data.source.endswith(".bin"):
        # Only a .bin file is read as token ids: the setting would be silently ignored.
        problems.append(problem(
            "data.token_dtype", f"applies to a .bin file of token ids, but data.source "
            f"{cfg.data.source!r} is read as text; remove data.token_dtype or point "
            "data.source at a .bin file"))
    return problems


def expert_problems(cfg: JobConfig) -> list[str]:
    """Expert settings a training run cannot honour."""
    par, model, ctl, opt = cfg.parallelism, cfg.model, cfg.controllers, cfg.optimization
    problems = []
    if par.experts > 1 and model.kind != "moe":
        problems.append(problem(
            "parallelism.experts",
            f"{par.experts} needs a model with experts: set model.kind 'moe' or use 1",
        ))
    scheduler = ctl.compute.scheduler
    if scheduler != "static" and (model.kind != "moe" or par.experts == 1):
        problems.append(problem(
            "controllers.compute.scheduler",
            f"{scheduler!r} balances experts over expert-parallel ranks; it needs model.kind "
            "'moe' and parallelism.experts > 1 (or use 'static')",
        ))
    compression = ctl.communication.compression
    if par.experts > 1 and (compression != "none" or opt.optimizer == "onebit_adam"):
        key = ("controllers.communication.compression" if compression != "none"
               else "optimization.optimizer")
        problems.append(problem(
            key, "gradient compression is not supported with parallelism.experts > 1 (expert "
            "weights are reduced over their own replicas, uncompressed); use compression "
            "'none' and optimizer 'adamw', or parallelism.experts 1",
        ))
    return problems
