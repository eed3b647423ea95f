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
from dataclasses import dataclass

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


def zero_layout_problems(zero_stage: int, dp: int, *, pp: int = 1, vp: int = 1, cp: int = 1,
                         topology: str = "flat",
                         allocation: str = "default", weight_gather: str = "none",
                         scheduler: str = "static", splits_backward: bool = False) -> list[str]:
    """The ZeRO and parameter-store combinations ``mcpar train`` cannot run, one problem per key.

    One rule set, the stage's registry entry (``mcpar.registry.zero``), for ``mcpar check`` and
    ``mcpar train`` (through ``controllers/memory/zero_plan.py``) and the planner
    (``mcpar.sim.planner``), so that a layout the planner ranks is one that trains. Arguments
    are plain values: the planner has layouts, not job configs."""
    facts = ZeroFacts(dp, pp=pp, vp=vp, cp=cp, topology=topology, allocation=allocation,
                      weight_gather=weight_gather, scheduler=scheduler,
                      splits_backward=splits_backward)
    # The stage's own rules (its registry entry).
    return [problem(LAYOUT_KEYS[field], text) for field, text in
            zero_stage_entry(zero_stage).problems(facts)]


@dataclass(frozen=True)
class ContextFacts:
    """What context parallelism's rules read, as plain values: the plan has a job config, the
    planner (``mcpar.sim.planner``) a layout and a model shape."""

    cp: int
    mode: str = "ring"
    seq_len: int = 0
    heads_per_tensor_rank: int = 1  # the query heads a tensor rank holds
    zero_stage: int = 0
    allocation: str = "default"  # 'topology_aware': ZeRO-3's node-local cache
    recompute: str = "none"
    compression: str = "none"
    topology: str = "flat"  # the config's spelling: flat | hierarchical | hybrid
    dropout: bool = False
    compile: bool = False
    kind: str = ""  # the model kind, named when it has no context-parallel plan
    has_plan: bool = True  # the family splits its attention and positions over the axis


def context_layout_problems(f: ContextFacts) -> list[str]:
    """Context parallelism's rules: the sequence's zigzag cut, Ulysses' head split, and every
    combination not built yet (refused, never ignored). One rule set for ``mcpar check`` and
    ``mcpar train`` (``plan.context_problems``) and the planners (``mcpar.sim.planner``,
    ``parallelism.auto`` through the plan), so that a layout they choose is one that trains."""
    cp = f.cp
    if cp == 1:
        return []
    problems: list[str] = []
    if f.seq_len % (2 * cp):
        problems.append(problem(
            "model.seq_len",
            f"{f.seq_len} is not divisible by 2 x parallelism.context {cp} (the sequence is "
            f"cut into 2 x {cp} chunks, rank i holding chunks i and {2 * cp - 1}-i); use a "
            f"multiple of {2 * cp}",
        ))
    if f.mode == "ulysses" and f.heads_per_tensor_rank % cp:
        problems.append(problem(
            "parallelism.context_mode",
            f"ulysses splits the {f.heads_per_tensor_rank} attention heads of a tensor rank "
            f"over parallelism.context {cp}, which does not divide them; use context_mode "
            f"'ring' or a context degree dividing {f.heads_per_tensor_rank}",
        ))
    if not f.has_plan:
        problems.append(problem(
            "parallelism.context",
            f"model kind '{f.kind}' has no context-parallel plan (its attention and "
            "positions are not split over the context axis); use parallelism.context 1",
        ))
    # What context parallelism does not combine with yet: (key, what would be wrong, the fix).
    unsupported = [
        # ZeRO shards over data x context ('dp_cp'), but the store's node cache splits the
        # data axis alone by node.
        (f.zero_stage == 3 and f.allocation == "topology_aware",
         "controllers.memory.allocation", "the hierarchical parameter store's node cache",
         "use 'default'"),
        (f.recompute != "none", "controllers.memory.activation_checkpointing",
         "activation recompute", "use 'none'"),
        (f.compression != "none", "controllers.communication.compression",
         "gradient compression", "use 'none'"),
        (f.topology != "flat", "controllers.communication.topology",
         "hierarchical gradient reduction", "use 'flat'"),
        (f.dropout, "model.dropout", "dropout (each rank would draw its own masks)", "use 0"),
        (f.compile, "training.compile", "torch.compile of the blocks", "set it to false"),
    ]
    for bad, key, what, fix in unsupported:
        if bad:
            problems.append(problem(
                "parallelism.context",
                f"context {cp} with {what} ({key}) is not supported yet; {fix}, or use "
                "parallelism.context 1",
            ))
    return problems
