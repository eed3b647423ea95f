"""The torch peer of the pipeline bubble bench: torch.distributed.pipelining's own schedules.

Why
    mcpar's schedule figures (``bench/pipeline_bubble.py``) mean something only next to what
    PyTorch's own pipelining gives on the same work. This module runs torch's schedules on the
    same kind of fixed-cost stages, so the mcpar bench can call ``run_torch_schedules`` in the same
    run and put both answers side by side.

What it measures
    ``pp`` worker processes (gloo, one thread each) run ``repeats`` steps (after ``warmup``) of
    ``schedule.step`` over ``micro`` micro-batches, for each of torch's ``Schedule1F1B`` (one
    stage per rank), ``ScheduleInterleaved1F1B`` and ``ScheduleInterleavedZeroBubble`` (two
    stages per rank, looped), ``ScheduleZBVZeroBubble`` and ``ScheduleDualPipeV`` (two stages per
    rank, V-shaped).

    Fixed-cost stages, F = B = W: with v stages per rank, a stage's forward sleeps F/v per
    micro-batch, the input-gradient part of its backward sleeps F/v and the weight-gradient part
    F/v, so a rank's work per micro-batch is 3F under every schedule. The stage output is
    ``InputPath(x) * WeightPath(scale)``: each path is one autograd Function whose backward
    sleeps, so torch's split backward (``stage_backward_input``: gradient w.r.t. the stage input
    only; ``stage_backward_weight``: w.r.t. the parameters) runs exactly one of the two sleeps
    in each part, and a full backward runs both. The first stage's input requires grad so its
    input path costs the same as elsewhere (torch runs the first stage's whole backward in its
    weight step: ``rank0_action_ms`` shows it).

    busy = the time a rank spent inside the sleeps; step time = the slowest rank's wall time of
    ``step`` after a barrier; a rank's bubble is ``1 - busy / step_time``, the figure is the mean
    over ranks and repeats, as in ``bench/pipeline_bubble.py``. ``rank0_action_ms`` is the mean
    wall time, and sleep in each path, of each kind of stage call (forward, full backward,
    input backward, weight backward) of each of rank 0's stages: the check that the split
    backward runs the sleep it should.

How to run
    python bench/torch_pipeline_peer.py [--pp 4] [--micro 8] [--fwd-ms 20] [--repeats 5]
                                        [--warmup 1] [--schedules Schedule1F1B,...]

    Prints one JSON object on stdout; progress goes to stderr. A schedule torch refuses or that
    fails is reported with torch's error in its ``error`` entry.
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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from bench_workers import run_worker
from torch import nn
from torch.distributed import pipelining as pipe

from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local

FIXED_SHAPE = (4, 16, 8)  # micro-batch, seq, hidden: tiny on purpose, the sleeps are the work
# schedule -> (stages per rank, placement of a rank's stages: "loop" r, r+p, ...; "v" r, 2p-1-r)
SCHEDULES: dict[str, tuple[int, str]] = {
    "Schedule1F1B": (1, "loop"),
    "ScheduleInterleaved1F1B": (2, "loop"),
    "ScheduleInterleavedZeroBubble": (2, "loop"),
    "ScheduleZBVZeroBubble": (2, "v"),
    "ScheduleDualPipeV": (2, "v"),
}
PG_TIMEOUT = datetime.timedelta(seconds=120)  # a hung schedule fails instead of waiting forever


def theory(schedule: str, p: int, m: int, v: int) -> tuple[float | None, str]:
    """The bubble theory gives for F = B = W (B + W = 2F), and what it rests on."""
    if schedule == "Schedule1F1B":
        return (p - 1) / (m + p - 1), "(p-1)/(m+p-1): 1F1B, backward = 2F"
    if schedule == "ScheduleInterleaved1F1B":
        return (p - 1) / (v * m + p - 1), "(p-1)/(v m+p-1): interleaved 1F1B, backward = 2F"
    if schedule == "ScheduleInterleavedZeroBubble":
        return ((p - 1) / (3 * v * m + p - 1),
                "(p-1)/(3 v m+p-1): ZB-H1's bubble (p-1)(F+B-W) with a stage's costs F/v")
    if schedule == "ScheduleZBVZeroBubble":
        return 0.0, "0: ZB-V with F = B = W has no bubble in the schedule"
    return None, "no closed form used here"


@dataclass
class Busy:
    """Seconds this rank spent in each kind of fixed cost during the current step."""

    forward: float = 0.0
    input_grad: float = 0.0
    weight_grad: float = 0.0

    def total(self) -> float:
        return self.forward + self.input_grad + self.weight_grad


def _sleep(seconds: float) -> float:
    start = time.perf_counter()
    time.sleep(seconds)
    return time.perf_counter() - start


class _InputPath(torch.autograd.Function):
    """Identity on the stage input whose backward sleeps: the input-gradient cost B."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, seconds: float,  # type: ignore[override]
                busy: Busy) -> torch.Tensor:
        ctx.seconds, ctx.busy = seconds, busy
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.busy.input_grad += _sleep(ctx.seconds)
        return grad, None, None


class _WeightPath(torch.autograd.Function):
    """Identity on a parameter whose backward sleeps: the weight-gradient cost W. Its output
    meets the input path only in the final product, so a gradient w.r.t. the stage input
    never runs this backward and a gradient w.r.t. the parameters runs only this one."""

    @staticmethod
    def forward(ctx: Any, w: torch.Tensor, seconds: float,  # type: ignore[override]
                busy: Busy) -> torch.Tensor:
        ctx.seconds, ctx.busy = seconds, busy
        return w.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:  # type: ignore[override]
        ctx.busy.weight_grad += _sleep(ctx.seconds)
        return grad, None, None


class FixedCostStage(nn.Module):
    """Forward sleeps `cost_s`; input gradient and weight gradient sleep `cost_s` each."""

    def __init__(self, cost_s: float, busy: Busy):
        super().__init__()
        self.cost_s, self.busy = cost_s, busy
        self.scale = nn.Parameter(torch.ones(FIXED_SHAPE[-1]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.busy.forward += _sleep(self.cost_s)
        return (_InputPath.apply(x, self.cost_s, self.busy)
                * _WeightPath.apply(self.scale, self.cost_s, self.busy))


def stage_indices(rank: int, p: int, v: int, style: str) -> list[int]:
    """The global stages rank `rank` holds, as torch's schedule maps them."""
    if style == "v":
        return [rank, 2 * p - 1 - rank]
    return [rank + c * p for c in range(v)]


@dataclass
class ActionTimes:
    """Per stage and kind of stage call on this rank, over the timed steps: each call's wall
    time and the time it slept in the input path and in the weight path (seconds)."""

    calls: dict[int, dict[str, list[tuple[float, float, float]]]] = field(default_factory=dict)
    recording: bool = False

    def add(self, stage: int, kind: str, wall: float, input_grad: float,
            weight_grad: float) -> None:
        if self.recording:
            self.calls.setdefault(stage, {}).setdefault(kind, []).append(
                (wall, input_grad, weight_grad))

    def mean_ms(self) -> dict[str, dict[str, dict[str, float]]]:
        def mean(rows: list[tuple[float, float, float]], i: int) -> float:
            return 1000 * statistics.fmean(r[i] for r in rows)
        return {f"stage{s}": {k: {"wall_ms": mean(rows, 0), "input_grad_sleep_ms": mean(rows, 1),
                                  "weight_grad_sleep_ms": mean(rows, 2), "calls": len(rows)}
                              for k, rows in sorted(kinds.items())}
                for s, kinds in sorted(self.calls.items())}


def time_stage_calls(stage: pipe.PipelineStage, times: ActionTimes, busy: Busy) -> None:
    """Record the wall time of the stage's forward, backward and weight-backward calls (the
    schedule calls these public methods of the stage; wrapped on this instance only)."""
    def wrap(name: str, kind: Callable[[dict], str]) -> None:
        inner = getattr(stage, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start, before_i, before_w = time.perf_counter(), busy.input_grad, busy.weight_grad
            out = inner(*args, **kwargs)
            times.add(stage.stage_index, kind(kwargs), time.perf_counter() - start,
                      busy.input_grad - before_i, busy.weight_grad - before_w)
            return out
        setattr(stage, name, timed)

    wrap("forward_one_chunk", lambda kw: "forward")
    wrap("backward_one_chunk",
         lambda kw: "backward_full" if kw.get("full_backward", True) else "backward_input")
    wrap("backward_weight_one_chunk", lambda kw: "backward_weight")


def run_schedule(name: str, p: int, m: int, fwd_ms: float, warmup: int, repeats: int) -> dict:
    """One schedule on this rank's stages; every rank returns the same figures."""
    rank = dist.get_rank()
    v, style = SCHEDULES[name]
    mine = stage_indices(rank, p, v, style)
    num_stages = p * v
    busy, times = Busy(), ActionTimes()
    stages = []
    for index in mine:
        stage = pipe.PipelineStage(FixedCostStage(fwd_ms / 1000 / v, busy), index, num_stages,
                                   torch.device("cpu"))
        time_stage_calls(stage, times, busy)
        stages.append(stage)
    cls = getattr(pipe.schedules, name)
    schedule = (cls(stages[0], m, loss_fn=F.mse_loss) if v == 1
                else cls(stages, m, loss_fn=F.mse_loss))
    has_first, has_last = 0 in mine, num_stages - 1 in mine
    bubbles, steps, busy_s = [], [], []
    for n in range(warmup + repeats):
        # The first stage's input requires grad, so its input path costs B like any other's.
        x = torch.randn(m * FIXED_SHAPE[0], *FIXED_SHAPE[1:], requires_grad=True)
        target = torch.zeros(m * FIXED_SHAPE[0], *FIXED_SHAPE[1:])
        busy.forward = busy.input_grad = busy.weight_grad = 0.0
        times.recording = n >= warmup
        dist.barrier()
        start = time.perf_counter()
        schedule.step(*((x,) if has_first else ()), target=target if has_last else None)
        elapsed = time.perf_counter() - start
        step = torch.tensor([elapsed], dtype=torch.float64)
        dist.all_reduce(step, op=dist.ReduceOp.MAX)
        figures = torch.tensor([1 - busy.total() / step.item(), busy.total()],
                               dtype=torch.float64)
        gathered = [torch.zeros(2, dtype=torch.float64) for _ in range(p)]
        dist.all_gather(gathered, figures)
        if n >= warmup:
            bubbles.append(statistics.fmean(g[0].item() for g in gathered))
            steps.append(step.item())
            busy_s.append([g[1].item() for g in gathered])
        for stage in stages:
            stage.submod.zero_grad(set_to_none=True)
    expected, basis = theory(name, p, m, v)
    return {
        "stages_per_rank": v, "placement": style, "rank0_stages": stage_indices(0, p, v, style),
        "bubble": statistics.fmean(bubbles), "bubble_per_step": bubbles,
        "step_time_s_median": statistics.median(steps),
        "step_time_s_min": min(steps), "step_time_s_max": max(steps),
        "busy_s_per_rank": [statistics.fmean(r[i] for r in busy_s) for i in range(p)],
        "expected_busy_s_per_rank": 3 * fwd_ms / 1000 * m,
        "rank0_action_ms": times.mean_ms(),
        "theory": expected, "theory_basis": basis,
        "abs_diff_points": None if expected is None else 100 * abs(statistics.fmean(bubbles)
                                                                   - expected),
    }


def log(message: str) -> None:
    if dist.get_rank() == 0:
        print(f"torch_pipeline_peer: {message}", file=sys.stderr, flush=True)


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size, timeout=PG_TIMEOUT)
    out: dict[str, dict] = {}
    try:
        for name in args.schedules:
            try:
                out[name] = run_schedule(name, args.pp, args.micro, args.fwd_ms, args.warmup,
                                         args.repeats)
            except (ValueError, RuntimeError, AssertionError, NotImplementedError) as err:
                # Refusals in a schedule's constructor happen on every rank alike; a failure
                # inside a step on one rank times the others out, and they land here as well.
                out[name] = {"error": f"{type(err).__name__}: {str(err).strip()[:500]}"}
            log(f"{name}: " + (out[name]["error"] if "error" in out[name] else
                               f"bubble {out[name]['bubble']:.3f}, theory {out[name]['theory']}"))
            dist.barrier()
    finally:
        dist.destroy_process_group()
    if env.rank == 0:
        Path(args.out_file).write_text(json.dumps(out))


def run_torch_schedules(pp: int, micro: int, fwd_ms: float, repeats: int, warmup: int = 1,
                        schedules: list[str] | None = None) -> dict:
    """Run torch's schedules on fixed-cost stages in `pp` fresh worker processes and return
    the result (the JSON the CLI prints). Callable from other bench scripts."""
    names = list(SCHEDULES) if schedules is None else list(schedules)
    unknown = [n for n in names if n not in SCHEDULES]
    if unknown:
        raise ValueError(f"unknown schedules {unknown}; known: {list(SCHEDULES)}")
    with tempfile.TemporaryDirectory(prefix="torch-pipeline-peer-") as tmp:
        out_file = os.path.join(tmp, "result.json")
        argv = [os.path.abspath(__file__), "--worker", "--out-file", out_file, "--pp", str(pp),
                "--micro", str(micro), "--fwd-ms", str(fwd_ms), "--repeats", str(repeats),
                "--warmup", str(warmup), "--schedules", ",".join(names)]
        try:
            launch_local(pp, argv, env=dict(os.environ, OMP_NUM_THREADS="1"))
            per_schedule = json.loads(Path(out_file).read_text())
        except LaunchFailed as err:
            # The job died as a whole (a schedule crashed a rank): run each schedule alone so
            # the failure is charged to the schedule that caused it.
            if len(names) == 1:
                per_schedule = {names[0]: {"error": f"worker failed: {err}"}}
            else:
                per_schedule = {}
                for name in names:
                    per_schedule.update(run_torch_schedules(
                        pp, micro, fwd_ms, repeats, warmup, [name])["schedules"])
    return {
        "benchmark": "torch_pipeline_peer",
        "pp": pp, "micro": micro, "fwd_ms": fwd_ms, "repeats": repeats, "warmup": warmup,
        "costs": "F = B = W: per micro-batch a rank's forward, input gradient and weight "
                 "gradient each sleep fwd_ms (fwd_ms / v per stage)",
        "bubble_definition": "mean over ranks and repeats of 1 - busy / step wall time of the "
                             "slowest rank",
        "schedules": per_schedule,
        "torch_version": torch.__version__,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pp", type=int, default=4, help="pipeline ranks (worker processes)")
    p.add_argument("--micro", type=int, default=8, help="micro-batches per step")
    p.add_argument("--fwd-ms", type=float, default=20.0,
                   help="fixed forward cost of one rank's work per micro-batch (ms)")
    p.add_argument("--repeats", type=int, default=5, help="timed steps per schedule")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per schedule")
    p.add_argument("--schedules", default=",".join(SCHEDULES),
                   help=f"comma-separated, from {','.join(SCHEDULES)}")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-file", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.schedules = [s for s in args.schedules.split(",") if s]
    unknown = [s for s in args.schedules if s not in SCHEDULES]
    if unknown:
        p.error(f"--schedules: unknown {unknown}; choose from {','.join(SCHEDULES)}")
    for name in ("pp", "micro", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1")
    if args.pp < 2:
        p.error("--pp must be at least 2: torch's schedules need a pipeline")
    if args.warmup < 0 or args.fwd_ms <= 0:
        p.error("--warmup must be >= 0 and --fwd-ms > 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    result = run_torch_schedules(args.pp, args.micro, args.fwd_ms, args.repeats, args.warmup,
                                 args.schedules)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
