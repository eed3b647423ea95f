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
from mcpar.registry import LAYOUT_KEYS
from mcpar.registry.recompute import RECOMPUTE_POLICIES, RecomputeFacts
from mcpar.registry.zero import ZeroFacts
from mcpar.registry.zero import zero_stage as zero_stage_entry


def unsupported_settings(cfg: JobConfig) -> list[str]:
    """One problem line per setting `mcpar train` cannot honour in this version."""
    ctl = cfg.controllers
    checks: list[tuple[str, object, object]] = [
        # (key, value in the config, the value that works today)
    ]
    problems = [
        problem(key, f"{value!r} is not available for training in this version; use {works!r}")
        for key, value, works in checks
        if value != works
    ]
    policy = RECOMPUTE_POLICIES.get(ctl.memory.activation_checkpointing)
    problems += [problem(RECOMPUTE_POLICIES.key, text)
                 for text in policy.unsupported(RecomputeFacts(is_moe=cfg.model.is_moe))]
    if ctl.memory.zero_stage == 0:  # with ZeRO, the plan checks them (controllers/memory)
        problems += zero_layout_problems(0, 1, allocation=ctl.memory.allocation,
                                         weight_gather=ctl.communication.weight_gather)
    return problems + expert_problems(cfg) + offload_problems(cfg) + environment_problems(cfg)


def offload_problems(cfg: JobConfig) -> list[str]:
    """Offload settings a run cannot honour (the offload_dir's path: ``path_checks.py``)."""
    mem, key = cfg.controllers.memory, "controllers.memory.offload"
    if mem.offload == "none":
        return [problem("controllers.memory.offload_dir", "applies to offload 'nvme', and "
                        "offload is 'none'; remove offload_dir or set offload 'nvme'")
                ] if mem.offload_dir is not None else []
    problems = []
    if mem.offload == "cpu" and (cfg.training.device == "cpu" or (
            cfg.training.device == "auto" and not _cuda_visible())):
        problems.append(problem(key, "'cpu' is not available on a CPU device: it moves the "
                                "optimizer state from the device to host memory, where this "
                                "run's state already lives (nothing to move); use 'nvme' "
                                "(state in files) or 'none'"))
    if mem.offload_dir is not None and mem.offload != "nvme":
        problems.append(problem("controllers.memory.offload_dir", f"applies to offload 'nvme', "
                                f"and offload is {mem.offload!r}; remove offload_dir or set "
                                "offload 'nvme'"))
    if (cfg.optimization.optimizer == "onebit_adam"
            or cfg.controllers.communication.compression == "1bit"):
        problems.append(problem(key, f"{mem.offload!r} offloads AdamW's state, and 1-bit Adam "
                                "(optimization.optimizer onebit_adam or compression 1bit) keeps "
                                "state of its own on the device; use offload 'none' with 1-bit "
                                "Adam, or AdamW"))
    if cfg.controllers.compute.scheduler != "static":
        problems.append(problem(key, f"{mem.offload!r}: the expert load balancer moves experts "
                                "with their optimizer state, which is offloaded; use "
                                "controllers.compute.scheduler 'static' or offload 'none'"))
    return problems


def _cuda_visible() -> bool:
    # The device check of training.device 'auto' (device.select_device); torch is imported
    # only where CUDA is possible here.
    from mcpar.device_select import cuda_available

    return cuda_available()


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
    if par.experts > 1 and not model.is_moe:
        problems.append(problem(
            "parallelism.experts",
            f"{par.experts} needs a model with experts: set model.kind 'moe' or 'llama_moe', "
            "or use 1",
        ))
    scheduler = ctl.compute.scheduler
    if scheduler != "static" and (not model.is_moe or par.experts == 1):
        problems.append(problem(
            "controllers.compute.scheduler",
            f"{scheduler!r} balances experts over expert-parallel ranks; it needs model.kind "
            "'moe' or 'llama_moe' and parallelism.experts > 1 (or use 'static')",
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


def zero_layout_problems(zero_stage: int, dp: int, *, pp: int = 1, vp: int = 1,
                         topology: str = "flat",
                         allocation: str = "default", weight_gather: str = "none",
                         scheduler: str = "static", splits_backward: bool = False) -> list[str]:
    """The ZeRO and parameter-store combinations ``mcpar train`` cannot run, one problem per key.

    One rule set, the stage's registry entry (``mcpar.registry.zero``), for ``mcpar check`` and
    ``mcpar train`` (through ``controllers/memory/zero_plan.py``) and the planner
    (``mcpar.sim.planner``), so that a layout the planner ranks is one that trains. Arguments
    are plain values: the planner has layouts, not job configs."""
    facts = ZeroFacts(dp, pp=pp, vp=vp, topology=topology, allocation=allocation,
                      weight_gather=weight_gather, scheduler=scheduler,
                      splits_backward=splits_backward)
    # The stage's own rules (its registry entry).
    return [problem(LAYOUT_KEYS[field], text) for field, text in
            zero_stage_entry(zero_stage).problems(facts)]
