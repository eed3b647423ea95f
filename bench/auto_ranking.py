"""Does ``parallelism.auto`` rank layouts on this machine as they really run?

What it does
    1. Trains one small GPT with ``mcpar train --nproc 4`` under each layout of ``LAYOUTS``
       (data, tensor, sequence, context in both modes, pipeline with each registered schedule
       (1F1B, GPipe, interleaved, ZB-H1, ZB-H2, ZBV), ZeRO 1 and 3, both recompute policies,
       two gradient codecs, two micro-batch sizes, dropout on and off).
       Every key the planner searches is set, with ``parallelism.auto=true``: the planner then
       prices that layout alone, exactly as it prices it in a search, and the run's
       ``summary.json`` holds its ``prediction`` (step time, peak per rank) beside the measured
       ones (the median step after the first; the memory meter's largest rank).
    2. Trains once more with only the model's keys and ``parallelism.auto=true``: the planner's
       own pick among every layout of the world, measured the same way.
    3. Repeats the rounds (``--repeats``) and keeps each layout's median over them. Reports
       Spearman's rho between predicted and measured step times (and, the ceiling any
       prediction can reach here, between the rounds' own measurements), the median relative
       error of the step and of the peak, and the auto pick's measured throughput against the
       set's best and median.
    Another job sharing the cores would slow some runs and not others, so each run waits for an
    idle machine and is repeated when other processes used more than 5% of the cores while it
    ran (``local_sim_check``'s rule); the JSON records the share.
    ``--nodes N --rate RATE`` (N dividing 4) runs every job as on an N-node cluster instead: the
    ``netcluster`` package gives each node a network namespace, joined by a ``tc``-shaped link
    of RATE (kernel bridge, no added delay), and starts one ``torchrun`` per node with 4 / N
    ranks; the workers see they span N nodes and price the layouts on such a cluster. On one
    machine all ranks compute on the same cores and the layouts differ by a few percent; over
    a slow inter-node link, which axis crosses the link decides the step, as on a real cluster.
    The JSON records ``nodes`` and the ``link`` as built.

How to run
    python bench/auto_ranking.py [--steps 20] [--out bench/data/auto_ranking.json] [--only ...]
    python bench/auto_ranking.py --nodes 2 --rate 300mbit [...]   # as root (namespaces)

    Prints one JSON object on stdout; progress goes to stderr. About 11 minutes a round on 2
    cores (``--repeats``, default 3).
    The planner prices every run on one local profile, measured at the start on an idle machine
    (or ``--profile``, a saved one valid here) and restored before each run, since a run whose
    step misses its prediction by more than the margin measures the machine again.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import emulated_cluster
from bench_workers import emit_result
from emulated_cluster import REPO, error_summary
from local_sim_check import MAX_FOREIGN, foreign_share, measure_when_idle, wait_for_idle

from mcpar.sim.profilestore import PROFILE_ENV, lookup_profile, save_profile
from netcluster import NetCluster, NetClusterError, parse_rate
from netcluster.torchrun import launch_torchrun

WORKERS = 4
RUN_TIMEOUT_S = 1200.0
DEFAULT_RATE = "300mbit"  # inter-node link of --nodes above 1
MODEL = ["model.num_layers=4", "model.hidden_size=256", "model.num_heads=4", "model.seq_len=128",
         "optimization.global_batch_size=32", "training.eval_interval=0",
         "training.eval_batches=1", "training.progress=false", "parallelism.auto=true",
         # A codec the planner picks compresses from step 4 of 20, as dp4_1bit's does: the
         # measured step (the median after the first) is then a compressed one.
         "optimization.freeze_step=3", "controllers.communication.powersgd_start_step=3"]

# Every searched key the layouts below do not set themselves: a layout is then priced alone.
BASE = {"parallelism.tensor": 1, "parallelism.pipeline": 1, "parallelism.context": 1,
        "parallelism.context_mode": "ring", "parallelism.data": 4,
        "parallelism.virtual_stages": 1, "parallelism.schedule": "1f1b",
        "optimization.micro_batch_size": 8, "optimization.gradient_accumulation": 1,
        "controllers.memory.zero_stage": 0, "controllers.memory.activation_checkpointing": "none",
        "controllers.communication.compression": "none"}


def _pipeline(pp: int, dp: int, micro: int, schedule: str, vp: int = 1) -> dict[str, object]:
    return {"parallelism.pipeline": pp, "parallelism.data": dp, "parallelism.schedule": schedule,
            "parallelism.virtual_stages": vp, "optimization.micro_batch_size": micro,
            "optimization.gradient_accumulation": 32 // (dp * micro)}


LAYOUTS: dict[str, dict[str, object]] = {
    "dp4": {},
    "dp4_mb4": {"optimization.micro_batch_size": 4, "optimization.gradient_accumulation": 2},
    "dp4_zero1": {"controllers.memory.zero_stage": 1},
    "dp4_zero3": {"controllers.memory.zero_stage": 3},
    "dp4_selective": {"controllers.memory.activation_checkpointing": "selective"},
    "dp4_full": {"controllers.memory.activation_checkpointing": "full"},
    "dp4_bf16_codec": {"controllers.communication.compression": "bf16"},
    "dp4_1bit": {"controllers.communication.compression": "1bit",
                 "optimization.freeze_step": 3},  # compressing from step 4 of 20
    "dp4_dropout": {"model.dropout": 0.1},
    "tp2_dp2": {"parallelism.tensor": 2, "parallelism.data": 2,
                "optimization.micro_batch_size": 16},
    "tp2_sp_dp2": {"parallelism.tensor": 2, "parallelism.data": 2,
                   "parallelism.sequence_parallel": True, "optimization.micro_batch_size": 16},
    "tp2_dp2_dropout": {"parallelism.tensor": 2, "parallelism.data": 2,
                        "optimization.micro_batch_size": 16, "model.dropout": 0.1},
    "tp4": {"parallelism.tensor": 4, "parallelism.data": 1, "optimization.micro_batch_size": 32},
    "pp2_dp2_1f1b": _pipeline(2, 2, 4, "1f1b"),
    "pp2_dp2_gpipe": _pipeline(2, 2, 4, "gpipe"),
    "pp2_dp2_interleaved": _pipeline(2, 2, 4, "interleaved_1f1b", vp=2),
    "pp2_dp2_zb_h1": _pipeline(2, 2, 4, "zb_h1"),
    "pp2_dp2_zbv": _pipeline(2, 2, 4, "zbv", vp=2),
    "pp4_1f1b": _pipeline(4, 1, 4, "1f1b"),
    "pp4_zb_h2": _pipeline(4, 1, 4, "zb_h2"),
    "cp2_dp2_ring": {"parallelism.context": 2, "parallelism.data": 2,
                     "optimization.gradient_accumulation": 2},
    "cp2_dp2_ulysses": {"parallelism.context": 2, "parallelism.context_mode": "ulysses",
                        "parallelism.data": 2, "optimization.gradient_accumulation": 2},
    "cp4_ring": {"parallelism.context": 4, "parallelism.data": 1,
                 "optimization.micro_batch_size": 16, "optimization.gradient_accumulation": 2},
    "tp2_pp2": {"parallelism.tensor": 2, **_pipeline(2, 1, 8, "1f1b")},
}


def _value(v: object) -> str:
    return str(v).lower() if isinstance(v, bool) else str(v)


def node_launch(overrides: list[str], steps: int, run_dir: Path, profile: Path
                ) -> tuple[list[str], dict[str, str]]:
    """What each node's torchrun starts for a run on emulated nodes, and the environment it
    forwards to its workers.

    mcpar goes through ``emulated_cluster``'s ``_mcpar`` entry, which caps each worker's
    threads at torchrun's ``OMP_NUM_THREADS``: every emulated node shares this machine's cores.
    The device is pinned to the CPU: the emulated nodes share this machine's cores, and a GPU
    here would not be split between them.
    """
    argv = [str(Path(emulated_cluster.__file__).resolve()), "_mcpar", "train",
            "--run-dir", str(run_dir), "--steps", str(steps)]
    for item in [*overrides, "training.device=cpu"]:
        argv += ["--set", item]
    return argv, {PROFILE_ENV: str(profile)}


def emulated_link(nodes: int, rate: str) -> dict[str, object]:
    """The link every run of ``--nodes``/``--rate`` gets, built once and torn down: a machine
    that cannot build it fails here, before the minutes of profile measurement."""
    with NetCluster(nodes, rate=rate, delay=0) as cluster:
        return cluster.describe()


def _train_on_nodes(overrides: list[str], steps: int, run_dir: Path, profile: Path,
                    nodes: int, rate: str) -> None:
    argv, env = node_launch(overrides, steps, run_dir, profile)
    # A fresh cluster per run: its teardown kills whatever a failed run left in the namespaces
    # (torchrun's workers lead their own sessions), so no straggler shares the next run's cores.
    # Delay 0 takes a kernel bridge: no user-space forwarder competing for the 2 cores.
    with NetCluster(nodes, rate=rate, delay=0) as cluster:
        result = launch_torchrun(cluster, WORKERS // nodes, argv, env=env,
                                 timeout_s=RUN_TIMEOUT_S, cwd=str(REPO))
    if not result.ok:
        failed = result.failed_node if result.failed_node is not None else 0
        why = (f"timed out after {RUN_TIMEOUT_S:.0f} s" if result.timed_out
               else error_summary(result.output[failed], result.exit_code()))
        raise RuntimeError(f"mcpar train failed on {nodes} nodes ({overrides}): {why}")


def run(overrides: list[str], steps: int, profile: Path, saved: str, nodes: int = 1,
        rate: str = DEFAULT_RATE) -> dict[str, object]:
    """Train with ``overrides`` priced on ``profile`` (restored to ``saved`` first), on this
    machine or on ``nodes`` emulated nodes joined at ``rate``; the summary's prediction."""
    profile.write_text(saved)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        if nodes > 1:
            _train_on_nodes(overrides, steps, run_dir, profile, nodes, rate)
        else:
            cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", str(WORKERS),
                   "--steps", str(steps), "--run-dir", str(run_dir)]
            for item in overrides:
                cmd += ["--set", item]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
                                  env={**os.environ, PROFILE_ENV: str(profile)})
            if proc.returncode != 0:
                raise RuntimeError(f"mcpar train failed ({overrides}): {proc.stderr[-2000:]}")
        summary = json.loads((run_dir / "summary.json").read_text())
    return summary["prediction"]


def measured(overrides: list[str], args: argparse.Namespace, profile: Path, saved: str
             ) -> tuple[dict[str, object], float]:
    retries = args.retries
    for attempt in range(1 + retries):
        wait_for_idle(args.idle_wait)
        prediction, foreign = foreign_share(
            lambda: run(overrides, args.steps, profile, saved, args.nodes, args.rate))
        if foreign <= MAX_FOREIGN:
            break
        print(f"  other processes used {foreign:.0%} of the cores meanwhile; "
              f"{'again' if attempt < retries else 'keeping it'}", file=sys.stderr, flush=True)
    return prediction, foreign


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation (average ranks for ties)."""
    def ranks(values: list[float]) -> list[float]:
        order = sorted(range(len(values)), key=values.__getitem__)
        out = [0.0] * len(values)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
                j += 1
            for k in range(i, j + 1):
                out[order[k]] = (i + j) / 2
            i = j + 1
        return out

    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry, strict=True))
    sx = sum((a - mx) ** 2 for a in rx) ** 0.5
    sy = sum((b - my) ** 2 for b in ry) ** 0.5
    return cov / (sx * sy) if sx and sy else float("nan")


def _row(name: str, rounds: list[tuple[dict[str, object], float]]) -> dict[str, object]:
    """One layout over its rounds: the median of the rounds' measured steps (a launch's own
    noise, 5-10% on this machine, is larger than many layouts' differences)."""
    p = rounds[0][0]
    steps = [float(r["measured_step_s"]) for r, _ in rounds]  # type: ignore[arg-type]
    peaks = [float(r["measured_peak_bytes"]) for r, _ in rounds]  # type: ignore[arg-type]
    predicted = float(p["predicted_step_s"])  # type: ignore[arg-type]
    predicted_peak = float(p["predicted_peak_bytes"])  # type: ignore[arg-type]
    step, peak = statistics.median(steps), statistics.median(peaks)
    # Each term of the step (the summary's: compute, the slowest replica's lateness, the
    # exposed gradient exchange), predicted and measured, the measured one's median over rounds.
    terms = {term: {"predicted": round(float(parts["predicted"]), 4),
                    "measured": round(statistics.median(
                        float(r["terms"][term]["measured"]) for r, _ in rounds), 4)}  # type: ignore[index]
             for term, parts in p["terms"].items()}  # type: ignore[union-attr]
    return {"layout": name, "chosen": p["layout"], "predicted_step_s": round(predicted, 4),
            "measured_step_s": round(step, 4), "rounds_step_s": [round(t, 4) for t in steps],
            "step_error": round(step / predicted - 1, 3),
            "predicted_peak_bytes": int(predicted_peak), "measured_peak_bytes": int(peak),
            "peak_error": round(peak / predicted_peak - 1, 3), "terms": terms,
            "foreign_cpu_share": round(max(f for _, f in rounds), 3),
            "remeasured_after": any("profile_remeasured" in r for r, _ in rounds),
            "ranked_on": [r.get("ranked_on") for r, _ in rounds]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # The trainer's measured step is the median after the first; the next few steps still
    # warm up (allocator, buffers), so a longer run leaves them less weight.
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--only", nargs="*", default=None, help="layouts to run")
    parser.add_argument("--no-auto", action="store_true", help="skip the planner's own pick")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a saved local profile (default: measure one now)")
    parser.add_argument("--idle-wait", type=float, default=300.0)
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="rounds over every layout")
    parser.add_argument("--nodes", type=int, default=1,
                        help=f"emulated nodes sharing the {WORKERS} ranks (1: this machine "
                             "alone, no namespaces)")
    parser.add_argument("--rate", default=DEFAULT_RATE,
                        help="inter-node link rate, tc units (with --nodes above 1)")
    args = parser.parse_args(argv)
    if args.nodes < 1 or WORKERS % args.nodes:
        parser.error(f"--nodes must divide the {WORKERS} workers (1, 2 or 4), got {args.nodes}")
    try:
        parse_rate(args.rate)
    except ValueError as err:
        parser.error(f"--rate: {err}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    link: dict[str, object] | None = None
    if args.nodes > 1:
        try:  # NetClusterError also says why a machine cannot (no root, no ip/tc)
            link = emulated_link(args.nodes, args.rate)
        except NetClusterError as err:
            print(f"--nodes {args.nodes}: cannot build the emulated cluster: {err}",
                  file=sys.stderr)
            return 2
    tmp = Path(tempfile.mkdtemp(prefix="auto-ranking-"))
    profile = tmp / "local_profile.json"
    if args.profile is not None:
        found = lookup_profile(args.profile)
        if found.profile is None:
            print(f"--profile: {found.why}; leave --profile out to measure one",
                  file=sys.stderr)
            return 2
        saved = args.profile.read_text()
        profile_foreign = None
    else:
        measured_profile, profile_foreign = measure_when_idle(args.retries, args.idle_wait)
        save_profile(measured_profile, profile)
        saved = profile.read_text()
    jobs = {name: MODEL + [f"{k}={_value(v)}" for k, v in {**BASE, **keys}.items()]
            for name, keys in LAYOUTS.items() if not args.only or name in args.only}
    if not args.no_auto:
        jobs["auto"] = MODEL  # the planner's own pick among every layout of the world
    rounds: dict[str, list[tuple[dict[str, object], float]]] = {name: [] for name in jobs}
    for r in range(args.repeats):  # rounds over every layout: a slow spell hits them all
        for name, overrides in jobs.items():
            print(f"round {r + 1}/{args.repeats}: {name} ...", file=sys.stderr, flush=True)
            prediction, foreign = measured(overrides, args, profile, saved)
            rounds[name].append((prediction, foreign))
            print(f"  predicted {float(prediction['predicted_step_s']):.4f} s, measured "  # type: ignore[arg-type]
                  f"{float(prediction['measured_step_s']):.4f} s; peak error "  # type: ignore[arg-type]
                  f"{float(prediction['peak_error']):+.1%}", file=sys.stderr, flush=True)  # type: ignore[arg-type]
    rows = [_row(name, rounds[name]) for name in jobs if name != "auto"]
    auto = _row("auto", rounds["auto"]) if "auto" in rounds else None
    result: dict[str, object] = {"model": MODEL, "workers": WORKERS, "steps": args.steps,
                                 "repeats": args.repeats, "nodes": args.nodes, "link": link,
                                 "profile": json.loads(saved),
                                 "profile_foreign_cpu_share": profile_foreign,
                                 "layouts": rows, "auto": auto}
    if len(rows) >= 2:
        pred = [float(r["predicted_step_s"]) for r in rows]  # type: ignore[arg-type]
        meas = [float(r["measured_step_s"]) for r in rows]  # type: ignore[arg-type]
        result["spearman_rho"] = round(spearman(pred, meas), 3)
        # The measurement's own repeatability, the ceiling of any prediction's rho: each pair
        # of rounds ranked against each other, and the prediction against each round alone.
        by_round = [[float(r["rounds_step_s"][k]) for r in rows]  # type: ignore[index]
                    for k in range(args.repeats)]
        result["round_to_round_rho"] = [
            round(spearman(by_round[i], by_round[j]), 3)
            for i in range(args.repeats) for j in range(i + 1, args.repeats)]
        result["predicted_vs_each_round_rho"] = [round(spearman(pred, r), 3) for r in by_round]
        result["median_abs_step_error"] = round(statistics.median(
            abs(float(r["step_error"])) for r in rows), 3)  # type: ignore[arg-type]
        result["median_abs_peak_error"] = round(statistics.median(
            abs(float(r["peak_error"])) for r in rows), 3)  # type: ignore[arg-type]
        result["worst_abs_peak_error"] = round(max(
            abs(float(r["peak_error"])) for r in rows), 3)  # type: ignore[arg-type]
        if auto is not None:
            best, median = min(meas), statistics.median(meas)
            chosen = float(auto["measured_step_s"])  # type: ignore[arg-type]
            result["auto_vs_best_throughput"] = round(best / chosen, 3)
            result["auto_vs_median_throughput"] = round(median / chosen, 3)
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
