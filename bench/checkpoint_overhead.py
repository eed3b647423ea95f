"""Checkpoint overhead: training tokens/s with no checkpoint, a synchronous or an asynchronous one
every ``--interval`` steps.

What it measures
    ``--nproc`` data-parallel workers (gloo on the CPU) train mcpar's built-in model unless
    ``--set`` says otherwise (about 0.9M parameters: a checkpoint of about 22 MB with AdamW
    state, ``strategy: full``) through the real code paths: ``Trainer.train_step`` for a step and
    ``FaultRecoveryManager.save`` / ``wait`` for a checkpoint. Time is measured in *blocks* of
    ``--interval`` steps, each in one of three modes:

    * ``none``: the steps alone;
    * ``sync``: a synchronous save (``async_save: false``: written, checksummed, fsynced and
      committed before training goes on), then the steps;
    * ``async``: an asynchronous save (staged, then written and committed by a background
      thread while the steps run), then the steps, then ``wait()`` for the save to commit.

    So a block is one period of "a checkpoint every ``--interval`` steps", and everything the
    checkpoint costs is inside its block: the staging copy, the slow-down of the steps that
    overlap the background write (the cores and the GIL are shared), and any wait for a write
    that outlasts the steps. A block's time is the slowest rank's, from a barrier to its end;
    its throughput is ``interval x tokens per step / time``.

    After one untimed warm-up block per mode (the first asynchronous save allocates its staging
    buffers), ``--rounds`` rounds run one block of each mode back to back, in an order rotated
    each round. Fine interleaving is the point: on a machine shared with other work, whole
    ``mcpar train`` runs of each mode, a minute apart, differed by far more than 5% from outside
    load alone, while blocks seconds apart see the same load. Even so, blocks of one mode spread
    over +-10% on a shared 2-core machine, hence 16 rounds. A mode's figure is the median over
    rounds; ``ratio_async`` / ``ratio_sync`` divide it by the ``none`` median, and
    ``ratio_async_paired`` is the median of the per-round ratios. The fault-tolerance issue's
    target is ``ratio_async >= 0.95``.

    The loop's per-step bookkeeping (stats gather, metrics log) is left out in every mode alike,
    which makes the steps a little shorter and the ratios a little lower (conservative).

How to run
    python bench/checkpoint_overhead.py [--rounds 16] [--interval 10] [--nproc 2]
                                        [--set KEY=VALUE ...]

    It starts ``--nproc`` worker processes itself (each with ``cores // nproc`` threads) and
    prints one JSON object on stdout; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from bench_workers import run_worker, settings_problem

from mcpar.config import JobConfig, load_config
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.plan import resolve_plan
from mcpar.trainer import Trainer

MODES = ("none", "sync", "async")
TARGET = 0.95


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=16, help="timed blocks per mode")
    p.add_argument("--interval", type=int, default=10, help="steps per block (checkpoint period)")
    p.add_argument("--nproc", type=int, default=2, help="worker processes (data-parallel ranks)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set model.num_layers=8 (repeatable)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("rounds", "interval", "nproc"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    return args


def build_config(args: argparse.Namespace) -> JobConfig:
    steps = (args.rounds + 1) * len(MODES) * args.interval
    # Bench defaults first, so that --set can still change any of them. The interval only
    # turns the FaultRecoveryManager on (with async_save, its save group is made at start);
    # the bench itself decides when to save.
    base = ["training.progress=false", "training.device=cpu", f"parallelism.data={args.nproc}",
            f"training.steps={steps}", f"optimization.checkpoint.interval={args.interval}",
            "optimization.checkpoint.async_save=true"]
    return load_config(None, base + list(args.overrides))


def log(rank: int, message: str) -> None:
    if rank == 0:
        print(f"checkpoint_overhead: {message}", file=sys.stderr, flush=True)


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // env.local_world_size))
    plan = resolve_plan(build_config(args), env.world_size)
    cfg = plan.config  # the resolved config: global batch and accumulation filled
    # One folder for all ranks (made by the launching process): a checkpoint is written by all.
    trainer = Trainer(plan, args.run_dir, env)
    try:
        result = run_benchmark(args, cfg, trainer, args.run_dir)
    finally:
        trainer.recovery.close()
        trainer.logger.close()
        trainer.close()
    if env.rank == 0:
        print(json.dumps(result, indent=2), flush=True)


def run_benchmark(args: argparse.Namespace, cfg: JobConfig, trainer: Trainer,
                  run_dir: Path) -> dict:
    rank = dist.get_rank()
    recovery = trainer.recovery
    gbs = cfg.optimization.global_batch_size
    assert gbs is not None
    tokens = gbs * cfg.model.seq_len * args.interval
    step = 0

    def block(mode: str) -> tuple[float, float]:
        """One checkpoint period in ``mode``: the slowest rank's wall seconds, and the largest
        CPU seconds a rank's process used (all its threads, the writer's included)."""
        nonlocal step
        gc.collect()
        dist.barrier()
        start, cpu_start = time.perf_counter(), time.process_time()
        if mode != "none":
            recovery.async_save = mode == "async"
            recovery.save(step)
        for _ in range(args.interval):
            trainer.train_step(step)
            step += 1
        recovery.wait()  # an asynchronous save commits within its own block
        elapsed = torch.tensor([time.perf_counter() - start, time.process_time() - cpu_start],
                               dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed[0]), float(elapsed[1])

    log(rank, f"{dist.get_world_size()} ranks x {torch.get_num_threads()} threads, "
              f"{tokens // args.interval} tokens/step; blocks of {args.interval} steps, "
              f"{args.rounds} rounds")
    for mode in MODES:
        block(mode)  # warm-up
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    cpu_rates: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds):
        order = MODES[r % len(MODES):] + MODES[:r % len(MODES)]
        for mode in order:
            wall, cpu = block(mode)
            rates[mode].append(tokens / wall)
            cpu_rates[mode].append(tokens / cpu)
        log(rank, f"round {r + 1}/{args.rounds}: "
                  + ", ".join(f"{m} {rates[m][-1]:.0f} tok/s" for m in MODES))
    median = {m: statistics.median(v) for m, v in rates.items()}
    cpu_median = {m: statistics.median(v) for m, v in cpu_rates.items()}

    def paired(mode: str) -> float:
        return statistics.median(a / b for a, b in zip(rates[mode], rates["none"], strict=True))

    saves: list[dict] = []
    if rank == 0:
        log_path = run_dir / "recovery.jsonl"
        saves = [e for e in map(json.loads, log_path.read_text().splitlines())
                 if e["event"] == "save"]

    def save_stat(mode: str, key: str) -> float | None:
        values = [e[key] for e in saves if e["asynchronous"] == (mode == "async")
                  and e.get(key) is not None]
        return round(statistics.median(values), 4) if values else None

    def by_mode(mode: str) -> dict[str, float | None]:
        """Rank 0's save records: total time, time the training thread was held, writer CPU."""
        return {"median_seconds": save_stat(mode, "seconds"),
                "median_blocking_seconds": save_stat(
                    mode, "blocked_seconds" if mode == "async" else "seconds"),
                "median_writer_cpu_seconds": save_stat(mode, "cpu_seconds")}

    return {
        "benchmark": "checkpoint_overhead",
        "what": f"tokens/s of blocks of {args.interval} steps: none, a synchronous save + "
                "steps, an asynchronous save + steps + its wait; slowest rank; median over "
                "rounds",
        "world_size": dist.get_world_size(),
        "threads_per_worker": torch.get_num_threads(),
        "interval": args.interval,
        "rounds": args.rounds,
        "model": {"layers": cfg.model.num_layers, "hidden": cfg.model.hidden_size,
                  "params": sum(p.numel() for p in trainer.pm.params)},
        "settings": args.overrides,
        "checkpoint_bytes": saves[-1]["bytes"] if saves else None,
        "tokens_per_s": {m: round(v, 1) for m, v in median.items()},
        "ratio_async": round(median["async"] / median["none"], 4),
        "ratio_sync": round(median["sync"] / median["none"], 4),
        "ratio_async_paired": round(paired("async"), 4),
        "ratio_sync_paired": round(paired("sync"), 4),
        # Tokens per CPU second of the busiest rank: insensitive to outside load, and what
        # wall-time throughput becomes when the workers keep every core busy (as --nproc
        # workers with cores // nproc threads each do), where a background write cannot hide
        # its CPU work, only its waits.
        "cpu_tokens_per_s": {m: round(v, 1) for m, v in cpu_median.items()},
        "cpu_ratio_async": round(cpu_median["async"] / cpu_median["none"], 4),
        "cpu_ratio_sync": round(cpu_median["sync"] / cpu_median["none"], 4),
        "target_ratio_async": TARGET,
        "meets_target": median["async"] / median["none"] >= TARGET,
        "saves": {m: by_mode(m) for m in ("sync", "async")},
        "rounds_tokens_per_s": {m: [round(v, 1) for v in rates[m]] for m in MODES},
        "load_average": os.getloadavg(),
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
    with tempfile.TemporaryDirectory(prefix="mcpar-ckpt-bench-") as run_dir:
        try:
            launch_local(args.nproc, [os.path.abspath(__file__), "--worker",
                                      "--run-dir", run_dir, *argv_out])
        except LaunchFailed as err:
            print(f"checkpoint_overhead: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
