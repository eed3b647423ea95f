"""The torch-DDP peer of an mcpar run: same GPT, same data, same optimizer, under torchrun.

Why
    A speed figure for mcpar's data parallelism means something only next to PyTorch's own
    answer to the same job. ``bench/emulated_cluster.py`` runs this script with torchrun on the
    same emulated nodes as mcpar, so both sides see the same links, cores and batches.

What it runs
    ``DDPSide`` of ``bench/dp_vs_ddp.py`` (the model of ``mcpar.models.spec``, mcpar's
    ``BatchStream``, AdamW over ``decay_groups``, the ``lr_at`` schedule, the same gradient
    clipping) wrapped in ``DistributedDataParallel`` with mcpar's bucket size; optionally with
    torch's PowerSGD communication hook (``--powersgd``: rank ``--powersgd-rank``, plain
    all-reduce for the first ``--powersgd-start`` steps, error feedback and warm start on, as
    torch recommends).

Output (rank 0, ``--out PATH``, JSON)
    per step: ``step_time_s`` (rank 0's wall time of the step), ``loss`` (mean over ranks),
    ``comm_bytes`` (what this rank sent, counted like mcpar's CommunicationController: a ring
    all-reduce of B bytes over n ranks sends 2 (n-1)/n B; plain DDP's reducer is counted from the
    gradient size, PowerSGD's all-reduces as they are issued) and ``wire_tx_bytes`` (bytes this
    node's link interface, ``GLOO_SOCKET_IFNAME``, sent during the step: all ranks of the node,
    headers included; null where the counter cannot be read); plus ``tokens_per_step``,
    ``world_size``, threads and the PowerSGD settings.

    torchrun --nnodes 2 ... bench/ddp_peer.py --steps 40 --out /tmp/ddp.json \\
        [--powersgd --powersgd-rank 4 --powersgd-start 5] [--set model.num_layers=4 ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from dp_vs_ddp import (  # a sibling: run as a script (torchrun), bench/ is on sys.path
    DDPSide,
    peer_stream,
)
from torch.distributed.elastic.multiprocessing.errors import record

from mcpar.config import JobConfig, load_config
from mcpar.device import keep_freed_host_memory
from mcpar.models.spec import get_model_spec
from mcpar.plan import resolve_plan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps (training.steps)")
    p.add_argument("--out", required=True, help="JSON written by rank 0")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="mcpar config key (model, data, optimization, training sections)")
    p.add_argument("--powersgd", action="store_true", help="register torch's PowerSGD hook")
    p.add_argument("--powersgd-rank", type=int, default=4, help="matrix approximation rank")
    p.add_argument("--powersgd-start", type=int, default=5,
                   help="steps of plain all-reduce before PowerSGD compresses")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace, world: int) -> JobConfig:
    base = ["training.progress=false", "training.device=cpu", f"training.steps={args.steps}"]
    cfg = load_config(None, base + list(args.overrides))
    plan = resolve_plan(cfg, world)  # its config has global_batch_size and accumulation filled
    if plan.dp != world:
        raise SystemExit(f"ddp_peer: pure data parallelism only; got "
                         f"{plan.parallel_dims().describe()}")
    return plan.config


def read_wire_tx() -> int | None:
    """Bytes sent so far by this node's link interface (``ip netns exec`` mounts this
    namespace's /sys), or None outside an emulated node."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return None
    try:
        return int(Path(f"/sys/class/net/{ifname}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


class AllReduceCounter:
    """Counts the bytes of every Python-level ``dist.all_reduce`` (PowerSGD issues its
    collectives through it) with the ring formula mcpar uses."""

    def __init__(self, world: int):
        self.world = world
        self.bytes = 0.0
        self._orig: Callable[..., Any] = dist.all_reduce

    def install(self) -> None:
        orig, world = self._orig, self.world

        def counting_all_reduce(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            n = dist.get_world_size(group) if group is not None else world
            if n > 1:
                self.bytes += 2.0 * (n - 1) / n * tensor.numel() * tensor.element_size()
            return orig(tensor, *args, **kwargs)

        dist.all_reduce = counting_all_reduce  # type: ignore[assignment]


def run(args: argparse.Namespace) -> dict[str, Any] | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    threads = int(os.environ.get("OMP_NUM_THREADS") or 0) or max(
        1, (os.cpu_count() or 1) // local_world)
    torch.set_num_threads(threads)
    keep_freed_host_memory()  # as mcpar's workers do on CPU: both sides allocate alike
    dist.init_process_group("gloo", timeout=datetime.timedelta(minutes=5))
    cfg = build_config(args, world)
    stream = peer_stream(cfg, rank)
    side = DDPSide(cfg, stream, torch.device("cpu"))
    num_params = sum(p.numel() for p in side.module.parameters())
    counter = AllReduceCounter(world)
    psgd: dict[str, Any] | None = None
    if args.powersgd:
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

        state = powerSGD_hook.PowerSGDState(
            process_group=None, matrix_approximation_rank=args.powersgd_rank,
            start_powerSGD_iter=args.powersgd_start, use_error_feedback=True, warm_start=True)
        side.ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        counter.install()
        psgd = {"matrix_approximation_rank": args.powersgd_rank,
                "start_powerSGD_iter": args.powersgd_start}
    # Plain DDP all-reduces every gradient once per step (accumulation uses no_sync).
    plain_bytes = 2.0 * (world - 1) / world * 4 * num_params if world > 1 else 0.0

    times, losses, comm, wire = [], [], [], []
    dist.barrier()
    for step in range(args.steps):
        before_bytes, before_wire = counter.bytes, read_wire_tx()
        t0 = time.perf_counter()
        losses.append(side.train_step(step))
        times.append(time.perf_counter() - t0)
        after_wire = read_wire_tx()
        comm.append(counter.bytes - before_bytes if args.powersgd else plain_bytes)
        wire.append(None if before_wire is None or after_wire is None
                    else after_wire - before_wire)
    mean_loss = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(mean_loss)  # after the timed loop, so it costs the steps nothing
    mean_loss /= world
    dist.barrier()
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {
        "side": "ddp_powersgd" if args.powersgd else "ddp",
        "world_size": world, "local_world_size": local_world, "threads_per_worker": threads,
        "tokens_per_step": stream.global_batch * cfg.model.seq_len, "num_params": num_params,
        "model": {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                  "seq_len": cfg.model.seq_len,
                  "params": get_model_spec(cfg.model.kind).num_params(cfg.model)},
        "micro_batch_size": cfg.optimization.micro_batch_size,
        "bucket_size_mb": cfg.controllers.communication.bucket_size_mb,
        "powersgd": psgd,
        "step_time_s": times, "loss": mean_loss.tolist(), "comm_bytes": comm,
        "wire_tx_bytes": wire, "torch_version": torch.__version__,
    }


@record
def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = run(args)
    if result is not None:
        out = Path(args.out)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, out)
    sys.stdout.flush()
    sys.stderr.flush()
    # Like mcpar's workers: skip interpreter finalization, where gloo threads holding finished
    # work can abort a run that succeeded.
    os._exit(0)


if __name__ == "__main__":
    main()
