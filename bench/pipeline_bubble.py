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

    Theory, with B = ``--b-ratio`` and W = ``--w-ratio`` forwards (an unsplit backward both;
    1 and 1 by default), equal stages and free messages: the critical path of each schedule's
    orders, which at the defaults is ``(p-1)/(m+p-1)`` for GPipe and 1F1B,
    ``(p-1)/(v m + p-1)`` for the interleaved schedule and ``(p-1)/(3m + p-1)`` for ZB-H1
    (m >= p).

    1. fixed_cost: every stage's work has a fixed cost, independent of CPU contention: its forward
       sleeps ``--fwd-ms / v`` and its backward (an autograd Function) twice that, so a rank's work
       per micro-batch is the same for any v, and ``--pp`` processes sharing few cores cannot blur
       the schedule; under a split schedule B sleeps the forward's time and W (a tiny linear
       layer's deferred weight gradient, then a sleep) as much (``--b-ratio`` and
       ``--w-ratio`` times it). This is the check of the schedules and of the executor's
       overheads. ZB-H2 and ZBV then run again as ``<name>@measured_costs``, their order built
       from each rank's median F, B and W of the run just measured (``ActionCosts``; a
       message priced at ``MESSAGE_LATENCY`` of a forward).
    2. real_model: the same schedules on GPT stages (``--layers`` blocks cut evenly into
       ``pp x v`` stages with ``cut_model``), one thread per process. With more processes than
       cores, ranks' compute slows each other down, so these figures are blurred (the JSON says so);
       ``step_time_s_median`` of each schedule is the other figure to compare there. Each rank's
       peak activation bytes in the first timed step (the MemoryController's meter, as a training
       run measures them: what autograd saves, under a split what W's store keeps, and the
       loss's transients) are reported per schedule, next to the memory estimate's bytes for
       the same rank (``mcpar.sim.memory.rank_activations``) and their ratio.

How to run
    python bench/pipeline_bubble.py [--pp 4] [--micro 8] [--virtual 2] [--fwd-ms 20]
                                    [--repeats 5] [--warmup 1] [--skip-real-model]
                                    [--skip-torch-peer] [--out FILE]

    Prints one JSON object on stdout; progress goes to stderr. Unless ``--skip-torch-peer``,
    torch's own schedules (``bench/torch_pipeline_peer.py``: ``Schedule1F1B``, interleaved,
    ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``) run
    right after on the same fixed-cost stages; ``against_torch`` gives each mcpar schedule's
    bubble minus its torch counterpart's, in points, and its throughput over torch's 1F1B.
    With the real model, torch's schedules also run on the same GPT stages
    (``bench/torch_pipeline_real.py``), and ``real_model_against_torch`` gives each schedule's
    throughput over mcpar's 1F1B and torch's. ``--rounds`` repeats all of it on fresh
    processes; the comparisons give each round's figure and the median.
"""

from __future__ import annotations

import argparse
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
from bench_workers import emit_result, run_worker
from pipeline_rounds import against_torch, real_model_ratios, round_checks, spread
from pipeline_timing import (
    log,
    measure,
    measure_overlapped,
    overlapped_theory,
    placement,
    splits,
    theory,
)
from torch import nn
from torch_pipeline_peer import run_torch_schedules
from torch_pipeline_real import run_torch_real_model

import mcpar.controllers.registered  # noqa: F401  (the schedules)
from mcpar.config import ModelConfig
from mcpar.config.loading import parse_config
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.compute.schedules import schedule_problem, step_tasks
from mcpar.controllers.compute.zero_bubble_v import MESSAGE_LATENCY
from mcpar.controllers.memory.measure import MemoryMeter
from mcpar.launch.env import DistEnv
from mcpar.launch.local import LaunchFailed, launch_local
from mcpar.models.spec import get_model_spec
from mcpar.parallel.pipeline import PipelineExecutor
from mcpar.parallel.stage import cut_model
from mcpar.parallel.weight_grad import WeightGradStore, split_weight_grads
from mcpar.registry.schedule import SCHEDULES, ActionCosts
from mcpar.sim.fromconfig import config_layout, config_model
from mcpar.sim.memory import held_limits, rank_activations
from mcpar.sim.workload import Layout, ModelShape
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
    p.add_argument("--b-ratio", type=float, default=1.0,
                   help="fixed-cost stages: B's cost over the forward's (split schedules; an "
                        "unsplit backward costs B + W)")
    p.add_argument("--w-ratio", type=float, default=1.0,
                   help="fixed-cost stages: W's cost over the forward's")
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
    p.add_argument("--skip-torch-peer", action="store_true",
                   help="leave out torch.distributed.pipelining's schedules on the same stages")
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds of mcpar's schedules then torch's, on fresh processes each; the "
                        "comparison is over the rounds' medians")
    p.add_argument("--out", default=None, help="also write the JSON to this file")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-file", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    for name in ("pp", "micro", "virtual", "repeats", "layers", "hidden", "seq",
                 "micro_batch_size", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.warmup < 0 or args.fwd_ms <= 0 or args.b_ratio <= 0 or args.w_ratio <= 0:
        p.error("--warmup must be >= 0 and --fwd-ms, --b-ratio, --w-ratio > 0")
    if (args.b_ratio, args.w_ratio) != (1.0, 1.0) and not args.skip_torch_peer:
        p.error("torch's fixed-cost stages sleep B = W = F: with --b-ratio or --w-ratio, "
                "pass --skip-torch-peer")
    for schedule, v in schedules(args):
        reason = schedule_problem(schedule, args.pp, args.micro, v)
        if reason is not None:
            p.error(reason)
    if not args.skip_real_model and args.layers % (args.pp * args.virtual):
        p.error(f"--layers {args.layers} must divide into pp x virtual = "
                f"{args.pp * args.virtual} equal stages")
    return args


def schedules(args: argparse.Namespace) -> list[tuple[str, int]]:
    return [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", args.virtual), ("zb_h1", 1),
            ("zb_h2", 1), ("zbv", 2)]


def message_latency_s(rounds: int = 60, idle_s: float = 0.005) -> float:
    """One way of a pipeline message between ranks 0 and 1, as the fixed-cost stages see it:
    the median of ``rounds`` gloo round trips of a fixed-cost activation, halved, each after
    rank 0 idled ``idle_s`` (a sleeping stage's core is idle, and waking its receiver is part of
    the latency). Every rank returns rank 0's figure."""
    rank, buf, trips = dist.get_rank(), torch.zeros(FIXED_SHAPE), []
    dist.barrier()
    for _ in range(rounds if rank < 2 else 0):
        if rank == 0:
            time.sleep(idle_s)
            begin = time.perf_counter()
            dist.send(buf, 1)
            dist.recv(buf, 1)
            trips.append(time.perf_counter() - begin)
        else:
            dist.recv(buf, 0)
            dist.send(buf, 0)
    out = torch.tensor([statistics.median(trips) / 2 if trips else 0.0], dtype=torch.float64)
    dist.broadcast(out, 0)
    return out.item()


class SleepingWeightGrads(WeightGradStore):
    """A fixed-cost stage's W: its linear layer's deferred weight gradient, then a sleep."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds

    def run(self, key: tuple[int, int]) -> None:
        super().run(key)
        time.sleep(self.seconds)


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
    """A stage whose forward sleeps `fwd_s` and whose backward ``b_ratio + w_ratio`` times
    that (``split``: B sleeps ``b_ratio`` of it, and its W, ``SleepingWeightGrads``,
    ``w_ratio``)."""

    def __init__(self, fwd_s: float, first: bool, split: bool = False, b_ratio: float = 1.0,
                 w_ratio: float = 1.0):
        super().__init__()
        self.fwd_s = fwd_s
        self.bwd_s = fwd_s * (b_ratio if split else b_ratio + w_ratio)
        self.embed = nn.Embedding(FIXED_VOCAB, FIXED_SHAPE[-1]) if first else None
        self.mix = nn.Linear(FIXED_SHAPE[-1], FIXED_SHAPE[-1])  # the weight W computes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
        time.sleep(self.fwd_s)
        return _SleepInBackward.apply(self.mix(x), self.bwd_s)


def fixed_cost_part(args: argparse.Namespace,
                    comm: CommunicationController) -> tuple[dict, float]:
    """Every schedule on the fixed-cost stages, and the message latency measured first."""
    rank, pp, m = dist.get_rank(), args.pp, args.micro
    gen = torch.Generator().manual_seed(0)

    def batches() -> tuple[list, list]:
        inputs = [torch.randint(0, FIXED_VOCAB, FIXED_SHAPE[:2], generator=gen) for _ in range(m)]
        return inputs, [torch.zeros(FIXED_SHAPE) for _ in range(m)]

    def run(schedule: str, v: int, costs: ActionCosts | None = None,
            overlapped: bool = False) -> tuple[dict, list]:
        fwd_s = args.fwd_ms / 1000 / v
        stages = [SCHEDULES.get(schedule).stage_of(c, rank, pp, v) for c in range(v)]
        chunks: list[nn.Module] = [
            FixedCostStage(fwd_s, first=stage == 0, split=splits(schedule),
                           b_ratio=args.b_ratio, w_ratio=args.w_ratio) for stage in stages]
        store = SleepingWeightGrads(fwd_s * args.w_ratio) if splits(schedule) else None
        for chunk in chunks if store is not None else []:
            split_weight_grads(chunk, store)
        executor = PipelineExecutor(chunks, rank, pp, comm, m, FIXED_SHAPE,
                                    F.mse_loss, torch.device("cpu"), weight_grads=store,
                                    **placement(schedule, rank, pp, m, v, costs,
                                                overlapped=overlapped))
        tasks = step_tasks(schedule, rank, pp, m, v, costs=costs, overlapped=overlapped)
        latency = latency_s / (args.fwd_ms / 1000)
        if overlapped:
            result = measure_overlapped(executor, tasks, batches, args.warmup, args.repeats)
            expected = overlapped_theory(schedule, pp, m, v, args.b_ratio, args.w_ratio)
            at_latency = overlapped_theory(schedule, pp, m, v, args.b_ratio, args.w_ratio,
                                           latency)
        else:
            result = measure(executor, tasks, batches, args.warmup, args.repeats)
            expected = theory(schedule, pp, m, v, args.b_ratio, args.w_ratio, costs)
            # The same orders with each message at the latency measured on this machine.
            at_latency = theory(schedule, pp, m, v, args.b_ratio, args.w_ratio, costs,
                                latency=latency)
        return ({"virtual_stages": v, **result, "theory": expected,
                 "abs_diff_points": 100 * abs(result["idle_fraction"] - expected),
                 "theory_at_measured_latency": at_latency,
                 "abs_diff_points_at_measured_latency":
                     100 * abs(result["idle_fraction"] - at_latency)},
                executor.last_stats.actions)

    latency_s = message_latency_s()
    out: dict = {}
    for schedule, v in schedules(args):
        out[schedule], actions = run(schedule, v)
        log(f"fixed cost {schedule}: idle {out[schedule]['idle_fraction']:.3f}, "
            f"theory {out[schedule]['theory']:.3f}")
        if schedule in COSTED:
            # The order built from the costs this run measured: each rank's median F, B and
            # W of its last step, every rank's gathered.
            costs = measured_costs(actions, pp)
            name = f"{schedule}@measured_costs"
            out[name], _ = run(schedule, v, costs)
            out[name]["action_costs_s"] = [list(c) for c in costs.per_rank]
            out[name]["message_latency_s"] = costs.latency
            log(f"fixed cost {name}: idle {out[name]['idle_fraction']:.3f}, "
                f"theory {out[name]['theory']:.3f}")
    for schedule, v in schedules(args):
        if schedule not in OVERLAPPED:
            continue
        # Steps that overlap (optimization.post_validation): no barrier between them, the
        # orders chosen for it.
        name = f"{schedule}@overlapped_steps"
        out[name], _ = run(schedule, v, overlapped=True)
        log(f"fixed cost {name}: idle {out[name]['idle_fraction']:.3f}, "
            f"theory {out[name]['theory']:.3f}")
    return out, latency_s


# Run again with steps that overlap: ZBV, whose orders change for it; ZB-H2, whose ranks end a
# step as far apart as they start it (its theory there is 0); 1F1B and ZB-H1, whose ranks end
# together, to show that overlap alone gives them nothing.
OVERLAPPED = ("1f1b", "zb_h1", "zb_h2", "zbv")


# The split schedules whose order follows measured costs: each runs again with them.
COSTED = ("zb_h2", "zbv")


def measured_costs(actions: list[tuple[str, int, int, float, float]], pp: int) -> ActionCosts:
    """Every rank's median seconds of a chunk's F, B and W in the step ``actions`` timed
    (the executor's ``last_stats.actions``: kind, chunk, micro-batch, begin, end), gathered
    from all ranks; a message priced at ``MESSAGE_LATENCY`` of the slowest median forward
    (the latency the unit-cost order is built with)."""
    mine = tuple(statistics.median(end - begin for kind, _c, _k, begin, end in actions
                                   if kind == part) for part in "FBW")
    per_rank: list = [None] * pp
    dist.all_gather_object(per_rank, mine)
    latency = MESSAGE_LATENCY * max(r[0] for r in per_rank)
    return ActionCosts(tuple(tuple(r) for r in per_rank), latency)


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
        chunks = [cut_model(model, ranges, SCHEDULES.get(schedule).stage_of(c, rank, pp, v))
                  for c in range(v)]
        store = WeightGradStore() if splits(schedule) else None
        for chunk in chunks if store is not None else []:
            # As the ComputeController's plan splits it: the head keeps its whole backward.
            split_weight_grads(chunk, store, keep_whole=chunk.pieces()[2])
        meter = MemoryMeter([p for chunk in chunks for p in chunk.parameters()],
                            torch.device("cpu"))
        meter.weight_grads = store
        # As the MemoryController bounds it on this config: a split schedule held to 1F1B's
        # activation peak (``held_limits``).
        limits = held_limits(*real_model_layout(args, schedule, v))
        executor = PipelineExecutor(list(chunks), rank, pp, comm, m, (*shape, args.hidden),
                                    meter.wrap_loss(loss_fn), torch.device("cpu"),
                                    weight_grads=store,
                                    **placement(schedule, rank, pp, m, v, limits=limits))
        executor.hold_received = meter.holding  # as the trainer wires it
        result = measure(executor, step_tasks(schedule, rank, pp, m, v, limits=limits),
                         batches, args.warmup, args.repeats, meter)
        model.zero_grad(set_to_none=True)
        expected = theory(schedule, pp, m, v, limits=limits)
        estimate = estimated_activations(args, schedule, v)
        measured = result["peak_activation_bytes_per_rank"]
        out[schedule] = {"virtual_stages": v, "held_limits": limits, **result,
                         "theory": expected,
                         "abs_diff_points": 100 * abs(result["idle_fraction"] - expected),
                         "estimated_activation_bytes_per_rank": [round(e) for e in estimate],
                         "estimate_over_measured_per_rank":
                             [e / x for e, x in zip(estimate, measured, strict=True)],
                         "estimate_over_measured_peak": max(estimate) / max(measured)}
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


def estimated_activations(args: argparse.Namespace, schedule: str, v: int) -> list[float]:
    """The memory estimate's activation bytes of each pipeline rank at its peak
    (``mcpar.sim.memory.rank_activations``, which ``mcpar check`` and the planner price with),
    for the real model's config on this layout."""
    return rank_activations(*real_model_layout(args, schedule, v))


def real_model_layout(args: argparse.Namespace, schedule: str,
                      v: int) -> tuple[ModelShape, Layout]:
    """The real model's config on this layout, as the cost model sees it."""
    cfg = parse_config({
        "model": {"kind": "gpt", "num_layers": args.layers, "hidden_size": args.hidden,
                  "num_heads": max(1, args.hidden // 32), "seq_len": args.seq},
        "parallelism": {"pipeline": args.pp, "data": 1, "schedule": schedule,
                        "virtual_stages": v},
        "optimization": {"micro_batch_size": args.micro_batch_size,
                         "gradient_accumulation": args.micro},
        "training": {"device": "cpu", "dtype": "float32"}})
    return config_model(cfg), config_layout(cfg, args.pp)


def worker(args: argparse.Namespace, env: DistEnv) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{env.master_addr}:{env.master_port}",
                            rank=env.rank, world_size=env.world_size)
    try:
        dims = ParallelDims(dp=1, tp=1, pp=args.pp, ep=1, world_size=args.pp)
        dims.build_mesh("cpu")
        comm = CommunicationController(dims)
        fixed, latency_s = fixed_cost_part(args, comm)
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
        # One way, rank 0 to 1 and back halved, after rank 0 idled (``message_latency_s``).
        "message_latency_s": latency_s,
        "checks": {
            "1f1b_within_5_points_of_theory": one_f["abs_diff_points"] <= 5.0,
            "interleaved_idle_lower_than_1f1b":
                fixed["interleaved_1f1b"]["idle_fraction"] < one_f["idle_fraction"],
            "zb_h1_within_2_points_of_theory": fixed["zb_h1"]["abs_diff_points"] <= 2.0,
            "zb_h1_within_2_points_of_theory_at_measured_latency":
                fixed["zb_h1"]["abs_diff_points_at_measured_latency"] <= 2.0,
            "zb_h1_idle_lower_than_interleaved":
                fixed["zb_h1"]["idle_fraction"] < fixed["interleaved_1f1b"]["idle_fraction"],
        },
        # Same ranks, same work per micro-batch: step time of each schedule over 1F1B's.
        "speedup_over_1f1b": {name: one_f["step_time_s_median"] / r["step_time_s_median"]
                              for name, r in fixed.items()},
        # The peer comparison: same ranks, same work, only the schedule differs.
        "interleaved_over_1f1b_idle_ratio":
            fixed["interleaved_1f1b"]["idle_fraction"] / one_f["idle_fraction"],
        "real_model": real,
        "real_model_peak_activations_over_1f1b": None if real is None else {
            name: max(r["peak_activation_bytes_per_rank"])
            / max(real["schedules"]["1f1b"]["peak_activation_bytes_per_rank"])
            for name, r in real["schedules"].items()},
        # The memory estimate (``sim.memory.rank_activations``) over the measured peak, on
        # the busiest rank of each schedule.
        "real_model_estimate_over_measured_peak": None if real is None else {
            name: r["estimate_over_measured_peak"] for name, r in real["schedules"].items()},
        "torch_version": torch.__version__,
    }
    if real is not None:
        # The split schedules' memory against 1F1B's at the same m (the issue's bounds).
        peaks = result["real_model_peak_activations_over_1f1b"]
        result["checks"].update({"zb_h1_peak_at_most_1.05x_1f1b": peaks["zb_h1"] <= 1.05,
                                 "zbv_peak_at_most_1f1b": peaks["zbv"] <= 1.0})
    Path(args.result_file).write_text(json.dumps(result))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        return run_worker(args, worker)
    argv_out = list(sys.argv[1:] if argv is None else argv)
    result: dict | None = None
    rounds: list[tuple[dict, dict]] = []
    real_rounds: list[tuple[dict, dict]] = []
    fixed_rounds: list[dict] = []
    latencies: list[float] = []
    for n in range(args.rounds):
        worker_argv = argv_out
        with tempfile.TemporaryDirectory(prefix="pipeline-bubble-") as tmp:
            result_file = os.path.join(tmp, "result.json")
            try:
                launch_local(args.pp, [os.path.abspath(__file__), "--worker", "--result-file",
                                       result_file, *worker_argv],
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
            except LaunchFailed as err:
                print(f"pipeline_bubble: {err}", file=sys.stderr)
                return 1
            this_round = json.loads(Path(result_file).read_text())
        result = result or this_round
        fixed_rounds.append(this_round["fixed_cost"])
        latencies.append(this_round["message_latency_s"])
        if not args.skip_torch_peer:
            # Right after mcpar's, on fresh processes, the same stages and costs.
            print(f"pipeline_bubble: round {n + 1}: torch's schedules on the same stages",
                  file=sys.stderr)
            peer = run_torch_schedules(args.pp, args.micro, args.fwd_ms, args.repeats,
                                       args.warmup)
            result.setdefault("torch_peer", peer)
            rounds.append((this_round["fixed_cost"], peer))
            if this_round["real_model"] is not None:
                peer_real = run_torch_real_model(
                    args.pp, args.micro, args.layers, args.hidden, args.seq,
                    args.micro_batch_size, args.repeats, args.warmup)
                result.setdefault("torch_real_model", peer_real)
                real_rounds.append((this_round["real_model"]["schedules"], peer_real))
    assert result is not None
    # Every schedule's fixed-cost bubble, round by round (median, min, max).
    result["fixed_cost_bubble_rounds"] = spread(
        {name: [r[name]["idle_fraction"] for r in fixed_rounds] for name in fixed_rounds[0]})
    # And the theory of each round at the message latency that round measured.
    result["fixed_cost_theory_at_measured_latency_rounds"] = spread(
        {name: [r[name]["theory_at_measured_latency"] for r in fixed_rounds]
         for name in fixed_rounds[0]})
    result["message_latency_s_rounds"] = latencies
    result["checks"].update(round_checks(result["fixed_cost_bubble_rounds"],
                                         result["fixed_cost_theory_at_measured_latency_rounds"],
                                         fixed_rounds[0]["zb_h1"]["theory"]))
    result["machine"] = (f"{os.cpu_count()} cores, shared with other jobs while it ran: "
                         "timings are noisy, compare within a round")
    if rounds:
        result["against_torch"] = against_torch(rounds)
    if real_rounds:
        result["real_model_against_torch"] = real_model_ratios(real_rounds)
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
