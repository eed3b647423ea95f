"""Host memory of a resume on another layout: the streaming reshard against the whole model.

What it measures
    A GPT whose training state is several times one rank's share is trained one step at layout
    A (world 4) and checkpointed; a run at layout B (world 4, its own sharding) starts from that
    checkpoint (``optimization.checkpoint.load_from``), which reshards it. The load's record in
    ``recovery.jsonl`` holds ``host_peak_mb``: rank 0's resident memory at its peak while it
    read the checkpoint, above what it held when the reading began (its own parameters and
    AdamW moments, which it holds anyway, made before; the kernel's high-water mark, reset for
    the reading: ``mcpar.device.host_peak_rss``). It is compared with the whole model's
    training state (parameters and AdamW's two moments, 12 bytes per parameter) and with its
    parameters alone (4 bytes each), and rank 0's share of the new layout is stated.

    The peer in the same run: reading the same checkpoint back whole, as ``mcpar checkpoint
    verify`` does and as the reshard did before it streamed (every saved piece, then the full
    parameters and moments): ``canonical_state`` measured the same way in this process.

How to run
    python bench/reshard_memory.py [--layers 8] [--hidden 512] [--pairs A:B,...] [--out PATH]
    Layouts: data4, pipeline4, tensor4, tensor2_pipeline2, pipeline2_data2. Prints one JSON
    object; ``--out`` also writes it (bench/data/reshard_memory.json).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
LAYOUTS = {
    "data4": ["optimization.micro_batch_size=1"],
    "pipeline4": ["parallelism.pipeline=4", "optimization.gradient_accumulation=4",
                  "optimization.micro_batch_size=1"],
    "tensor4": ["parallelism.tensor=4", "optimization.gradient_accumulation=4",
                "optimization.micro_batch_size=1"],
    "tensor2_pipeline2": ["parallelism.tensor=2", "parallelism.pipeline=2",
                          "optimization.gradient_accumulation=4",
                          "optimization.micro_batch_size=1"],
    "pipeline2_data2": ["parallelism.pipeline=2", "optimization.gradient_accumulation=2",
                        "optimization.micro_batch_size=1"],
}
DEFAULT_PAIRS = "pipeline4:tensor2_pipeline2,tensor2_pipeline2:pipeline4,tensor4:pipeline4"


def _train(run: Path, layout: str, model: list[str], steps: int,
           load_from: Path | None = None) -> None:
    settings = [*model, *LAYOUTS[layout], f"training.steps={steps}",
                "optimization.checkpoint.interval=1", "optimization.checkpoint.async_save=false",
                "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
                "optimization.global_batch_size=4",
                *([f"optimization.checkpoint.load_from={load_from}"] if load_from else [])]
    args = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", "4", "--run-dir", str(run)]
    for setting in settings:
        args += ["--set", setting]
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"mcpar train ({layout}) failed:\n{proc.stderr[-3000:]}")


def _load_record(run: Path) -> dict:
    for line in (run / "recovery.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record.get("event") == "load":
            return record
    raise SystemExit(f"{run}: no load record")


def _sizes(run: Path, layout: dict) -> tuple[int, int]:
    """(parameters of the whole model, parameters of rank 0's share under ``layout``)."""
    from mcpar.checkpoint.saved_state import layout_maps
    from mcpar.config import load_config
    from mcpar.models.spec import get_model_spec

    cfg = load_config(run / "config.yaml").model
    with torch.device("meta"):
        total = sum(p.numel() for p in get_model_spec(cfg.kind).build(cfg, 0).parameters())
    share = sum(c.numel() for c in layout_maps(cfg, {"virtual_stages": 1, **layout},
                                               (0, 0, 0), cache=False).values())
    return total, share


def _whole_read_peak(run: Path) -> float:
    """MiB the whole-state reader (checkpoint verify) holds at its peak, in this process."""
    from mcpar.device import host_peak_rss
    from mcpar.interop.canonical_state import canonical_state

    with host_peak_rss() as peak:
        state = canonical_state(run)
        del state
    if peak.bytes is None:
        raise SystemExit("this host cannot reset its resident high-water mark (not Linux)")
    return peak.bytes / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--pairs", default=DEFAULT_PAIRS)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "src"))
    model = [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
             f"model.num_heads={args.heads}", "model.seq_len=64"]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for pair in args.pairs.split(","):
            old, new = pair.split(":")
            start = time.perf_counter()
            a, b = Path(tmp) / f"{pair}-a", Path(tmp) / f"{pair}-b"
            _train(a, old, model, 1)
            _train(b, new, model, 2, load_from=a)
            load = _load_record(b)
            total, share = _sizes(b, load["resharded_to"])
            peak = load.get("host_peak_mb")
            whole = _whole_read_peak(a)
            mib = 2**20
            row = {
                "from": old, "to": new, "parameters": total, "rank0_share": share,
                "state_over_share": round(total / share, 2),
                "whole_params_mb": round(4 * total / mib, 1),
                "whole_state_mb": round(12 * total / mib, 1),
                "reshard_peak_mb": peak,
                "peak_over_whole_params": None if peak is None
                else round(peak / (4 * total / mib), 3),
                "peak_over_whole_state": None if peak is None
                else round(peak / (12 * total / mib), 3),
                "whole_read_peak_mb": round(whole, 1),
                "whole_read_over_reshard": None if not peak else round(whole / peak, 2),
                "seconds": round(time.perf_counter() - start, 1),
            }
            rows.append(row)
            print(f"{pair}: reshard peak {peak} MiB, whole params {row['whole_params_mb']} MiB,"
                  f" whole read {row['whole_read_peak_mb']} MiB", file=sys.stderr)
    def below(key: str) -> bool:
        return all(r[key] is not None and r[key] < 1 for r in rows)
    result = {"bench": "reshard_memory", "model": model, "world": 4, "pairs": rows,
              "all_below_whole_state": below("peak_over_whole_state"),
              "all_below_whole_params": below("peak_over_whole_params")}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
