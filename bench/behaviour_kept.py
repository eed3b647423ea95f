"""Behaviour kept across a refactor: train a fixed list of layouts and compare their metrics.

    python bench/behaviour_kept.py run OUT_DIR [--only NAME ...]   # one run dir per layout
    python bench/behaviour_kept.py compare BEFORE_DIR AFTER_DIR     # JSON; exit 1 on a change

``compare`` reads ``metrics.jsonl`` of each layout in both folders and requires loss, val_loss
and grad_norm to be equal (``==`` on the JSON floats) at every step, and ``plan.json``'s memory
placement to be the same (placement to a budget must choose the same plan). Run ``run`` on the
commit before the change and on the one after, on the same machine and torch.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

STEPS = 12
COMMON = [
    "model.num_layers=4", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=6", "training.eval_batches=1",
    "optimization.warmup_steps=3", "optimization.checkpoint.interval=0",
]
# name: (workers, overrides on the built-in default)
LAYOUTS: dict[str, tuple[int, list[str]]] = {
    "default": (2, []),
    "dp2_pp2_1f1b": (4, ["parallelism.data=2", "parallelism.pipeline=2",
                         "parallelism.schedule=1f1b", "optimization.gradient_accumulation=2"]),
    "tp2_pp2_sp": (4, ["parallelism.tensor=2", "parallelism.pipeline=2",
                       "parallelism.sequence_parallel=true",
                       "optimization.gradient_accumulation=2"]),
    "interleaved": (2, ["parallelism.pipeline=2", "parallelism.virtual_stages=2",
                        "parallelism.schedule=interleaved_1f1b",
                        "optimization.gradient_accumulation=2"]),
    "moe_ep2": (2, ["model.kind=moe", "model.num_experts=4", "model.top_k=2",
                    "parallelism.data=2", "parallelism.experts=2"]),
    "onebit": (2, ["optimization.optimizer=onebit_adam", "optimization.freeze_step=4"]),
    "powersgd": (2, ["controllers.communication.compression=powersgd",
                     "controllers.communication.powersgd_start_step=4"]),
    "hier_2x2": (4, ["parallelism.data=4", "controllers.communication.topology=hierarchical",
                     "cluster.ranks_per_node=2"]),
    "zero1": (2, ["controllers.memory.zero_stage=1"]),
    "zero2": (2, ["controllers.memory.zero_stage=2"]),
    "zero3": (2, ["controllers.memory.zero_stage=3"]),
    "zero3_store": (4, ["parallelism.data=4", "controllers.memory.zero_stage=3",
                        "controllers.memory.allocation=topology_aware",
                        "cluster.ranks_per_node=2"]),
    "nvme": (2, ["controllers.memory.offload=nvme", "controllers.memory.offload_buffer_mb=0.01"]),
    "recompute_full": (2, ["controllers.memory.activation_checkpointing=full"]),
    "llama_tp2": (2, ["model.kind=llama", "model.num_heads=4", "model.num_kv_heads=2",
                      "parallelism.tensor=2"]),
    "budget": (2, ["controllers.memory.memory_budget_gb=0.01",
                   "controllers.memory.offload_buffer_mb=0.01"]),
}
COMPARED = ("loss", "val_loss", "grad_norm")


def run(out: Path, only: list[str]) -> dict[str, object]:
    results: dict[str, object] = {}
    for name, (nproc, sets) in LAYOUTS.items():
        if only and name not in only:
            continue
        run_dir = out / name
        cmd = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", str(nproc),
               "--steps", str(STEPS), "--run-dir", str(run_dir)]
        for s in COMMON + sets:
            cmd += ["--set", s]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        results[name] = {"rc": proc.returncode}
        if proc.returncode:
            results[name] = {"rc": proc.returncode, "tail": proc.stderr[-800:]}
        print(json.dumps({name: results[name]}), flush=True)
    return results


def _rows(run_dir: Path) -> list[dict[str, object]]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [{k: r.get(k) for k in ("step", *COMPARED)} for r in map(json.loads, lines)]


def _placement(run_dir: Path) -> object:
    plan = json.loads((run_dir / "plan.json").read_text())
    chosen = plan.get("memory_plan", {}).get("chosen")
    if chosen is None and "memory" in plan and isinstance(plan["memory"], dict):
        chosen = plan["memory"].get("placement", {}).get("chosen")
    return chosen


def compare(before: Path, after: Path) -> dict[str, object]:
    report: dict[str, object] = {}
    for name in LAYOUTS:
        a, b = before / name, after / name
        if not (a / "metrics.jsonl").exists() or not (b / "metrics.jsonl").exists():
            report[name] = "missing"
            continue
        rows_a, rows_b = _rows(a), _rows(b)
        same = rows_a == rows_b and _placement(a) == _placement(b)
        report[name] = {"steps": len(rows_a), "equal": same,
                        **({} if same else {"before": rows_a[-1], "after": rows_b[-1]})}
    return report


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("out", type=Path)
    r.add_argument("--only", nargs="*", default=[])
    c = sub.add_parser("compare")
    c.add_argument("before", type=Path)
    c.add_argument("after", type=Path)
    args = ap.parse_args()
    if args.cmd == "run":
        res = run(args.out, args.only)
        print(json.dumps(res, indent=1))
        return 0 if all(v["rc"] == 0 for v in res.values()) else 1  # type: ignore[index]
    report = compare(args.before, args.after)
    print(json.dumps(report, indent=1))
    return 0 if all(isinstance(v, dict) and v["equal"] for v in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
