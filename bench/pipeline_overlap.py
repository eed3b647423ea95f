"""Pipeline + data parallelism: the gradient reduction hidden behind the schedule, measured.

What it measures
    ``mcpar train`` on data 2 x pipeline 2 (4 worker processes, gloo), twice on the same
    config: with ``controllers.communication.overlap: true`` the ComputeController arms each
    stage's gradient buckets right before that stage's last backward, so each bucket's
    data-parallel all-reduce starts as soon as it is full, during that backward; with ``false``
    every reduction starts after the schedule has drained (what every pipeline step did before
    the step became a task list). Per run: the median over the timed steps of
    ``exposed_comm_s`` (the step's WAIT_GRADS task: waiting for reductions after the compute,
    from ``metrics.jsonl``) and of ``step_time_s``. The runs alternate ``--rounds`` times.

Output
    One JSON object: per variant the medians, and the ratios overlap / no-overlap of the
    exposed communication and of the step time. Both runs must reach identical losses (the
    overlap changes when the reduction runs, not what it computes); the bench says so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed first steps")
    p.add_argument("--rounds", type=int, default=2, help="alternating runs of each variant")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--micro", type=int, default=4, help="micro-batches per step")
    p.add_argument("--bucket-mb", type=float, default=1.0, help="gradient bucket size")
    args = p.parse_args(argv)
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    return args


def run(args: argparse.Namespace, overlap: bool, run_dir: Path) -> list[dict]:
    settings = [
        f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
        "model.num_heads=4", "model.seq_len=64", "parallelism.pipeline=2",
        "optimization.micro_batch_size=4", f"optimization.gradient_accumulation={args.micro}",
        f"controllers.communication.bucket_size_mb={args.bucket_mb}",
        f"controllers.communication.overlap={str(overlap).lower()}",
        "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
        f"training.steps={args.steps}",
    ]
    cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", "4", "--run-dir",
           str(run_dir)]
    for item in settings:
        cmd += ["--set", item]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"pipeline_overlap: run failed:\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"exposed_comm_s": [], "step_time_s": []} for name in ("overlap", "no_overlap")}
    losses: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="mcpar-overlap-") as tmp:
        for round_index in range(args.rounds):
            for name in ("overlap", "no_overlap"):
                records = run(args, name == "overlap", Path(tmp) / f"{name}-{round_index}")
                losses[name] = [r["loss"] for r in records]
                for record in records[args.warmup:]:
                    for key in samples[name]:
                        samples[name][key].append(record[key])
                print(f"pipeline_overlap: round {round_index + 1}/{args.rounds} {name} done",
                      file=sys.stderr, flush=True)
    medians = {name: {key: statistics.median(values) for key, values in figures.items()}
               for name, figures in samples.items()}
    on, off = medians["overlap"], medians["no_overlap"]
    same = losses["overlap"] == losses["no_overlap"]
    if not same:
        print("pipeline_overlap: WARNING: the two variants' losses differ", file=sys.stderr)
    print(json.dumps({
        "layout": "data 2 x pipeline 2, 1f1b", "steps_timed": args.steps - args.warmup,
        "rounds": args.rounds, "medians": medians,
        "exposed_comm_ratio": on["exposed_comm_s"] / off["exposed_comm_s"]
        if off["exposed_comm_s"] > 0 else None,
        "step_time_ratio": on["step_time_s"] / off["step_time_s"],
        "losses_identical": same,
    }, indent=2))


if __name__ == "__main__":
    main()
