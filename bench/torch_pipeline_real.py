"""torch's own pipeline schedules on the real model: the peer of ``bench/pipeline_bubble.py``'s
real-model part.

What it measures
    ``pp`` worker processes (gloo, one thread each) build the bench's GPT (``--layers`` blocks,
    ``--hidden`` wide, ``--seq`` long, the same seed as mcpar's part), cut it into ``pp x v``
    equal stages with ``mcpar.parallel.stage.cut_model`` (the same modules mcpar's executor
    runs) and hand each rank's stages to ``torch.distributed.pipelining.PipelineStage``, placed
    as torch's schedule expects (``v`` stages looped, or in a V). Each schedule runs ``warmup``
    untimed then ``repeats`` timed ``step`` calls over ``micro`` micro-batches of
    ``micro_batch_size`` sequences, cross-entropy on the last stage; the step time is the slowest
    rank's wall time after a barrier. Only step times are reported: torch's schedules do not
    say how long each rank computed.

How to run
    python bench/torch_pipeline_real.py [--pp 2] [--micro 8] [--layers 8] [--hidden 128]
                                        [--seq 64] [--micro-batch-size 16] [--repeats 5]

    Prints one JSON object on stdout; progress goes to stderr. A schedule torch refuses or that
    fails is reported with torch's error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_workers import run_worker
from torch.distributed import pipelining as pipe
from torch_pipeline_peer import SCHEDULES, stage_indices

from mcpar.config import ModelConfig
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.models.spec import get_model_spec
from mcpar.parallel.stage import cut_model

PG_TIMEOUT = datetime.timedelta(seconds=300)


def model_config(layers: int, hidden: int, seq: int) -> ModelConfig:
    """The bench's GPT, as ``bench/pipeline_bubble.py``'s real-model part builds it."""
    return ModelConfig(num_layers=layers, hidden_size=hidden, num_heads=max(1, hidden // 32),
                       seq_len=seq)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def run_schedule(name: str, args: argparse.Namespace) -> dict:
    rank, p, m = dist.get_rank(), args.pp, args.micro
    v, style = SCHEDULES[name]
    num_stages = p * v
    if args.layers % num_stages:
        return {"error": f"--layers {args.layers} does not cut into {num_stages} equal stages"}
    cfg = model_config(args.layers, args.hidden, args.seq)
    model = get_model_spec("gpt").build(cfg, 0)
    per_stage = args.layers // num_stages
    ranges = [(s * per_stage, (s + 1) * per_stage) for s in range(num_stages)]
    mine = stage_indices(rank, p, v, style)
    stages = [pipe.PipelineStage(cut_model(model, ranges, index), index, num_stages,
                                 torch.device("cpu")) for index in mine]
    cls = getattr(pipe.schedules, name)
    schedule = (cls(stages[0], m, loss_fn=loss_fn) if v == 1
                else cls(stages, m, loss_fn=loss_fn))
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    gen = torch.Generator().manual_seed(0)
    shape = (m * args.micro_batch_size, args.seq)
    steps = []
    for n in range(args.warmup + args.repeats):
        tokens = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        targets = torch.randint(0, cfg.vocab_size, shape, generator=gen)
        dist.barrier()
        start = time.perf_counter()
        schedule.step(*((tokens,) if has_first else ()), target=targets if has_last else None)
        step = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        if n >= args.warmup:
            steps.append(step.item())
        model.zero_grad(set_to_none=True)
    return {"stages_per_rank": v, "placement": style, "step_time_s_per_step": steps,
            "step_time_s_median": statistics.median(steps),
            "step_time_s_min": min(steps), "step_time_s_max": max(steps)}


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, timeout=PG_TIMEOUT)
    out: dict[str, dict] = {}
    try:
        for name in args.schedules:
            try:
                out[name] = run_schedule(name, args)
            except (ValueError, RuntimeError, AssertionError, NotImplementedError) as err:
                out[name] = {"error": f"{type(err).__name__}: {str(err).strip()[:500]}"}
            if env.rank == 0:
                figure = out[name].get("error") or f"step {out[name]['step_time_s_median']:.3f} s"
                print(f"torch_pipeline_real: {name}: {figure}", file=sys.stderr, flush=True)
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if env.rank == 0:
        Path(args.out_file).write_text(json.dumps(out))


def run_torch_real_model(pp: int, micro: int, layers: int, hidden: int, seq: int,
                         micro_batch_size: int, repeats: int, warmup: int = 1,
                         schedules: list[str] | None = None) -> dict:
    """torch's schedules on the real model in `pp` fresh worker processes (callable from other
    bench scripts); a schedule whose stages do not divide the layers is reported, not run."""
    names = list(SCHEDULES) if schedules is None else list(schedules)
    with tempfile.TemporaryDirectory(prefix="torch-pipeline-real-") as tmp:
        out_file = os.path.join(tmp, "result.json")
        argv = [os.path.abspath(__file__), "--worker", "--out-file", out_file, "--pp", str(pp),
                "--micro", str(micro), "--layers", str(layers), "--hidden", str(hidden),
                "--seq", str(seq), "--micro-batch-size", str(micro_batch_size),
                "--repeats", str(repeats), "--warmup", str(warmup),
                "--schedules", ",".join(names)]
        try:
            launch_local(pp, argv, env=dict(os.environ, OMP_NUM_THREADS="1"))
            per_schedule = json.loads(Path(out_file).read_text())
        except LaunchFailed as err:
            per_schedule = {name: {"error": f"worker failed: {err}"} for name in names}
    return {"benchmark": "torch_pipeline_real", "pp": pp, "micro": micro,
            "model": {"layers": layers, "hidden": hidden, "seq_len": seq,
                      "micro_batch_size": micro_batch_size},
            "repeats": repeats, "schedules": per_schedule, "torch_version": torch.__version__}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=2, help="pipeline ranks (worker processes)")
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    p.add_argument("--layers", type=int, default=8, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=128, help="hidden size")
    p.add_argument("--seq", type=int, default=64, help="sequence length")
    p.add_argument("--micro-batch-size", type=int, default=16, help="sequences per micro-batch")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per schedule")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help=f"comma-separated, of {', '.join(SCHEDULES)}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"unknown schedules {unknown}; known: {', '.join(SCHEDULES)}")
    for name in ("pp", "micro", "layers", "hidden", "seq", "micro_batch_size", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0:
        p.error("--warmup must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    result = run_torch_real_model(args.pp, args.micro, args.layers, args.hidden, args.seq,
                                  args.micro_batch_size, args.repeats, args.warmup,
                                  args.schedules)
    print(json.dumps(result, indent=1), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
