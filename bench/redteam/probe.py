"""What a probe is: its folder (``Ctx``), its command line and expectation (``Probe``), the
refusal to run it here (``Skip``), and the environment every probed command runs in."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
        "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
        "optimization.warmup_steps=5"]


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


@dataclass
class Ctx:
    """One probe's folder: ``work`` (the cwd), ``sandbox`` (must stay unread), FIFOs to watch."""
    work: Path
    sandbox: Path
    fixtures: Path
    src: Path
    fifos: list[Path] = field(default_factory=list)
    mounts: list[Path] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Probe:
    name: str
    family: str
    expect: int  # 2: refused in one line; 0: runs
    setup: Callable[[Ctx], list[str | bytes]]
    timeout: float = 60.0
    old_code: bool = True  # False: not run on the code before the fixes (say why in skip_old)
    skip_old: str = ""
    needs_mount: bool = False
    needle: str = ""  # what the one line of a refusal must name (the key or option, the file)


class Skip(Exception):
    pass


def command_env(src: Path, extra: dict[str, str]) -> dict[str, str]:
    """This process's environment for a command of the tree ``src``: its ``src`` first on
    PYTHONPATH, no torchrun variables of ours, ``extra`` on top."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                        "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env["PYTHONPATH"] = os.pathsep.join([str(src / "src"), env.get("PYTHONPATH", "")]).strip(
        os.pathsep)
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}
