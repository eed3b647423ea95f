"""``training.compile`` in throughput: the default job's model, mcpar eager, mcpar compiled and
PyTorch DDP compiled the same way, interleaved in one job.

What it measures
    Training tokens per second of mcpar's default model at data parallelism ``--nproc`` (CPU,
    gloo), three ways in one job, from the same weights and on the same micro-batches:

    * ``mcpar_eager``: ``Trainer.train_step`` of a job with ``training.compile: false``;
    * ``mcpar_compiled``: the same job with ``training.compile: true`` (each block's forward
      compiled by ``mcpar.parallel.compile``);
    * ``ddp_compiled``: the same model, AdamW, schedule and clipping under
      ``DistributedDataParallel`` (``DDPSide`` of ``bench/dp_vs_ddp.py``), its blocks compiled
      by the same function.

    ``--warmup`` untimed steps per side first (the compiles happen there; their seconds are
    reported as ``compile_s``), then ``--rounds`` rounds of ``--steps`` steps, the order of the
    three sides rotating each round so that drift of a shared machine hits all alike. A side's
    figure is the median over its rounds; ratios are of medians. The losses of the three must
    agree (fp32: ``max_abs_loss_diff``), as they train the same model on the same data.

How to run
    python bench/compile_vs_ddp.py [--steps N] [--warmup W] [--rounds R] [--nproc 2]
        [--set KEY=VALUE ...] [--out bench/data/compile_vs_ddp.json]

    Inductor's C++ backend needs a C++ compiler; TORCHINDUCTOR_CACHE_DIR (set to a fresh folder
    unless given) is shared by the ranks. One JSON object is printed (and written to --out).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from bench_workers import emit_result, run_worker, settings_problem
from dp_vs_ddp import DDPSide, timed_round

from mcpar.config import JobConfig, load_config
from mcpar.data.stream import BatchStream
from mcpar.device import keep_freed_host_memory
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.models.spec import get_model_spec
from mcpar.parallel.compile import compile_modules, compile_seconds
from mcpar.plan import resolve_plan
from mcpar.trainer import Trainer

SIDES = ("mcpar_eager", "mcpar_compiled", "ddp_compiled")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="optimizer steps per timed round")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per side (compiles)")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per side")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (data-parallel ranks)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key (repeatable)")
    p.add_argument("--out", type=Path, help="also write the JSON here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("steps", "rounds", "nproc", "warmup"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def build_config(args: argparse.Namespace) -> JobConfig:
    base = ["training.progress=false", "training.device=cpu", f"parallelism.data={args.nproc}"]
    return load_config(None, base + list(args.overrides))


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"compile_vs_ddp: {message}", file=sys.stderr, flush=True)


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    keep_freed_host_memory()
    eager_plan = resolve_plan(build_config(args), env.world_size)
    args.overrides = [*args.overrides, "training.compile=true"]
    compiled_plan = resolve_plan(build_config(args), env.world_size)
    cfg: JobConfig = eager_plan.config
    with tempfile.TemporaryDirectory(prefix="mcpar-bench-") as tmp:
        for name in ("eager", "compiled"):
            (Path(tmp) / name).mkdir()
        eager = Trainer(eager_plan, Path(tmp) / "eager", env)
        compiled = Trainer(compiled_plan, Path(tmp) / "compiled", env)
        gbs = cfg.optimization.global_batch_size
        assert gbs is not None
        stream = BatchStream(eager.train_stream.tokens, cfg.model.seq_len, gbs, cfg.training.seed)
        ddp = DDPSide(cfg, stream, eager.device)
        spec = get_model_spec(cfg.model.kind)
        compile_modules(list(spec.pieces(ddp.module)[1]))
        steps = {"mcpar_eager": lambda s: eager.train_step(s).loss,
                 "mcpar_compiled": lambda s: compiled.train_step(s).loss,
                 "ddp_compiled": ddp.train_step}
        try:
            result = run(args, cfg, steps, eager.device, gbs * cfg.model.seq_len)
        finally:
            for trainer in (eager, compiled):
                trainer.logger.close()
                trainer.close()
    if env.rank == 0:
        emit_result(result, args.out)


def run(args: argparse.Namespace, cfg: JobConfig, steps: dict, device: torch.device,
        tokens_per_step: int) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    losses: dict[str, dict[int, float]] = {n: {} for n in SIDES}
    compile_s: dict[str, float] = {}
    for name in SIDES:
        before = compile_seconds()
        timed_round(steps[name], 0, args.warmup, device, losses[name])
        compile_s[name] = compile_seconds() - before
        log(rank, f"{name}: warm-up done, {compile_s[name]:.1f} s compiling")
    seconds: dict[str, list[float]] = {n: [] for n in SIDES}
    for r in range(args.rounds):
        first = args.warmup + r * args.steps
        order = SIDES[r % 3:] + SIDES[:r % 3]
        for name in order:
            seconds[name].append(timed_round(steps[name], first, args.steps, device, losses[name]))
        log(rank, f"round {r + 1}/{args.rounds}: " + ", ".join(
            f"{n} {tokens_per_step * args.steps / seconds[n][-1]:.0f} tok/s" for n in SIDES))
    rates = {n: [tokens_per_step * args.steps / s for s in seconds[n]] for n in SIDES}
    medians = {n: statistics.median(rates[n]) for n in SIDES}
    all_steps = sorted(losses["ddp_compiled"])
    # DDP's loss is this rank's; mcpar's is already the mean over ranks.
    ddp_mean = torch.tensor([losses["ddp_compiled"][s] for s in all_steps], dtype=torch.float64)
    dist.all_reduce(ddp_mean)
    ddp_mean /= world
    ref = torch.tensor([losses["mcpar_eager"][s] for s in all_steps], dtype=torch.float64)
    diffs = {n: float((torch.tensor([losses[n][s] for s in all_steps], dtype=torch.float64)
                       - ref).abs().max()) for n in ("mcpar_compiled",)}
    diffs["ddp_compiled"] = float((ddp_mean - ref).abs().max())
    return {
        "benchmark": "compile_vs_ddp", "world_size": world,
        "threads_per_worker": torch.get_num_threads(), "torch_version": torch.__version__,
        "model": {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                  "seq_len": cfg.model.seq_len,
                  "params": get_model_spec(cfg.model.kind).num_params(cfg.model)},
        "dtype": cfg.training.dtype, "tokens_per_step": tokens_per_step,
        "warmup_steps": args.warmup, "steps_per_round": args.steps, "rounds": args.rounds,
        "tokens_per_s": medians, "rounds_tokens_per_s": rates, "compile_s": compile_s,
        "ratio_compiled_over_eager": medians["mcpar_compiled"] / medians["mcpar_eager"],
        "ratio_compiled_over_ddp_compiled": medians["mcpar_compiled"] / medians["ddp_compiled"],
        "max_abs_loss_diff_vs_mcpar_eager": diffs,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    problem = settings_problem(lambda: build_config(args))
    if problem is not None:
        return problem
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", tempfile.mkdtemp(prefix="mcpar-inductor-"))
    argv_out = list(sys.argv[1:] if argv is None else argv)
    try:
        launch_local(args.nproc, [os.path.abspath(__file__), "--worker", *argv_out])
    except LaunchFailed as err:
        print(f"compile_vs_ddp: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
