"""Where a worker process sits in the job, as its launcher described it: mcpar's own local
launcher, ``torchrun`` or SLURM (``detect_env``). The low part of ``mcpar.launch``: the trainer
reads a ``DistEnv`` and never the launcher itself.
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass

from mcpar.errors import UserError

DEFAULT_MASTER_PORT = 29500


@dataclass
class DistEnv:
    """Where this process sits in the job, as its launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    launcher: str  # "single" | "mcpar" | "torchrun" | "slurm"


def _int_env(env: dict[str, str] | os._Environ[str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        if default is None:
            raise UserError(f"environment variable {name} is not set; the launcher must set it")
        return default
    try:
        return int(raw)
    except ValueError:
        raise UserError(f"environment variable {name}={raw!r} is not an integer") from None


def _expand_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM's compressed per-node task counts: ``"4(x2),1"`` -> ``[4, 4, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:\(x(\d+)\))?\s*", part)
        if m is None:
            raise UserError(f"cannot parse SLURM tasks per node {spec!r}")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def _first_slurm_host(nodelist: str) -> str | None:
    if "[" not in nodelist:  # a plain "host" or "a,b" list needs no scontrol
        return nodelist.split(",")[0].strip() or None
    if shutil.which("scontrol") is None:
        return None
    try:
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                             text=True, timeout=10, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return None
    return out[0] if out else None


# What torchrun sets for every worker; a shell holding only some of them (stale exports) would
# otherwise wait the whole collective timeout for peers that never come, then trace.
TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                 "MASTER_PORT")


def _check_torchrun_env(env: dict[str, str] | os._Environ[str]) -> None:
    missing = [name for name in TORCHRUN_VARS if not env.get(name, "").strip()]
    if missing:
        present = [name for name in TORCHRUN_VARS if name not in missing]
        raise UserError(
            f"environment: {', '.join(present)} set but {', '.join(missing)} missing: this is "
            "not a complete torchrun environment; unset the stale variables to train on this "
            "machine, or launch with torchrun")
    rank, world = _int_env(env, "RANK"), _int_env(env, "WORLD_SIZE")
    local_rank, local_world = _int_env(env, "LOCAL_RANK"), _int_env(env, "LOCAL_WORLD_SIZE")
    if not (0 <= rank < world and 0 <= local_rank < local_world <= world):
        raise UserError(
            f"environment: RANK {rank} / WORLD_SIZE {world} / LOCAL_RANK {local_rank} / "
            f"LOCAL_WORLD_SIZE {local_world} are inconsistent; unset them or launch with "
            "torchrun")


def detect_env() -> DistEnv | None:
    """Return the distributed environment set by a launcher, or None when not launched."""
    env = os.environ
    # torchrun and mcpar's own launcher set the same variables; torchrun also sets
    # TORCHELASTIC_RUN_ID, which marks it even when the job has a single process.
    if "RANK" in env and ("WORLD_SIZE" in env or "TORCHELASTIC_RUN_ID" in env):
        if env.get("MCPAR_LAUNCHED") != "1":
            _check_torchrun_env(env)
        rank = _int_env(env, "RANK")
        world = _int_env(env, "WORLD_SIZE", 1)
        return DistEnv(
            rank=rank, world_size=world,
            local_rank=_int_env(env, "LOCAL_RANK", rank),
            local_world_size=_int_env(env, "LOCAL_WORLD_SIZE", world),
            master_addr=env.get("MASTER_ADDR") or "127.0.0.1",
            master_port=_int_env(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            launcher="mcpar" if env.get("MCPAR_LAUNCHED") == "1" else "torchrun",
        )
    # A one-task srun (or a login shell inside an allocation) is not a distributed job.
    if "SLURM_PROCID" in env and _int_env(env, "SLURM_NTASKS", 1) > 1:
        world = _int_env(env, "SLURM_NTASKS")
        per_node = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
        if per_node:
            counts = _expand_tasks_per_node(per_node)
            node = _int_env(env, "SLURM_NODEID", 0)
            local_world = counts[node] if 0 <= node < len(counts) else counts[0]
        else:
            local_world = max(1, world // max(1, _int_env(env, "SLURM_NNODES", world)))
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        addr = (env.get("MASTER_ADDR") or (_first_slurm_host(nodelist) if nodelist else None)
                or env.get("SLURM_LAUNCH_NODE_IPADDR") or "127.0.0.1")
        return DistEnv(
            rank=_int_env(env, "SLURM_PROCID"), world_size=world,
            local_rank=_int_env(env, "SLURM_LOCALID", 0), local_world_size=local_world,
            master_addr=addr, master_port=_int_env(env, "MASTER_PORT", DEFAULT_MASTER_PORT),
            launcher="slurm",
        )
    return None


def rendezvous_args(env: DistEnv, timeout: datetime.timedelta) -> dict[str, object]:
    """``init_process_group``'s rendezvous: ``tcp://MASTER_ADDR:MASTER_PORT``; or, under a
    torchrun agent that shares its own store with its workers (``TORCHELASTIC_USE_AGENT_STORE``,
    the c10d rendezvous of ``--nnodes MIN:MAX``), that store under a prefix of this start. The
    agent keeps one store for its whole life, so after a restart the keys of the previous start
    (the gloo addresses of its ranks, e.g. of the world that just lost a node) are still there,
    and a rank that reads one before its peer rewrites it connects to a dead address."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {"init_method": f"tcp://{env.master_addr}:{env.master_port}"}
    import torch.distributed as dist  # the launcher-facing part of this module needs no torch

    store = dist.TCPStore(env.master_addr, env.master_port, env.world_size, is_master=False,
                          timeout=timeout)
    start = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"mcpar/start{start}/world{env.world_size}", store)}


def join_process_group(env: DistEnv, backend: str, timeout_s: float) -> None:
    """This worker's default process group, once (``rendezvous_args``): the trainer joins it,
    or a worker that measures the link between its nodes before planning (``node_link_probe``)
    joins it first and the trainer keeps it."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend, rank=env.rank, world_size=env.world_size,
                            timeout=timeout, **rendezvous_args(env, timeout))  # type: ignore[arg-type]


def find_free_port() -> int:
    """A TCP port free right now on localhost (another process could still take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
