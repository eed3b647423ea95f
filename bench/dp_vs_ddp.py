"""Data-parallel throughput: mcpar's bucketed all-reduce against PyTorch DistributedDataParallel.

What it measures
    Training tokens per second of the same GPT, trained the same way, two ways in one job:

    * mcpar: ``mcpar.trainer.Trainer.train_step`` -- gradients averaged by ``DataParallelGradSync``
      (bucketed, overlapped all-reduce issued through the CommunicationController);
    * ddp: a second copy of the model (same spec, same seed) wrapped in
      ``torch.nn.parallel.DistributedDataParallel`` with the same bucket size.

    Both sides see the same micro-batches (mcpar's ``BatchStream``, same steps, same rank slices),
    use the same AdamW (``decay_groups``), LR schedule (``lr_at``), loss and gradient clipping.
    After ``--warmup`` untimed steps per side, ``--rounds`` timed rounds of ``--steps`` steps are
    interleaved (mcpar then ddp, ddp then mcpar, ... so slow drift of the machine hits both sides
    alike). Each round starts after a barrier; its time is the maximum over ranks. A side's figure
    is the median over its rounds; ``ratio`` is mcpar / ddp (higher is better for mcpar).
    ``ratio_paired_median`` is the median of the per-round ratios, whose two halves ran back to
    back: on a machine shared with other work it is the steadier of the two figures. Short rounds
    (many of them) resist such load better than long ones.

    The two models train independently on identical data from identical weights, so their losses
    must agree step by step (fp32: to 1e-4 over the first 20 steps, warm-up included, else a
    warning); compared is the step's loss averaged over the ranks (mcpar's own figure against
    the mean of DDP's per-rank losses). ``max_abs_loss_diff`` is the largest difference over the
    timed steps, ``max_abs_loss_diff_first_20_steps`` the one the warning judges, and
    ``max_abs_param_diff`` compares the final weights.

How to run
    python bench/dp_vs_ddp.py [--steps N] [--warmup W] [--rounds R] [--nproc 2]
                              [--set KEY=VALUE ...]

    It starts ``--nproc`` worker processes itself (gloo on CPU; each worker gets
    ``cores // nproc`` threads) and prints one JSON object on stdout; progress goes to stderr.
    ``--set`` takes the dotted config keys of ``mcpar train`` (e.g. ``--set model.num_layers=8``);
    the default is mcpar's built-in model with ``parallelism.data = --nproc`` on the CPU.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_workers import run_worker, settings_problem
from torch.nn.parallel import DistributedDataParallel

from mcpar.config import JobConfig, load_config
from mcpar.controllers.memory.optimizer import decay_groups
from mcpar.data.corpus import load_corpus
from mcpar.data.stream import BatchStream
from mcpar.device import autocast, keep_freed_host_memory, synchronize
from mcpar.errors import UserError
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.models.spec import get_model_spec
from mcpar.plan import resolve_plan
from mcpar.trainer import Trainer, lr_at

# DESIGN.md §5: fp32 loss parity, |Δ mean loss| <= 1e-4 over the first 20 steps.
LOSS_PARITY_FP32 = 1e-4
PARITY_STEPS = 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per timed round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side before timing")
    p.add_argument("--rounds", type=int, default=8, help="timed rounds per side")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (data-parallel ranks)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.num_layers=8 (repeatable)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "rounds", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be at least 0")
    return args


def build_config(args: argparse.Namespace) -> JobConfig:
    # Bench defaults first, so that --set can still change any of them.
    base = ["training.progress=false", "training.device=cpu", f"parallelism.data={args.nproc}"]
    return load_config(None, base + list(args.overrides))


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"dp_vs_ddp: {message}", file=sys.stderr, flush=True)


def peer_stream(cfg: JobConfig, rank: int) -> BatchStream:
    """The batches of a peer started by torchrun (no Trainer): mcpar's corpus (rank 0 prepares
    it while the others wait) and ``BatchStream``, seeded as a Trainer seeds."""
    torch.manual_seed(cfg.training.seed)  # as Trainer does
    corpus = load_corpus(
        cfg.data.source, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.val_fraction,
        token_dtype=cfg.data.token_dtype, cache_dir=cfg.data.cache_dir, is_main=rank == 0,
        barrier=dist.barrier)
    gbs = cfg.optimization.global_batch_size
    assert gbs is not None
    return BatchStream(corpus.train, cfg.model.seq_len, gbs, cfg.training.seed)


class DDPSide:
    """The reference: the same model and training step, data-parallel through DDP."""

    def __init__(self, cfg: JobConfig, stream: BatchStream, device: torch.device):
        self.cfg = cfg
        self.device = device
        self.stream = stream
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.accum = cfg.optimization.gradient_accumulation or 1
        self.module = get_model_spec(cfg.model.kind).build(cfg.model, cfg.training.seed).to(device)
        self.ddp = DistributedDataParallel(
            self.module,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cfg.controllers.communication.bucket_size_mb,
        )
        opt = cfg.optimization
        self.optimizer = torch.optim.AdamW(
            decay_groups(list(self.module.parameters()), opt.weight_decay), lr=opt.lr,
            betas=(opt.beta1, opt.beta2))

    def train_step(self, step: int) -> float:
        """One optimizer step as ``Trainer.train_step`` does it; the mean micro-batch loss."""
        self.ddp.train()
        return peer_step(self, self.ddp, step, lambda last: (
            contextlib.nullcontext() if last else self.ddp.no_sync()))


def peer_step(side: Any, model: torch.nn.Module, step: int,
              sync: Callable[[bool], contextlib.AbstractContextManager[Any]]) -> float:
    """One optimizer step of a peer (``side``: cfg, stream, rank, world, accum, device,
    module, optimizer) as ``Trainer.train_step`` does it: the LR of the step, accumulation with
    the gradients synchronized in the last micro-batch only (``sync(last)``), clipping, AdamW;
    the mean micro-batch loss."""
    cfg = side.cfg
    for group in side.optimizer.param_groups:
        group["lr"] = lr_at(step, cfg)
    side.optimizer.zero_grad(set_to_none=True)
    losses = []
    for micro in range(side.accum):
        with sync(micro == side.accum - 1):
            inputs, targets = side.stream.micro_batch(
                step, side.rank, side.world, micro, cfg.optimization.micro_batch_size)
            with autocast(side.device, cfg.training.dtype):
                logits = model(inputs.to(side.device))
            loss = F.cross_entropy(logits.float().flatten(0, 1),
                                   targets.to(side.device).flatten())
            (loss / side.accum).backward()
        losses.append(loss.item())
    clip = cfg.optimization.grad_clip
    grad_norm = torch.nn.utils.clip_grad_norm_(
        side.module.parameters(), clip if clip > 0 else float("inf"))
    side.optimizer.step()
    side.stream.advance()
    # Trainer.train_step reads the norm back too (a DTensor under FSDP2).
    float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    return sum(losses) / len(losses)


def timed_round(step_fn: Callable[[int], float], first_step: int, steps: int,
                device: torch.device, losses: dict[int, float]) -> float:
    """Run `steps` steps from `first_step`; the wall time of the slowest rank, in seconds."""
    gc.collect()
    synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for step in range(first_step, first_step + steps):
        losses[step] = step_fn(step)
    synchronize(device)
    elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed.item())


def reduce_scalar(value: float, op: dist.ReduceOp.RedOpType) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=op)
    return float(t.item())


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    keep_freed_host_memory()  # as mcpar's workers do on CPU: both sides allocate alike
    plan = resolve_plan(build_config(args), env.world_size)
    cfg = plan.config  # the resolved config: global batch and accumulation filled
    with tempfile.TemporaryDirectory(prefix="mcpar-bench-") as tmp:
        # The Trainer creates the process group (gloo, tcp:// from the launcher's environment).
        trainer = Trainer(plan, Path(tmp), env)
        try:
            result = run_benchmark(args, cfg, trainer)
        finally:
            trainer.logger.close()
            trainer.close()
    if env.rank == 0:
        print(json.dumps(result), flush=True)


def run_benchmark(args: argparse.Namespace, cfg: JobConfig, trainer: Trainer) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    dims = trainer.dims
    if dims.dp != world or dims.tp != 1 or dims.pp != 1:
        raise UserError(f"parallelism: this benchmark compares pure data parallelism; got "
                        f"{dims.describe()} on {world} workers")
    # Trainer resolved the layout: the global batch and accumulation are filled in now.
    gbs = cfg.optimization.global_batch_size
    assert gbs is not None
    tokens_per_step = gbs * cfg.model.seq_len
    stream = BatchStream(trainer.train_stream.tokens, cfg.model.seq_len, gbs, cfg.training.seed)
    ddp = DDPSide(cfg, stream, trainer.device)
    device = trainer.device

    def mcpar_step(step: int) -> float:
        return trainer.train_step(step).loss

    sides: dict[str, Callable[[int], float]] = {"mcpar": mcpar_step, "ddp": ddp.train_step}
    losses: dict[str, dict[int, float]] = {"mcpar": {}, "ddp": {}}
    seconds: dict[str, list[float]] = {"mcpar": [], "ddp": []}
    log(rank, f"{world} ranks x {torch.get_num_threads()} threads, {tokens_per_step} tokens/step, "
              f"accumulation {cfg.optimization.gradient_accumulation}; warmup {args.warmup}, "
              f"{args.rounds} rounds x {args.steps} steps per side")
    if args.warmup:
        for name, fn in sides.items():
            timed_round(fn, 0, args.warmup, device, losses[name])
    timed_steps: list[int] = []
    for r in range(args.rounds):
        first = args.warmup + r * args.steps
        timed_steps += range(first, first + args.steps)
        # Alternate who goes first, so drift over the run does not favour one side.
        order = ("mcpar", "ddp") if r % 2 == 0 else ("ddp", "mcpar")
        for name in order:
            seconds[name].append(timed_round(sides[name], first, args.steps, device, losses[name]))
        log(rank, f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{n} {tokens_per_step * args.steps / seconds[n][-1]:.0f} tok/s"
                              for n in ("mcpar", "ddp")))

    # Like for like: mcpar's step loss is already the mean over ranks (StepResult.loss), the
    # DDP side's is this rank's own, so it is averaged over the ranks here, after the timed
    # rounds (as bench/ddp_peer.py does), in float64 like mcpar's. Steps 0, 1, ... in order.
    all_steps = sorted(losses["ddp"])
    ddp_mean = torch.tensor([losses["ddp"][s] for s in all_steps], dtype=torch.float64)
    dist.all_reduce(ddp_mean)
    ddp_mean /= world
    mcpar_mean = torch.tensor([losses["mcpar"][s] for s in all_steps], dtype=torch.float64)
    loss_diff = (mcpar_mean - ddp_mean).abs()
    max_loss_diff = float(loss_diff[args.warmup:].max())  # the timed steps
    parity_diff = float(loss_diff[:PARITY_STEPS].max())
    last = timed_steps[-1]
    final = {n: reduce_scalar(losses[n][last], dist.ReduceOp.SUM) / world for n in sides}
    with torch.no_grad():
        param_diff = max(float((a - b).abs().max()) for a, b in
                         zip(trainer.pm.params, ddp.module.parameters(), strict=True))
    max_param_diff = reduce_scalar(param_diff, dist.ReduceOp.MAX)

    rates = {n: [tokens_per_step * args.steps / s for s in seconds[n]] for n in sides}
    medians = {n: statistics.median(rates[n]) for n in sides}
    round_ratios = [m / d for m, d in zip(rates["mcpar"], rates["ddp"], strict=True)]
    # Same init, data and fp32 math: the two differ only in the order floats are summed (DDP's
    # buckets against mcpar's), ulps that training then amplifies. Measured, 2 ranks, default
    # model: mean losses bit-identical over the first 12 steps, 1.8e-6 apart by step 25,
    # 3.6e-5 by step 83 (weights 3e-4). A real difference is 1e-2 or more: two ranks' batches
    # differ by 0.1 (the old rank-0-against-mean comparison). So parity is judged as
    # DESIGN.md §5 states it, <= 1e-4 over the first 20 steps; later steps' drift is reported.
    if parity_diff > LOSS_PARITY_FP32 and cfg.training.dtype == "float32":
        log(rank, f"WARNING: mean losses differ by up to {parity_diff:.3g} in the first "
                  f"{PARITY_STEPS} steps (expected <= {LOSS_PARITY_FP32:g})")
    return {
        "benchmark": "dp_vs_ddp",
        "world_size": world,
        "threads_per_worker": torch.get_num_threads(),
        "steps_per_round": args.steps,
        "warmup_steps": args.warmup,
        "rounds": args.rounds,
        "model": {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                  "params": get_model_spec(cfg.model.kind).num_params(cfg.model)},
        "micro_batch_size": cfg.optimization.micro_batch_size,
        "gradient_accumulation": cfg.optimization.gradient_accumulation,
        "bucket_size_mb": cfg.controllers.communication.bucket_size_mb,
        "dtype": cfg.training.dtype,
        "tokens_per_step": tokens_per_step,
        "mcpar_tokens_per_s": medians["mcpar"],
        "ddp_tokens_per_s": medians["ddp"],
        "ratio": medians["mcpar"] / medians["ddp"],
        # Each round's mcpar and ddp halves ran back to back: their ratio sees the same load.
        "ratio_paired_median": statistics.median(round_ratios),
        "round_ratios": round_ratios,
        "mcpar_rounds": rates["mcpar"],
        "ddp_rounds": rates["ddp"],
        "final_loss_mcpar": final["mcpar"],
        "final_loss_ddp": final["ddp"],
        "max_abs_loss_diff": max_loss_diff,
        "max_abs_loss_diff_first_20_steps": parity_diff,
        "max_abs_param_diff": max_param_diff,
        "torch_version": torch.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    problem = settings_problem(lambda: build_config(args))
    if problem is not None:
        return problem
    argv_out = list(sys.argv[1:] if argv is None else argv)
    try:
        launch_local(args.nproc, [os.path.abspath(__file__), "--worker", *argv_out])
    except LaunchFailed as err:
        print(f"dp_vs_ddp: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
