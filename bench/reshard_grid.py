"""Resume on any layout: a grid of checkpoint layout pairs A -> B, each checked bit for bit.

What it measures
    For every pair A -> B of the grid (``PAIRS``, 17 pairs), through the real CLI
    (``python -m mcpar.cli``, subprocesses, as users run it) on a tiny model:

    1. A trains ``K`` (4) steps on its layout, with a checkpoint at step K. (A chained pair's A
       is an earlier pair's B run: its step-K checkpoint, e.g. the experts-1 copy of an
       experts-2 state the balancer had moved, goes on to experts 2.)
    2. B starts on its own layout with ``optimization.checkpoint.load_from=<A's run dir>``: it
       reshards A's state onto B's layout (recovery.jsonl's ``load`` event names
       ``resharded_from``, ``resharded_to`` and the state that ``restarted``), saves what it
       loaded at once as its own step-K checkpoint, and trains to step K + 10.
    3. ``mcpar checkpoint verify A --step K --against B --against-step K``: the layout-free
       hash of A's and of B's step-K checkpoints (parameters, optimizer state, step, data
       position); they must be equal ('verify: identical').
    4. B again, in a fresh run directory, loads B's own step-K checkpoint (same layout: no
       reshard) and trains the same steps K+1 .. K+10. The resharded B's losses at these 10
       steps (the first of them included) must equal the own-state B's to 1e-6.

    A pair passes when every run exits 0, B resharded whenever A's and B's checkpoints record
    different layouts (``meta.json``'s degrees, world size and ZeRO stage; offload and the
    parameter store change none of them, so B loads those pieces as they are and the load
    event rightly names no reshard), the hashes are equal, and the largest |loss difference|
    over the 10 steps is at most 1e-6. Per pair the JSON holds the two layouts (workers and
    settings), both saved layouts, the load event's layouts and restarted state, both hashes,
    the verify output when they differ, both loss series, the wall seconds, and on a failure
    what failed with the tail of its stderr (the later stages still run where they can). A
    pair that fails is reported, not hidden: the script exits 0 and ``all_pass`` says whether
    every pair passed.

    The grid: dense data 2, tensor 2, pipeline 2 and one process in a cycle (the global batch
    kept at 8 sequences by gradient accumulation); ZeRO stage 0 -> 1 -> 3 -> 0 (data 2); ZeRO-3
    with the hierarchical parameter store (controllers.memory.allocation: topology_aware, two
    emulated nodes of 2 ranks) <-> plain ZeRO-3 (data 4); NVMe offload <-> none; MoE experts
    2 -> 1 -> 2 and 2 -> 4 -> 2 after the greedy balancer moved experts (modeled costs, so its
    decisions repeat on a resume); 1-bit Adam past its freeze step, data 4 -> data 2; Llama
    tensor 2 x pipeline 2 -> data 4.

How to run
    PYTHONPATH=src python bench/reshard_grid.py [--pairs NAME,...] [--out PATH] [--work DIR]

    The whole grid takes about 10 minutes on 2 CPU cores (up to 4 worker processes per run,
    one at a time). It prints one JSON object on stdout and writes it to ``--out`` (default
    bench/data/reshard_grid.json); one progress line per pair goes to stderr. ``--work`` keeps
    the run directories (default: a temporary directory, deleted at the end).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
K = 4  # A's steps; the checkpoint every pair reshards is the one at step K
MORE = 10  # steps B trains after loading, compared with the own-state B
TOLERANCE = 1e-6
RUN_TIMEOUT_S = 600

# A 20-step multi-process run of this model takes seconds on 2 cores (tests/conftest.py TINY).
TINY = [
    "model.num_layers=2", "model.hidden_size=32", "model.num_heads=2", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5",
]
# Dense GPT: 8 sequences per step on every layout (micro-batch 4 x accumulation x data).
DENSE = [*TINY, "optimization.micro_batch_size=4"]
DATA2 = [*DENSE, "parallelism.data=2", "optimization.gradient_accumulation=1"]
DATA4 = [*TINY, "parallelism.data=4", "optimization.micro_batch_size=2",
         "optimization.gradient_accumulation=1"]
# ZeRO-3 on two emulated nodes of 2 ranks, one block per gather (tests/test_zero3.py): the
# store keeps a node-local copy of each gathered layer for the backward pass.
ZERO3_NODES = [*DATA4, "controllers.memory.zero_stage=3", "controllers.memory.gather_mb=0",
               "cluster.ranks_per_node=2"]
NVME = ["controllers.memory.offload=nvme", "controllers.memory.offload_buffer_mb=0.01"]
ONEBIT = ["optimization.optimizer=onebit_adam", f"optimization.freeze_step={K // 2}"]
MOE = [
    "model.kind=moe", "model.num_experts=4", "model.top_k=2", "model.shared_expert=true",
    "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5", "optimization.global_batch_size=8",
]
GREEDY = ["controllers.compute.scheduler=greedy", "controllers.compute.balance_interval=2",
          "controllers.compute.balance_costs=modeled"]
LLAMA = [
    "model.kind=llama", "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4",
    "model.num_kv_heads=2", "model.ffn_hidden_size=64", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5", "optimization.global_batch_size=8",
    "optimization.micro_batch_size=2",
]


@dataclass(frozen=True)
class Layout:
    """Workers and every setting of one run's layout (the model and batch included)."""

    nproc: int
    settings: tuple[str, ...]


def _layout(nproc: int, *settings: str) -> Layout:
    return Layout(nproc, tuple(settings))


LAYOUTS: dict[str, Layout] = {
    "data2": _layout(2, *DATA2),
    "tensor2": _layout(2, *DENSE, "parallelism.tensor=2", "optimization.gradient_accumulation=2"),
    "pipeline2": _layout(2, *DENSE, "parallelism.pipeline=2",
                         "optimization.gradient_accumulation=2"),
    "single": _layout(1, *DENSE, "optimization.gradient_accumulation=2"),
    "zero0": _layout(2, *DATA2, "controllers.memory.zero_stage=0"),
    "zero1": _layout(2, *DATA2, "controllers.memory.zero_stage=1"),
    "zero3": _layout(2, *DATA2, "controllers.memory.zero_stage=3"),
    "zero3_store": _layout(4, *ZERO3_NODES, "controllers.memory.allocation=topology_aware"),
    "zero3_plain": _layout(4, *ZERO3_NODES, "controllers.memory.allocation=default"),
    "offload_nvme": _layout(2, *DATA2, *NVME),
    "offload_none": _layout(2, *DATA2, "controllers.memory.offload=none"),
    "moe_experts1": _layout(1, *MOE, "optimization.micro_batch_size=8"),
    "moe_experts2": _layout(2, *MOE, "parallelism.experts=2", "optimization.micro_batch_size=4",
                            *GREEDY),
    "moe_experts4": _layout(4, *MOE, "parallelism.experts=4", "optimization.micro_batch_size=2",
                            *GREEDY),
    "onebit_data4": _layout(4, *DATA4, *ONEBIT),
    "onebit_data2": _layout(2, *DATA2, *ONEBIT),
    "llama_tensor2_pipeline2": _layout(4, *LLAMA, "parallelism.tensor=2",
                                       "parallelism.pipeline=2"),
    "llama_data4": _layout(4, *LLAMA, "parallelism.data=4"),
}


@dataclass(frozen=True)
class Pair:
    """Layout A's step-K state resumed on layout B; ``chained``: A's run is that pair's B."""

    a: str
    b: str
    chained: str | None = None


PAIRS: dict[str, Pair] = {
    "data2_to_tensor2": Pair("data2", "tensor2"),
    "tensor2_to_pipeline2": Pair("tensor2", "pipeline2"),
    "pipeline2_to_single": Pair("pipeline2", "single"),
    "single_to_data2": Pair("single", "data2"),
    "zero0_to_zero1": Pair("zero0", "zero1"),
    "zero1_to_zero3": Pair("zero1", "zero3"),
    "zero3_to_zero0": Pair("zero3", "zero0"),
    "zero3_store_to_plain": Pair("zero3_store", "zero3_plain"),
    "zero3_plain_to_store": Pair("zero3_plain", "zero3_store"),
    "nvme_to_none": Pair("offload_nvme", "offload_none"),
    "none_to_nvme": Pair("offload_none", "offload_nvme"),
    "moe_experts2_to_1": Pair("moe_experts2", "moe_experts1"),
    "moe_experts1_to_2": Pair("moe_experts1", "moe_experts2", chained="moe_experts2_to_1"),
    "moe_experts2_to_4": Pair("moe_experts2", "moe_experts4"),
    "moe_experts4_to_2": Pair("moe_experts4", "moe_experts2", chained="moe_experts2_to_4"),
    "onebit_data4_to_data2": Pair("onebit_data4", "onebit_data2"),
    "llama_tensor2_pipeline2_to_data4": Pair("llama_tensor2_pipeline2", "llama_data4"),
}


class StageFailed(Exception):
    """A run or the verify of a pair failed: which stage, and the tail of its output."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"{stage}: {detail}")
        self.stage = stage
        self.detail = detail


def _env() -> dict[str, str]:
    """This checkout's package first on the path, so the CLI run is the code benchmarked."""
    path = os.environ.get("PYTHONPATH", "")
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "src"), path) if p))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mcpar.cli", *args], capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S, cwd=REPO, env=_env())


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 12) -> str:
    """The lines of stderr (stdout when stderr is empty) that say why a command failed: the
    error lines and a traceback's last lines, not the start-up log."""
    text = proc.stderr.strip() or proc.stdout.strip()
    kept = [line for line in text.splitlines() if not line.startswith("mcpar: recovery: ")
            and not line.startswith("mcpar: starting ") and not line.startswith("mcpar: device ")]
    return "\n".join(kept[-lines:])


def _train(stage: str, layout: Layout, run_dir: Path, *extra: str) -> None:
    args = ["train", "--nproc", str(layout.nproc), "--run-dir", str(run_dir)]
    for item in (*layout.settings, *extra):
        args += ["--set", item]
    proc = _cli(*args)
    if proc.returncode != 0:
        raise StageFailed(stage, f"exit {proc.returncode}\n{_tail(proc)}")


def _losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines if line.strip()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def _load_event(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "recovery.jsonl"
    if not path.exists():
        return None
    events = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return next((e for e in events if e.get("event") == "load"), None)


def _experts_moved(step_dir: Path) -> bool | None:
    """Whether a MoE checkpoint holds an expert out of its initial slot (None: no slots, i.e.
    not MoE or experts 1)."""
    from mcpar.checkpoint.files import load_tensors

    slots = [v.tolist() for k, v in load_tensors(step_dir, "model/").items()
             if k.endswith("expert_of_slot")]
    return any(s != sorted(s) for s in slots) if slots else None


def _verify(a_dir: Path, b_dir: Path) -> dict[str, Any]:
    """``mcpar checkpoint verify A --step K --against B --against-step K``: both digests (the
    first word of each state's first line), identical or not, and the differences listed."""
    proc = _cli("checkpoint", "verify", str(a_dir), "--step", str(K), "--against", str(b_dir),
                "--against-step", str(K))
    if proc.returncode not in (0, 1):
        raise StageFailed("verify", f"exit {proc.returncode}\n{_tail(proc)}")
    heads = [line.split()[0] for line in proc.stdout.splitlines()
             if line and not line.startswith((" ", "mcpar "))]
    if len(heads) != 2:
        raise StageFailed("verify", f"unexpected output:\n{proc.stdout[-2000:]}")
    verdict = [line for line in proc.stdout.splitlines() if line.startswith("mcpar ")]
    out: dict[str, Any] = {"hash_a": heads[0], "hash_b": heads[1],
                           "hash_equal": heads[0] == heads[1],
                           "verify": verdict[0] if verdict else ""}
    if proc.returncode == 1:
        out["verify_differences"] = [line.strip() for line in proc.stdout.splitlines()
                                     if "max |difference|" in line or "more" in line]
    return out


def _saved_layout(run_dir: Path) -> dict[str, int]:
    """The layout a run's step-K checkpoint records (degrees, world size, ZeRO stage)."""
    meta = json.loads((run_dir / "checkpoints" / f"step-{K}" / "meta.json").read_text())
    return {"zero_stage": 0, **meta["layout"]}


def run_pair(name: str, pair: Pair, root: Path, a_runs: dict[Layout, Path],
             b_runs: dict[str, Path]) -> dict[str, Any]:
    """Steps 1-4 of the module docstring for one pair. A stage that fails is recorded with
    the tail of its output; the stages after it still run where they can (a failed verify
    does not stop the loss comparison), so a failure says as much as it can."""
    a, b = LAYOUTS[pair.a], LAYOUTS[pair.b]
    record: dict[str, Any] = {
        "pair": name, "a": pair.a, "b": pair.b,
        "a_layout": {"nproc": a.nproc, "settings": list(a.settings)},
        "b_layout": {"nproc": b.nproc, "settings": list(b.settings)},
        "a_source": f"B run of {pair.chained}" if pair.chained else "fresh A run",
        "hash_equal": None, "max_abs_loss_diff": None,
    }
    failures: list[str] = []
    start = time.perf_counter()
    try:
        if pair.chained is not None:
            if pair.chained not in b_runs:
                raise StageFailed("A", f"the chained pair {pair.chained} has no B run")
            a_dir = b_runs[pair.chained]
        elif a in a_runs:
            a_dir = a_runs[a]  # the same layout trained the same K steps for an earlier pair
        else:
            a_dir = root / f"A-{pair.a}"
            _train("A", a, a_dir, f"training.steps={K}", f"optimization.checkpoint.interval={K}")
            a_runs[a] = a_dir
        record["a_experts_moved"] = _experts_moved(a_dir / "checkpoints" / f"step-{K}")
        # B saves the state it loaded at once (its step-K checkpoint); no other save after.
        b_settings = (f"training.steps={K + MORE}", "optimization.checkpoint.interval=1000")
        b_dir = root / name / "B-resharded"
        _train("B (load_from A)", b, b_dir, *b_settings,
               f"optimization.checkpoint.load_from={a_dir}")
        b_runs[name] = b_dir
        if not (b_dir / "checkpoints" / f"step-{K}").is_dir():
            raise StageFailed("B (load_from A)", f"no step-{K} checkpoint in {b_dir}")
        load = _load_event(b_dir) or {}
        record["saved_layout_a"] = _saved_layout(a_dir)
        record["saved_layout_b"] = _saved_layout(b_dir)
        # Settings that change no degree nor ZeRO stage (offload, the parameter store) save
        # the same pieces: B may load them as they are, without a reshard.
        record["reshard_expected"] = record["saved_layout_a"] != record["saved_layout_b"]
        record["resharded"] = "resharded_from" in load
        record["resharded_from"] = load.get("resharded_from")
        record["resharded_to"] = load.get("resharded_to")
        record["restarted"] = load.get("restarted", [])
        if record["reshard_expected"] and not record["resharded"]:
            failures.append("B loaded A's checkpoint of another layout without a reshard "
                            "(its load event has no resharded_from)")
        try:
            record.update(_verify(a_dir, b_dir))
            if not record["hash_equal"]:
                failures.append("A's and B's step-K hashes differ")
        except StageFailed as exc:
            failures.append(f"{exc.stage}: {exc.detail}")
        own_dir = root / name / "B-own"
        _train("B (own step-K checkpoint)", b, own_dir, *b_settings,
               f"optimization.checkpoint.load_from={b_dir / 'checkpoints' / f'step-{K}'}")
        record["own_load_resharded"] = "resharded_from" in (_load_event(own_dir) or {})
        resharded, own = _losses(b_dir), _losses(own_dir)
        steps = list(range(K + 1, K + MORE + 1))
        record["losses_resharded"] = [resharded.get(s) for s in steps]
        record["losses_own"] = [own.get(s) for s in steps]
        if not all(s in resharded and s in own for s in steps):
            raise StageFailed("losses", f"steps logged: resharded {sorted(resharded)}, "
                              f"own {sorted(own)}; expected {steps}")
        diff = max(abs(resharded[s] - own[s]) for s in steps)
        record["max_abs_loss_diff"] = diff
        record["first_loss_diff"] = abs(resharded[K + 1] - own[K + 1])
        record["first_step_over_tolerance"] = next(
            (s for s in steps if not abs(resharded[s] - own[s]) <= TOLERANCE), None)
        if not diff <= TOLERANCE:
            failures.append(f"max |loss diff| {diff:.3e} > {TOLERANCE:g} (first at step "
                            f"{record['first_step_over_tolerance']})")
    except StageFailed as exc:
        failures.append(f"{exc.stage}: {exc.detail}")
    except subprocess.TimeoutExpired as exc:
        failures.append(f"timed out after {exc.timeout} s: {' '.join(map(str, exc.cmd))[:300]}")
    record["passed"] = not failures
    if failures:
        record["failure"] = "\n".join(failures)
    record["seconds"] = round(time.perf_counter() - start, 1)
    return record


def _selected(names: str | None) -> list[str]:
    """The pairs to run in grid order, each chained pair's source pair added before it."""
    if names is None:
        return list(PAIRS)
    wanted = {n.strip() for n in names.split(",") if n.strip()}
    unknown = sorted(wanted - set(PAIRS))
    if unknown:
        raise SystemExit(f"reshard_grid: --pairs: unknown {', '.join(unknown)}; "
                         f"known: {', '.join(PAIRS)}")
    for name in list(wanted):
        chained = PAIRS[name].chained
        if chained is not None:
            wanted.add(chained)
    return [n for n in PAIRS if n in wanted]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", default=None,
                        help=f"comma-separated subset of: {', '.join(PAIRS)}")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "data" / "reshard_grid.json")
    parser.add_argument("--work", type=Path, default=None,
                        help="keep the run directories here (default: a temporary directory)")
    args = parser.parse_args(argv)
    names = _selected(args.pairs)
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="reshard_grid_") as tmp:
        root = args.work or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        a_runs: dict[Layout, Path] = {}
        b_runs: dict[str, Path] = {}
        results = []
        for i, name in enumerate(names, 1):
            record = run_pair(name, PAIRS[name], root, a_runs, b_runs)
            results.append(record)
            diff = record.get("max_abs_loss_diff")
            print(f"[{i}/{len(names)}] {name}: {'pass' if record['passed'] else 'FAIL'}, "
                  f"hash_equal {record.get('hash_equal')}, max |dloss| "
                  f"{'-' if diff is None else f'{diff:.2e}'}, {record['seconds']} s"
                  + ("" if record["passed"] else f" -- {record['failure'].splitlines()[0]}"),
                  file=sys.stderr, flush=True)
    import torch

    report = {
        "benchmark": "reshard_grid",
        "what": "checkpoint at step K on layout A, resumed on layout B (load_from, resharded): "
                "layout-free hash of A's and B's step-K checkpoints, and B's next losses vs B "
                "resumed from its own step-K checkpoint",
        "k": K, "more_steps": MORE, "loss_tolerance": TOLERANCE,
        "pairs": results,
        "num_pairs": len(results),
        "passed": sum(r["passed"] for r in results),
        "failed": [r["pair"] for r in results if not r["passed"]],
        "all_pass": all(r["passed"] for r in results),
        "total_seconds": round(time.perf_counter() - start, 1),
        "environment": {"python": platform.python_version(), "torch": torch.__version__,
                        "cpu_cores": os.cpu_count(), "platform": platform.platform()},
    }
    text = json.dumps(report, indent=1)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
