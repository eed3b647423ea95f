"""The profiler's figures against the wire: a 2-node job over an emulated 100 Mbit/s link.

Why
    The report's communication share and bus bandwidth are only worth reading if they are
    true. This runs one data-parallel job (mcpar's default GPT, one sequence per rank, flat
    all-reduce, 1 rank per node) twice with ``training.profile`` on: over the shaped link
    between two network namespaces, and with both ranks in one unshaped namespace
    (loopback), through ``emulated_cluster.py``'s machinery (torchrun per node, static
    rendezvous). Two independent checks:

    1. share: the report's exposed-communication share of the shaped job against
       ``1 - T_loopback / T_shaped`` (the step time the link adds, over the step time), from
       the two jobs' step times in metrics.jsonl; target: within 5 points.
    2. busbw: the report's bus bandwidth of the inter-node all-reduce (axis 'dp') against the
       link's rate (100 Mbit/s = 12.5 MB/s); target: within 15%.

How to run (root: network namespaces)
    python bench/profile_emulated.py [--repeats 6] [--steps 30] [--loopback-steps 150]
        [--out bench/data/profile_emulated.json]

    Prints the JSON on stdout and writes it to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import emulated_cluster as ec
from bench_workers import emit_result

import netcluster

RATE_BYTES_PER_S = {"100mbit": 12.5e6}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--steps", type=int, default=30, help="steps of the shaped job")
    p.add_argument("--loopback-steps", type=int, default=150,
                   help="steps of the loopback job (its steps are shorter)")
    p.add_argument("--first", type=int, default=5, help="first profiled (and measured) step")
    p.add_argument("--out", default=None)
    p.add_argument("--keep-runs", default=None, help="keep the run directories here")
    return p.parse_args(argv)


def run_pair(args: argparse.Namespace, workdir: Path, repeat: int) -> dict[str, Any]:
    def variant_args(steps: int) -> argparse.Namespace:
        return ec.parse_args([
            "--variants", "mcpar_flat,loopback_flat", "--steps", str(steps),
            "--warmup", str(args.first - 1), "--compress-start", "1", "--timeout", "400",
            "--mcpar-set", "training.profile.enabled=true",
            "--mcpar-set", f"training.profile.start_step={args.first}",
            "--mcpar-set", f"training.profile.steps={steps - args.first + 1}",
            "--mcpar-set", "training.profile.trace=false"])

    # The loopback job's steps are ~8x shorter: it runs more of them, so that a stall of the
    # shared machine weighs on its mean as little as on the shaped job's.
    ec_args = {"mcpar_flat": variant_args(args.steps),
               "loopback_flat": variant_args(args.loopback_steps)}
    variants = ec.build_variants(ec_args["mcpar_flat"])
    out: dict[str, Any] = {}
    for name in ("mcpar_flat", "loopback_flat"):
        res = ec.run_variant(variants[name], ec_args[name], workdir, repeat)
        if not res.get("ok"):
            raise SystemExit(f"{name} failed: {res.get('error')}")
        report = json.loads((workdir / f"{name}-{repeat}" / "profile" / "report.json")
                            .read_text())["report"]
        dp = next(c for c in report["collectives"]
                  if c["op"] == "all_reduce" and c["axis"] == "dp")
        out[name] = {"step_time_s_mean": res["step_time_s_mean"],
                     "measured_steps": res["measured_steps"],
                     "report_comm_share": report["comm_share"],
                     "report_step_s": report["throughput"]["step_s"],
                     "split": report["split"], "dp_all_reduce": dp,
                     "link": res.get("link"), "loadavg_1m": res.get("loadavg_1m_after"),
                     "link_health": res.get("link_health"), "elapsed_s": res.get("elapsed_s")}
    shaped, loop = out["mcpar_flat"], out["loopback_flat"]
    independent = 1 - loop["step_time_s_mean"] / shaped["step_time_s_mean"]
    busbw = shaped["dp_all_reduce"]["busbw"]
    return {**out, "independent_share": independent,
            "share_diff_points": 100 * (shaped["report_comm_share"] - independent),
            "busbw_bytes_per_s": busbw, "link_bytes_per_s": RATE_BYTES_PER_S["100mbit"],
            "busbw_vs_link": busbw / RATE_BYTES_PER_S["100mbit"]}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    ok, why = netcluster.available()
    if not ok:
        print(f"profile_emulated: cannot build the emulated cluster: {why}", file=sys.stderr)
        return 2
    runs = []
    if args.keep_runs:
        Path(args.keep_runs).mkdir(parents=True, exist_ok=True)
    workdir = (contextlib.nullcontext(tempfile.mkdtemp(prefix="profile-emulated-",
                                                      dir=args.keep_runs))
               if args.keep_runs else tempfile.TemporaryDirectory(prefix="profile-emulated-"))
    with workdir as tmp:
        for repeat in range(args.repeats):
            runs.append(run_pair(args, Path(tmp), repeat))
            r = runs[-1]
            share = r["mcpar_flat"]["report_comm_share"]
            print(f"profile_emulated: repeat {repeat}: share {share:.3f}"
                  f" vs independent {r['independent_share']:.3f}; busbw "
                  f"{r['busbw_bytes_per_s'] / 1e6:.2f} MB/s", file=sys.stderr, flush=True)
    result = {
        "benchmark": "profile_emulated", "rate": "100mbit", "steps": args.steps,
        "profiled_steps": [args.first, args.steps], "loopback_steps": args.loopback_steps,
        "runs": runs,
        "median_share_diff_points": statistics.median(r["share_diff_points"] for r in runs),
        "median_busbw_vs_link": statistics.median(r["busbw_vs_link"] for r in runs),
        "pairs_share_within_5_points": sum(abs(r["share_diff_points"]) <= 5 for r in runs),
        "pairs_busbw_within_15_percent": sum(abs(r["busbw_vs_link"] - 1) <= 0.15 for r in runs),
        "targets": {"share_diff_points": "|.| <= 5", "busbw_vs_link": "0.85 .. 1.15"},
    }
    emit_result(result, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
