"""What this build can train, and a clear refusal for what it cannot yet.

The schema accepts the whole MCP configuration (so plans of the seed's 1024-device layout can be
checked), but ``mcpar train`` must never accept a setting and then silently ignore it. Each entry
below is a setting whose mechanism has not landed: training refuses it with the key and the value
that works. Entries leave this list as their mechanisms land.
"""

from __future__ import annotations

from mcpar.config import JobConfig
from mcpar.errors import problem


def unsupported_settings(cfg: JobConfig) -> list[str]:
    """One problem line per setting `mcpar train` cannot honour in this version."""
    par, ctl, model = cfg.parallelism, cfg.controllers, cfg.model
    checks: list[tuple[str, object, object]] = [
        # (key, value in the config, the value that works today)
        ("model.kind", model.kind, "gpt"),
        ("parallelism.experts", par.experts, 1),
        ("controllers.compute.scheduler", ctl.compute.scheduler, "static"),
        ("controllers.memory.allocation", ctl.memory.allocation, "default"),
        ("controllers.memory.offload", ctl.memory.offload, "none"),
        ("controllers.memory.zero_stage", ctl.memory.zero_stage, 0),
        ("controllers.memory.activation_checkpointing", ctl.memory.activation_checkpointing,
         "none"),
    ]
    return [
        problem(key, f"{value!r} is not available for training in this version; use {works!r}")
        for key, value, works in checks
        if value != works
    ]
