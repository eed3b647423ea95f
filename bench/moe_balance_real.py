"""Section 2 of ``bench/moe_balance.py``: the real MoE model's step time under each placement
policy, on loopback and on 2 emulated nodes at 100 Mbit/s.

What it runs
    ``mcpar train`` on the real MoE model (8 experts, top-2, 2 layers, hidden 64, inner width
    ``--real-ffn`` 2048 so that the experts are the bulk of a rank's compute, seq 64, no
    routing-side balancing: ``router_bias_update_rate=0``, ``aux_loss_coef=0``, so the router
    skews as it does untreated) with ``--real-ep`` (4) expert ranks = data 4 = world 4, one
    expert group, 2 sequences per rank and step (the global batch of the recorded routing
    trace), once per ``controllers.compute.scheduler`` (static, greedy, reinforcement) on the
    same config, data and seed, ``--real-steps`` (120) steps, ``balance_interval`` 10, measured
    costs (the default ``balance_costs``). ``--real-repeats`` N interleaves N trios.

    Networks: ``loopback`` (4 processes on this machine, ``mcpar train --nproc 4``) and, with
    ``--real-emulated`` (root), ``100mbit``: 2 emulated nodes (``netcluster.NetCluster``, links
    of ``--real-rate``) with 2 ranks each started by torchrun, so that half of every all-to-all
    and every migration between the two halves crosses the shaped link.

Reported per network and policy (steps after ``--real-warmup``): mean and median step time,
    mean imbalance (max / mean tokens per expert rank, as the trainer logs it), experts
    migrated, the final loss, the mean measured step costs the balancer saw (wait on the slowest
    rank, all-to-all, migration), the number of decisions and of null rewards in
    ``load_balance.jsonl`` (0 expected), and ``max_abs_loss_diff`` over all steps between every
    run and the first static run (migration does not change the math: equal losses up to float
    noise).

    On this 2-core machine the 4 ranks time-share the cores; read the step times with the load
    averages each run records, and prefer ``--real-repeats`` 3 (see the numbers' spread).

Results (``--real-emulated --real-repeats 2``, defaults; 2 cores shared with other jobs, load
    average 6.5 to 11.5 during the runs; step time = the median of the two runs' means)
    network   policy         step s  imbalance  experts moved  final loss
    loopback  static         0.269   1.592       0             2.5648558
    loopback  greedy         0.279   1.546      44             2.5648558
    loopback  reinforcement  0.295   1.645       6             2.5648557
    100mbit   static         0.353   1.592       0             2.5648558
    100mbit   greedy         0.444   1.546      44             2.5648558
    100mbit   reinforcement  0.426   1.634       6             2.5648557
    Losses agree to 4.2e-7 at every step; 12 decisions per adaptive run, no null reward. The
    same policy's two runs differ by up to 40% (static on loopback: 0.240 and 0.299 s): the
    step-time differences between policies are within the machine's noise. What the balancers
    measured says why placement cannot matter much here: per step, the wait on the slowest
    expert rank was 8-14 ms against 150-180 ms of all-to-all (this model's experts are tiny
    next to the per-message cost of gloo), and the hottest expert takes up to 3.6x the mean
    share, more than a rank's 1/4, which no placement balances. Greedy migrates 44 experts
    anyway (55 ms per step on average at 100 Mbit/s); the learned policy moved 6, and its
    mean imbalance ended above static's (1.64 against 1.59): a gain this small is below what
    its scores can tell apart in 12 decisions.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

POLICIES = ("static", "greedy", "reinforcement")
BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent


def add_real_args(p: argparse.ArgumentParser) -> None:
    real = p.add_argument_group("real model (section 2)")
    real.add_argument("--real-emulated", action="store_true",
                      help="also on 2 emulated nodes at --real-rate (root)")
    real.add_argument("--real-rate", default="100mbit", help="emulated link rate")
    real.add_argument("--real-steps", type=int, default=120, help="training steps per run")
    real.add_argument("--real-warmup", type=int, default=20,
                      help="first steps left out of the means")
    real.add_argument("--real-repeats", type=int, default=1, help="interleaved trios")
    real.add_argument("--real-ep", type=int, default=4, help="expert ranks = processes")
    real.add_argument("--real-ffn", type=int, default=2048, help="model.ffn_hidden_size")
    real.add_argument("--real-micro-batch", type=int, default=2,
                      help="sequences per rank and step")
    real.add_argument("--real-interval", type=int, default=10,
                      help="controllers.compute.balance_interval")
    real.add_argument("--real-seed", type=int, default=1234, help="training.seed")
    real.add_argument("--real-set", action="append", default=[], metavar="KEY=VALUE",
                      help="extra config override of every run")
    real.add_argument("--real-dir", help="keep the run directories here")
    real.add_argument("--real-timeout", type=float, default=1800, help="seconds per run")


def real_settings(args: argparse.Namespace, policy: str) -> list[str]:
    """The config overrides of one run (the same for every policy but the last)."""
    return [
        "model.kind=moe", "model.num_experts=8", "model.top_k=2", "model.num_layers=2",
        "model.hidden_size=64", "model.num_heads=4", "model.seq_len=64",
        f"model.ffn_hidden_size={args.real_ffn}",
        "model.router_bias_update_rate=0", "model.aux_loss_coef=0",
        f"parallelism.data={args.real_ep}", f"parallelism.experts={args.real_ep}",
        f"optimization.micro_batch_size={args.real_micro_batch}",
        f"controllers.compute.balance_interval={args.real_interval}",
        f"training.seed={args.real_seed}", "training.eval_interval=0",
        "training.eval_batches=1", "training.progress=false",
        *args.real_set,
        f"controllers.compute.scheduler={policy}",
    ]


def _train_loopback(args: argparse.Namespace, policy: str, run_dir: Path) -> None:
    cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", str(args.real_ep),
           "--run-dir", str(run_dir), "--steps", str(args.real_steps)]
    for item in real_settings(args, policy):
        cmd += ["--set", item]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.real_timeout,
                          cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"mcpar train ({policy}) exited {proc.returncode}:\n"
                           + (proc.stdout + proc.stderr)[-3000:])


def _train_emulated(args: argparse.Namespace, policy: str, run_dir: Path) -> None:
    from netcluster import NetCluster
    from netcluster.torchrun import launch_torchrun
    argv = [str(BENCH / "emulated_cluster.py"), "_mcpar", "train", "--run-dir", str(run_dir),
            "--steps", str(args.real_steps)]
    for item in real_settings(args, policy):
        argv += ["--set", item]
    with NetCluster(2, rate=args.real_rate) as cluster:
        run = launch_torchrun(cluster, args.real_ep // 2, argv, timeout_s=args.real_timeout,
                              cwd=str(REPO))
    if not run.ok:
        raise RuntimeError(f"emulated mcpar train ({policy}) failed: "
                           + " | ".join(run.output)[-3000:])


def run_real(args: argparse.Namespace, policy: str, run_dir: Path, network: str) -> list[dict]:
    """Train once with `policy` on `network`; the records of its metrics.jsonl."""
    (_train_emulated if network != "loopback" else _train_loopback)(args, policy, run_dir)
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    if len(records) != args.real_steps or any("moe" not in r for r in records):
        raise RuntimeError(f"{run_dir}: expected {args.real_steps} step records with MoE "
                           f"metrics, got {len(records)}")
    return records


def summarize_run(args: argparse.Namespace, records: list[dict], run_dir: Path, wall_s: float,
                  load: list[float]) -> dict:
    kept = records[args.real_warmup:]
    times = np.array([r["step_time_s"] for r in kept])
    out = {
        "mean_step_time_s": float(times.mean()),
        "median_step_time_s": float(np.median(times)),
        "mean_imbalance": float(np.mean([r["moe"]["imbalance"] for r in kept])),
        "mean_comm_time_s": float(np.mean([r["comm_time_s"] for r in kept])),
        "experts_migrated": int(records[-1]["moe"]["migrations_total"]),
        "final_loss": float(records[-1]["loss"]),
        "wall_s": round(wall_s, 1), "load_avg_1m": load,
    }
    measured = [r["moe"]["step_costs"] for r in kept if "step_costs" in r["moe"]]
    if measured:
        out["mean_measured_costs_s"] = {
            key: float(np.mean([m[key] for m in measured]))
            for key in ("load_wait_s", "all_to_all_s", "migration_s")}
    log = run_dir / "load_balance.jsonl"
    if log.exists():
        decisions = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        out["decisions"] = len(decisions)
        out["null_rewards"] = sum(d.get("reward") is None for d in decisions)
    return out


def network_section(args: argparse.Namespace, network: str, root: Path) -> dict:
    runs: dict[str, list[dict]] = {policy: [] for policy in POLICIES}
    losses: list[np.ndarray] = []
    for repeat in range(args.real_repeats):  # interleaved: static, greedy, rl, static, ...
        for policy in POLICIES:
            run_dir = root / f"{network}-{policy}-{repeat}"
            t0, load = time.perf_counter(), os.getloadavg()[0]
            records = run_real(args, policy, run_dir, network)
            runs[policy].append(summarize_run(args, records, run_dir,
                                              time.perf_counter() - t0,
                                              [load, os.getloadavg()[0]]))
            losses.append(np.array([float(r["loss"]) for r in records]))
            print(f"real {network} {policy} #{repeat}: {runs[policy][-1]}", file=sys.stderr)
    policies = {}
    for policy in POLICIES:
        policies[policy] = dict(runs[policy][0])
        for key in ("mean_step_time_s", "median_step_time_s", "mean_imbalance"):
            policies[policy][key] = float(np.median([run[key] for run in runs[policy]]))
        if args.real_repeats > 1:
            policies[policy]["runs"] = runs[policy]
    step = {policy: policies[policy]["mean_step_time_s"] for policy in POLICIES}
    return {
        "policies": policies,
        "static_over_greedy_step_time": step["static"] / step["greedy"],
        "static_over_reinforcement_step_time": step["static"] / step["reinforcement"],
        "greedy_over_reinforcement_step_time": step["greedy"] / step["reinforcement"],
        "max_abs_loss_diff": max(float(np.abs(run - losses[0]).max()) for run in losses),
    }


def real_model_section(args: argparse.Namespace) -> dict:
    keep = args.real_dir is not None
    if keep:
        Path(args.real_dir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="moe_balance_real_", dir=args.real_dir)).resolve()
    start = time.perf_counter()
    out: dict = {"config": {"nproc": args.real_ep, "steps": args.real_steps,
                            "warmup_steps_skipped": args.real_warmup,
                            "repeats": args.real_repeats,
                            "settings": real_settings(args, "<policy>")}}
    try:
        out["loopback"] = network_section(args, "loopback", root)
        if args.real_emulated:
            try:
                out[args.real_rate] = network_section(args, args.real_rate, root)
            except Exception as err:  # noqa: BLE001 - the loopback figures stand on their own
                out[args.real_rate] = {"error": str(err)[-2000:]}
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out
