"""The peers of ``bench/zero_vs_peers.py``: torch FSDP2 (``FSDP2Side``, with the byte counter
and the model-state count that bench imports) and, run as a script, DeepSpeed's ZeRO (stage 2
or 3) in DeepSpeed's own environment, on the same GPT, data, batch, AdamW, LR schedule and
threads.

Why a separate script
    DeepSpeed is not a dependency of mcpar. ``zero_vs_peers.py --deepspeed-python PY`` runs this
    file with torchrun from that interpreter (a venv with ``torch==2.13.0`` and, built with
    ``DS_BUILD_OPS=0``, ``deepspeed``); mcpar itself comes from this checkout's ``src/`` on
    ``PYTHONPATH`` (the venv needs pyyaml and tokenizers besides, for mcpar's config and data).

What it runs
    ``get_model_spec(kind).build(cfg.model, seed)`` (the weights every other side starts from),
    mcpar's ``BatchStream`` (same steps, same rank slices), ``torch.optim.AdamW`` over
    ``decay_groups`` handed to ``deepspeed.initialize`` as a client optimizer
    (``zero_allow_untested_optimizer``), the ``lr_at`` schedule written into the optimizer's
    groups each step, DeepSpeed's ``gradient_clipping`` at ``optimization.grad_clip``, fp32,
    gloo (``DS_ACCELERATOR=cpu``; torch's process group is created first, DeepSpeed adopts it).

Interleaving with the other sides (files in ``--sync-dir``)
    After ``--warmup`` untimed steps rank 0 writes ``NAME.ready``; then for each round r it
    waits for ``NAME.go.r`` (written by the main bench when its turn comes), runs ``--steps``
    timed steps (``timed_round`` of ``dp_vs_ddp.py``: barrier, steps, slowest rank's time) and
    writes ``NAME.done.r`` (JSON: seconds, losses averaged over ranks). At the end
    ``NAME.result`` (JSON: model-state bytes of the largest rank, counted from the storages
    DeepSpeed's optimizer holds) or, on any error, ``NAME.failed`` with the error's text.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from dp_vs_ddp import (  # a sibling: run as a script, bench/ is on sys.path
    peer_step,
    peer_stream,
    timed_round,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

from mcpar.config import JobConfig, load_config
from mcpar.controllers.memory.optimizer import decay_groups
from mcpar.data.stream import BatchStream
from mcpar.models.spec import get_model_spec
from mcpar.plan import resolve_plan
from mcpar.trainer import lr_at

POLL_S = 0.2


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--stage", type=int, choices=(2, 3), required=True, help="DeepSpeed ZeRO stage")
    p.add_argument("--name", required=True, help="prefix of the sync files")
    p.add_argument("--sync-dir", required=True, help="folder of the ready/go/done files")
    p.add_argument("--steps", type=int, default=20, help="steps per timed round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--wait-s", type=float, default=1800.0, help="longest wait for a go file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="mcpar config key (the main bench passes its own)")
    return p.parse_args(argv)


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def wait_for(path: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path.name} after {timeout_s:.0f} s")
        time.sleep(POLL_S)


def ds_config(cfg: JobConfig, stage: int, world: int) -> dict[str, Any]:
    opt = cfg.optimization
    accum = opt.gradient_accumulation or 1
    return {
        "train_batch_size": opt.micro_batch_size * accum * world,
        "train_micro_batch_size_per_gpu": opt.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": opt.grad_clip,
        # Threshold 0: ZeRO-3 shards every parameter (the default keeps those under 100k
        # elements whole on every rank: most of a small model's).
        "zero_optimization": {"stage": stage, **({"stage3_param_persistence_threshold": 0}
                                                 if stage == 3 else {})},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


def ds_held_bytes(engine: Any, module: torch.nn.Module) -> dict[str, int]:
    """Parameters, gradients and optimizer state this rank holds, each storage once.

    DeepSpeed keeps its own copies: at stage 2 the optimizer steps flat fp32 partitions
    (``single_partition_of_fp32_groups``) whose gradients are set just before the step, and
    reduces into ``averaged_gradients``; at stage 3 the module's parameters are empty
    placeholders whose shard is ``ds_tensor`` and the optimizer steps flat
    ``fp32_partitioned_groups_flat`` with a flat gradient partition. Everything reachable is
    counted; what is freed (size 0) counts nothing."""
    seen: set[int] = set()
    zero = engine.optimizer
    params: list[torch.Tensor] = []
    for p in module.parameters():
        params.append(p.data)
        if hasattr(p, "ds_tensor"):
            params.append(p.ds_tensor)
    opt_params: list[torch.Tensor] = []
    for name in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat",
                 "bit16_groups_flat", "fp16_partitioned_groups_flat"):
        opt_params += [t for t in getattr(zero, name, None) or [] if isinstance(t, torch.Tensor)]
    grads: list[torch.Tensor] = [p.grad for p in module.parameters() if p.grad is not None]
    inner = getattr(zero, "optimizer", zero)
    for group in inner.param_groups:
        grads += [p.grad for p in group["params"] if p.grad is not None]
    for name in ("averaged_gradients", "_fp32_grad_partitions", "grad_partitions_flat_buffer",
                 "__param_id_to_grad_partition", "ipg_buffer"):
        value = getattr(zero, name, None)
        if isinstance(value, dict):
            value = list(value.values())
        if isinstance(value, torch.Tensor):
            value = [value]
        for item in value or []:
            grads += item if isinstance(item, list) else [item]
    grads = [g for g in grads if isinstance(g, torch.Tensor)]
    state = [t for s in inner.state.values() for t in s.values() if isinstance(t, torch.Tensor)]
    return {"parameters": count_storages(params + opt_params, seen),
            "gradients": count_storages(grads, seen),
            "optimizer state": count_storages(state, seen)}


# --- the torch peers' bookkeeping (zero_vs_peers.py imports these) -------------------------
def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def count_storages(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (data pointers), each once."""
    total = 0
    for t in tensors:
        storage = local(t).untyped_storage()
        if storage.nbytes() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


def held_bytes(params: Iterable[torch.Tensor], optimizer: torch.optim.Optimizer
               ) -> dict[str, int]:
    """Parameters, gradients and optimizer state of this rank, each storage once (as
    ``mcpar.controllers.memory.held`` counts them); a DTensor counts its local shard."""
    seen: set[int] = set()
    params = list(params)
    state = [t for s in optimizer.state.values() for t in s.values()
             if isinstance(t, torch.Tensor)]
    return {"parameters": count_storages(params, seen),
            "gradients": count_storages((p.grad for p in params if p.grad is not None), seen),
            "optimizer state": count_storages(state, seen)}


def largest(held: dict[str, int]) -> dict[str, int]:
    """The row of the rank holding the most, gathered over the world."""
    world = dist.get_world_size()
    rows = [torch.zeros(len(held), dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(list(held.values()), dtype=torch.float64))
    top = max(rows, key=lambda row: float(row.sum()))
    return {name: int(v) for name, v in zip(held, top.tolist(), strict=True)}


class CollectiveCounter:
    """Bytes FSDP2 sends, counted at the ``torch.distributed`` functions it calls (while
    ``active``), with the ring formulas mcpar's CommunicationController uses."""

    def __init__(self) -> None:
        self.active = False
        self.bytes = 0.0

    def install(self) -> None:
        def wrap(name: str, sent: Callable[[torch.Tensor, torch.Tensor, int], float]) -> None:
            orig = getattr(dist, name)

            def counted(*args: Any, **kwargs: Any) -> Any:
                if self.active:
                    group = kwargs.get("group")
                    n = dist.get_world_size(group)
                    out = kwargs.get("output", args[0] if args else None)
                    inp = kwargs.get("input", args[1] if len(args) > 1 else out)
                    if n > 1:
                        self.bytes += sent(out, inp, n)
                return orig(*args, **kwargs)

            setattr(dist, name, counted)

        # all-gather: (n-1)/n of the output; reduce-scatter: (n-1)/n of the input;
        # all-reduce: 2 (n-1)/n of the tensor.
        wrap("all_gather_single",
             lambda o, i, n: (n - 1) / n * o.numel() * o.element_size())
        wrap("reduce_scatter_single",
             lambda o, i, n: (n - 1) / n * i.numel() * i.element_size())
        wrap("all_reduce", lambda o, i, n: 2 * (n - 1) / n * o.numel() * o.element_size())


COUNTER = CollectiveCounter()


class FSDP2Side:
    """The same model and training step as ``DDPSide``, sharded by FSDP2 (``fully_shard`` on
    every block, or on groups of ``group`` consecutive blocks, and on the root)."""

    def __init__(self, cfg: JobConfig, stream: BatchStream, device: torch.device,
                 reshard_after_forward: bool | None, group: int = 1):
        self.cfg, self.stream, self.device = cfg, stream, device
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.accum = cfg.optimization.gradient_accumulation or 1
        self.module = get_model_spec(cfg.model.kind).build(cfg.model, cfg.training.seed).to(device)
        mesh = init_device_mesh(device.type, (self.world,))
        kwargs: dict[str, Any] = {"mesh": mesh}
        if reshard_after_forward is not None:  # None: fully_shard's default
            kwargs["reshard_after_forward"] = reshard_after_forward
        blocks = list(self.module.blocks)
        for i in range(0, len(blocks), group):  # a list: one FSDP unit, one gather
            fully_shard(blocks[i] if group == 1 else blocks[i:i + group], **kwargs)
        fully_shard(self.module, **kwargs)
        opt = cfg.optimization
        self.optimizer = torch.optim.AdamW(
            decay_groups(list(self.module.parameters()), opt.weight_decay), lr=opt.lr,
            betas=(opt.beta1, opt.beta2))
        self.step_bytes: list[float] = []

    def train_step(self, step: int) -> float:
        COUNTER.active, COUNTER.bytes = True, 0.0
        self.module.train()

        @contextlib.contextmanager
        def sync(last: bool) -> Iterator[None]:
            # Like DDP's no_sync: reduce-scatter only after the last micro-batch.
            self.module.set_requires_gradient_sync(last)
            yield

        loss = peer_step(self, self.module, step, sync)
        COUNTER.active = False
        self.step_bytes.append(COUNTER.bytes)
        return loss


# --- DeepSpeed -----------------------------------------------------------------------------
def run(args: argparse.Namespace, sync: Path) -> None:
    import deepspeed

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.wait_s + 600))
    deepspeed.init_distributed(dist_backend="gloo")
    base = ["training.progress=false", "training.device=cpu"]
    cfg = resolve_plan(load_config(None, base + list(args.overrides)), world).config
    stream = peer_stream(cfg, rank)
    module = get_model_spec(cfg.model.kind).build(cfg.model, cfg.training.seed)
    opt = cfg.optimization
    optimizer = torch.optim.AdamW(decay_groups(list(module.parameters()), opt.weight_decay),
                                  lr=opt.lr, betas=(opt.beta1, opt.beta2))
    engine, _, _, _ = deepspeed.initialize(model=module, optimizer=optimizer,
                                           config=ds_config(cfg, args.stage, world))
    accum = opt.gradient_accumulation or 1

    def step_fn(step: int) -> float:
        for group in engine.optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        losses = []
        for micro in range(accum):
            inputs, targets = stream.micro_batch(step, rank, world, micro, opt.micro_batch_size)
            logits = engine(inputs)
            loss = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
            engine.backward(loss)  # DeepSpeed scales by 1 / accumulation itself
            engine.step()  # an optimizer step at the accumulation boundary only
            losses.append(loss.item())
        stream.advance()
        return sum(losses) / len(losses)

    losses: dict[int, float] = {}
    device = torch.device("cpu")
    if args.warmup:
        timed_round(step_fn, 0, args.warmup, device, losses)
    if rank == 0:
        write_atomic(sync / f"{args.name}.ready", "")
    for r in range(args.rounds):
        wait_for(sync / f"{args.name}.go.{r}", args.wait_s)
        first = args.warmup + r * args.steps
        seconds = timed_round(step_fn, first, args.steps, device, losses)
        mean = torch.tensor([losses[s] for s in range(first, first + args.steps)],
                            dtype=torch.float64)
        dist.all_reduce(mean)
        mean /= world
        if rank == 0:
            write_atomic(sync / f"{args.name}.done.{r}",
                         json.dumps({"seconds": seconds, "losses": mean.tolist()}))
    held = ds_held_bytes(engine, module)
    rows = [torch.zeros(3, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(rows, torch.tensor(list(held.values()), dtype=torch.float64))
    largest = max(rows, key=lambda row: float(row.sum()))
    if rank == 0:
        write_atomic(sync / f"{args.name}.result", json.dumps({
            "model_state_bytes": {k: int(v) for k, v in zip(held, largest.tolist(), strict=True)},
            "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__,
            "zero_stage": args.stage}))
    dist.barrier()


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    sync = Path(args.sync_dir)
    try:
        run(args, sync)
    except BaseException as err:  # noqa: BLE001 - the main bench reports it, then skips DeepSpeed
        if int(os.environ.get("RANK", "0")) == 0:
            lines = traceback.format_exception_only(type(err), err)
            write_atomic(sync / f"{args.name}.failed", "".join(lines).strip()[-2000:])
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # like mcpar's workers: no interpreter finalization under gloo threads


if __name__ == "__main__":
    main()
