"""Pipeline bubble: the measured idle fraction of mcpar's pipeline schedules against theory.

What it measures
    ``--pp`` worker processes (gloo) run one optimizer step's forward and backward of ``--micro``
    micro-batches through ``mcpar.parallel.pipeline.PipelineExecutor`` (the step tasks of
    ``mcpar.controllers.compute.schedules``) under three schedules:
    ``gpipe`` and ``1f1b`` (one stage per rank) and ``interleaved_1f1b`` (``--virtual`` stages per
    rank). A rank's idle fraction in a step is ``1 - busy / step_time``: busy is the time inside
    its forward/backward tasks (``last_stats.busy_s``), step_time the wall time of the whole step,
    the slowest rank's, after a barrier that starts every rank together. (In a training loop every
    rank repeats with that period, so this is the share of each rank's time lost to the bubble.)
    The figure is the mean over ranks and over ``--repeats`` steps, after ``--warmup`` steps.

    Theory, with backward = 2 x forward and equal stages: ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
    ``(p-1)/(v m + p-1)`` for the interleaved schedule.

    1. fixed_cost: every stage's work has a fixed cost, independent of CPU contention: its forward
       sleeps ``--fwd-ms / v`` and its backward (an autograd Function) twice that, so a rank's work
       per micro-batch is the same for any v, and ``--pp`` processes sharing few cores cannot blur
       the schedule. This is the check of the schedules and of the executor's overheads.
    2. real_model: the same three schedules on GPT stages (``--layers`` blocks cut evenly into
       ``pp x v`` stages with ``cut_model``), one thread per process. With more processes than
       cores, ranks' compute slows each other down, so these figures are blurred (the JSON says so);
       ``step_time_s_median`` of each schedule is the other figure to compare there.

How to run
    python bench/pipeline_bubble.py [--pp 4] [--micro 8] [--virtual 2] [--fwd-ms 20]
                                    [--repeats 5] [--warmup 1] [--skip-real-model]

    Prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_workers import run_worker
from torch import nn

from mcpar.config import ModelConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.compute.schedules import schedule_problem, step_tasks
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.models.spec import get_model_spec
from mcpar.parallel.pipeline import PipelineExecutor, global_stage
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tasks import Task
from mcpar.topology import ParallelDims

FIXED_SHAPE = (4, 16, 8)  # micro-batch, seq, hidden of the fixed-cost stages: tiny on purpose
FIXED_VOCAB = 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (worker processes)")
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    p.add_argument("--virtual", type=int, default=2, help="stages per rank, interleaved schedule")
    p.add_argument("--fwd-ms", type=float, default=20.0,
                   help="fixed forward cost of one rank's work per micro-batch (ms)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per schedule")
    p.add_argument("--layers", type=int, default=8, help="real model: transformer blocks")
    p.add_argument("--hidden", type=int, default=128, help="real model: hidden size")
    p.add_argument("--seq", type=int, default=64, help="real model: sequence length")
    # 16 sequences make each task long (tens of ms) next to the wake-up latency of a blocked
    # receive on an oversubscribed machine (about a millisecond), which 4 sequences did not.
    p.add_argument("--micro-batch-size", type=int, default=16,
                   help="real model: sequences per micro-batch")
    p.add_argument("--skip-real-model", action="store_true", help="only the fixed-cost part")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("pp", "micro", "virtual", "repeats", "layers", "hidden", "seq",
                 "micro_batch_size"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.fwd_ms <= 0:
        p.error("--warmup must be >= 0 and --fwd-ms > 0")
    for schedule, v in schedules(args):
        reason = schedule_problem(schedule, args.pp, args.micro, v)
        if reason is not None:
            p.error(reason)
    if not args.skip_real_model and args.layers % (args.pp * args.virtual):
        p.error(f"--layers {args.layers} must divide into pp x virtual = "
                f"{args.pp * args.virtual} equal stages")
    return args


def schedules(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", args.virtual)]


def theory(pp: int, m: int, v: int) -> float:
    return (pp - 1) / (v * m + pp - 1)


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"pipeline_bubble: {message}", file=sys.stderr, flush=True)


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: a backward of fixed cost."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor,  # type: ignore[override]
                seconds: float) -> torch.Tensor:
        ctx.seconds = seconds  # type: ignore[attr-defined]
        return x.clone()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.seconds)  # type: ignore[attr-defined]
        return grad, None


class FixedCostStage(nn.Module):
    """A stage whose forward sleeps `fwd_s` and whose backward sleeps twice that."""

    def __init__(self, fwd_s: float, first: bool):
        super().__init__()
        self.fwd_s = fwd_s
        self.embed = nn.Embedding(FIXED_VOCAB, FIXED_SHAPE[-1]) if first else None
        self.scale = nn.Parameter(torch.ones(FIXED_SHAPE[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        time.sleep(self.fwd_s)
        return _SleepInBackward.apply(x * self.scale, 2 * self.fwd_s)


def measure(executor: PipelineExecutor, tasks: list[Task],
            make_batches: Callable[[], tuple[list, list]],
            warmup: int, repeats: int) -> dict:
    """Idle fraction (mean over ranks) of `repeats` steps, each timed from a common barrier."""
    rank, pp = dist.get_rank(), dist.get_world_size()
    idle, step_s = [], []
    for n in range(warmup + repeats):
        inputs, targets = make_batches()
        dist.barrier()
        executor.run(inputs if rank == 0 else None, targets if rank == pp - 1 else None, tasks)
        stats = executor.last_stats
        step = torch.tensor([stats.total_s], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        rank_idle = torch.tensor([1 - stats.busy_s / step.item()], dtype=torch.float64)
        dist.all_reduce(rank_idle)
        if n >= warmup:
            idle.append(rank_idle.item() / pp)
            step_s.append(step.item())
    return {"idle_fraction": statistics.fmean(idle), "idle_fraction_per_step": idle,
            "step_time_s_median": statistics.median(step_s)}


def fixed_cost_part(args: argparse.Namespace, comm: CommunicationController) -> dict:
    rank, pp, m = dist.get_rank(), args.pp, args.micro
    gen = torch.Generator().manual_seed(0)

    def batches() -> tuple[list, list]:
        inputs = [torch.randint(0, FIXED_VOCAB, FIXED_SHAPE[:2], generator=gen) for _ in range(m)]
        return inputs, [torch.zeros(FIXED_SHAPE) for _ in range(m)]

    out = {}
    for schedule, v in schedules(args):
        chunks: list[nn.Module] = [
            FixedCostStage(args.fwd_ms / 1000 / v, first=global_stage(c, rank, pp) == 0)
            for c in range(v)]
        executor = PipelineExecutor(chunks, rank, pp, comm, m, FIXED_SHAPE,
                                    F.mse_loss, torch.device("cpu"))
        result = measure(executor, step_tasks(schedule, rank, pp, m, v), batches, args.warmup,
                         args.repeats)
        expected = theory(pp, m, v)
        out[schedule] = {"virtual_stages": v, **result, "theory": expected,
                         "abs_diff_points": 100 * abs(result["idle_fraction"] - expected)}
        log(f"fixed cost {schedule}: idle {result['idle_fraction']:.3f}, theory {expected:.3f}")
    return out


def real_model_part(args: argparse.Namespace, comm: CommunicationController) -> dict:
    rank, pp, m = dist.get_rank(), args.pp, args.micro
    cfg = ModelConfig(num_layers=args.layers, hidden_size=args.hidden,
                      num_heads=max(1, args.hidden // 32), seq_len=args.seq)
    model = get_model_spec("gpt").build(cfg, 0)
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch_size, args.seq)

    def batches() -> tuple[list, list]:
        draw = [torch.randint(0, cfg.vocab_size, shape, generator=gen) for _ in range(2 * m)]
        return draw[:m], draw[m:]

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())

    out = {}
    for schedule, v in schedules(args):
        per_stage = args.layers // (pp * v)
        ranges = [(s * per_stage, (s + 1) * per_stage) for s in range(pp * v)]
        chunks: list[nn.Module] = [cut_model(model, ranges, global_stage(c, rank, pp))
                                   for c in range(v)]
        executor = PipelineExecutor(chunks, rank, pp, comm, m,
                                    (*shape, args.hidden), loss_fn, torch.device("cpu"))
        result = measure(executor, step_tasks(schedule, rank, pp, m, v), batches, args.warmup,
                         args.repeats)
        model.zero_grad(set_to_none=True)
        expected = theory(pp, m, v)
        out[schedule] = {"virtual_stages": v, **result, "theory": expected,
                         "abs_diff_points": 100 * abs(result["idle_fraction"] - expected)}
        log(f"real model {schedule}: idle {result['idle_fraction']:.3f}, theory {expected:.3f}")
    return {
        "model": {"layers": args.layers, "hidden": args.hidden, "seq_len": args.seq,
                  "micro_batch_size": args.micro_batch_size, "threads_per_process": 1},
        "schedules": out,
        "note": (f"{pp} processes share {os.cpu_count()} cores: a rank's compute slows down "
                 "while others compute, and the first and last stages also carry the embedding "
                 "and output head, so stages are neither equal nor fixed in cost and these "
                 "idle fractions only roughly follow theory"),
    }


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size)
    try:
        dims = ParallelDims(dp=1, tp=1, pp=args.pp, ep=1, world_size=args.pp)
        dims.build_mesh("cpu")
        comm = CommunicationController(dims)
        fixed = fixed_cost_part(args, comm)
        real = None if args.skip_real_model else real_model_part(args, comm)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    if env.rank != 0:
        return
    one_f = fixed["1f1b"]
    result = {
        "benchmark": "pipeline_bubble",
        "pp": args.pp,
        "micro": args.micro,
        "virtual_stages": args.virtual,
        "fwd_ms": args.fwd_ms,
        "repeats": args.repeats,
        "idle_definition": "mean over ranks of 1 - busy_s / step wall time (slowest rank)",
        "fixed_cost": fixed,
        "checks": {
            "1f1b_within_5_points_of_theory": one_f["abs_diff_points"] <= 5.0,
            "interleaved_idle_lower_than_1f1b":
                fixed["interleaved_1f1b"]["idle_fraction"] < one_f["idle_fraction"],
        },
        # The peer comparison: same ranks, same work, only the schedule differs.
        "interleaved_over_1f1b_idle_ratio":
            fixed["interleaved_1f1b"]["idle_fraction"] / one_f["idle_fraction"],
        "real_model": real,
        "torch_version": torch.__version__,
    }
    print(json.dumps(result), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    argv_out = list(sys.argv[1:] if argv is None else argv)
    try:
        launch_local(args.pp, [os.path.abspath(__file__), "--worker", *argv_out],
                     env=dict(os.environ, OMP_NUM_THREADS="1"))
    except LaunchFailed as err:
        print(f"pipeline_bubble: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
