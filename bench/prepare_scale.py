"""Scale of ``mcpar prepare`` and of training from its shards (issue 20, must-show 3).

The claim: each process's peak resident memory stays under a bound that does not grow with the
corpus, preparing twice gives the same bytes, and a blend draws its sources in the configured
proportions. Checked at two corpus sizes (``--sizes``, GB of text), each step in its own fresh
process so that one size's peak cannot hide the other's:

- text: this Python's standard-library sources, repeated (a ``# copy N`` line heads each copy,
  so documents differ); the small corpus is the first copies, the large one all of them;
- a byte-level BPE tokenizer (8192 ids) trained on the first MB (no download);
- ``prepare`` of each size with ``--workers`` processes: wall time, throughput, peak RSS of the
  parent and of the largest worker (``RUSAGE_CHILDREN``: the largest reaped child);
- a second ``prepare`` of the small size into another directory: sha256 of every shard, index
  and manifest file must equal the first's;
- a short real ``mcpar train`` (small Llama, ``data.source`` = the shard directory, with its
  tokenizer) at each size: the worker's ``peak_mem_bytes`` (``ru_maxrss`` on CPU) from
  metrics.jsonl;
- a ``0.7 small / 0.3 large`` blend: the share of the small source over 1000 consecutive
  sequences of the sample order, at several starting points (must be within 1% of 0.7).

Run: ``nice -n 5 python bench/prepare_scale.py --sizes 0.25 1 --workers 2 \\
--dir /tmp/mcpar-prepare-bench --json bench/data/prepare_scale.json``

Figures (bench/data/prepare_scale.json; ``--sizes 0.0625 0.25 --workers 2``, 2 cores shared with
other test runs, load average ~10 throughout, so the times are the load's):

===========================  ==================  ===================
corpus (stdlib text)         0.066 GB, 4 shards  0.255 GB, 15 shards
===========================  ==================  ===================
prepare, wall / throughput   321 s, 0.21 MB/s    1703 s, 0.15 MB/s
prepare parent peak RSS      210.9 MB            211.0 MB
prepare largest worker peak  429.6 MB            416.1 MB
train worker peak (8 steps)  603.0 MB            605.4 MB
===========================  ==================  ===================

Bound stated: at ``--shard-tokens 2**22`` every prepare process stays under 512 MB (a worker
holds one unit: its raw bytes, decoded text and uint16 ids; its size is set by
``--shard-tokens``, not by the corpus), and this training worker (2-layer Llama, vocab 8192,
seq 256, micro-batch 8: torch and the logits dominate) under 640 MB; 3.8x the corpus moved the
peaks by +0.1, -13.5 and +2.4 MB. The second prepare of the small corpus (103.5 s, the load had
eased) gave 13 byte-identical files (every shard's .bin/.idx/.json and manifest.json, sha256).
The 0.7/0.3 blend drew the first source in exactly 700 of 1000 consecutive sequences at each of
4 starting points (test_prepare.py checks within 1% too). 1 GB, by hand after the run (the same
``prepare`` and ``train`` steps, "one_gb_resumed" in the JSON): 1.007 GB resumed into a copy of
the 0.255 GB directory (14 shards reused, 43 built, 1121 s) peaked at 210.9 MB in the parent and
430.8 MB in the largest worker, and its 8-step train worker at 598.6 MB: the same bounds at 15x
the smallest corpus. A fresh ``--sizes 0.25 1`` run needs an idle machine (about 1.5 GB to
tokenize).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bench_workers import emit_result

REPO = Path(__file__).resolve().parents[1]
SHARD_TOKENS = 1 << 22  # 8 MB uint16 shards (~14 MB of text): 1 GB makes ~75, 0.25 GB ~19
TRAIN = [
    "model.kind=llama", "model.num_layers=2", "model.hidden_size=64", "model.num_heads=4",
    "model.num_kv_heads=2", "model.seq_len=256", "model.vocab_size=8192",
    "optimization.micro_batch_size=8", "optimization.global_batch_size=8",
    "optimization.warmup_steps=2", "training.steps=8", "training.eval_interval=4",
    "training.eval_batches=2", "training.progress=false",
]


def _mb(kib: int) -> float:
    return round(kib / 1024, 1)  # ru_maxrss is KiB on Linux


def make_text(root: Path, sizes: list[float]) -> list[tuple[Path, int]]:
    """Copies of the stdlib sources: ``root/part-i/copy-j.txt``; part i completes size i.
    Returns each part's directory with the bytes of text up to and including it."""
    from mcpar.data.text_files import stdlib_files

    sources = [p.read_bytes() for p in stdlib_files()]
    per_copy = sum(len(s) for s in sources)
    parts, copy, total = [], 0, 0
    for i, gb in enumerate(sorted(sizes)):
        directory = root / f"part-{i}"
        directory.mkdir(parents=True, exist_ok=True)
        for _ in range(max(0, math.ceil(gb * 1e9 / per_copy) - copy)):
            path = directory / f"copy-{copy:04d}.txt"
            with open(path, "wb") as f:
                f.write(f"# copy {copy}\n".encode())
                for data in sources:
                    f.write(data)
            copy += 1
            total += path.stat().st_size
        parts.append((directory, total))
    return parts


def make_tokenizer(first_file: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    sample = first_file.read_bytes()[: 1 << 20].decode("utf-8", "replace")
    tok.train_from_iterator([sample], trainer=trainer)
    tok.save(str(out))
    return out


def _child(*args: str) -> dict:
    """Run this file's ``args[0]`` step in a fresh interpreter; its printed JSON."""
    proc = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True,
                          cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def step_prepare(out: str, tokenizer: str, workers: str, *sources: str) -> dict:
    from mcpar.data.prepare import prepare

    start = time.perf_counter()
    result = prepare(list(sources), tokenizer, out, workers=int(workers),
                     shard_tokens=SHARD_TOKENS, progress=False)
    seconds = time.perf_counter() - start
    text_bytes = sum(f["bytes"] for f in result["files"])
    return {
        "text_bytes": text_bytes, "tokens": result["total_tokens"],
        "documents": result["total_documents"], "shards": len(result["shards"]),
        "built": result["built"], "workers": int(workers), "seconds": round(seconds, 1),
        "mb_per_s": round(text_bytes / seconds / 1e6, 2),
        "parent_peak_rss_mb": _mb(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss),
        "largest_worker_peak_rss_mb": _mb(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss),
    }


def step_train(shards: str, tokenizer: str, run_dir: str) -> dict:
    sets = [*TRAIN, f"data.source={shards}", f"data.tokenizer={tokenizer}"]
    args = [sys.executable, "-m", "mcpar.cli", "train", "--nproc", "1", "--run-dir", run_dir]
    for s in sets:
        args += ["--set", s]
    start = time.perf_counter()
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(proc.stderr[-4000:])
    records = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    return {
        "steps": len(train), "seconds": round(time.perf_counter() - start, 1),
        "first_loss": round(train[0]["loss"], 3), "last_loss": round(train[-1]["loss"], 3),
        "worker_peak_rss_mb": round(max(r["peak_mem_bytes"] for r in train) / 2**20, 1),
        "process_tree_peak_rss_mb":
            _mb(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss),
    }


def step_blend(small: str, large: str) -> dict:
    import numpy as np

    from mcpar.data.prepared_corpus import load_prepared

    train = load_prepared(f"0.7 {small} 0.3 {large}", "bytes", 8192, 0.01)[0]
    shares = {}
    for start in (0, 1000, 123_457, 10**7):
        src, _ = train.locate(np.arange(start, start + 1000), 256, seed=1234)
        shares[str(start)] = float(np.mean(src == 0))
    return {"weights": [0.7, 0.3], "sequences": 1000, "share_of_first_by_start": shares,
            "max_abs_error": round(max(abs(s - 0.7) for s in shares.values()), 4)}


def digests(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.iterdir())
            if p.name.startswith("shard-") or p.name == "manifest.json"}


STEPS = {"prepare": step_prepare, "train": step_train, "blend": step_blend}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", type=float, nargs=2, default=[0.25, 1.0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/mcpar-prepare-bench")
    parser.add_argument("--json", default=None, help="also write the result here")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    parts = make_text(root / "text", args.sizes)
    tokenizer = str(make_tokenizer(next(iter(sorted(parts[0][0].iterdir()))),
                                   root / "tokenizer.json"))
    sizes = []
    for i, (_, text_bytes) in enumerate(parts):
        sources = [str(d) for d, _ in parts[: i + 1]]
        out = root / f"shards-{i}"
        prep = _child("prepare", str(out), tokenizer, str(args.workers), *sources)
        assert prep["text_bytes"] == text_bytes
        train = _child("train", str(out), tokenizer, str(root / f"run-{i}"))
        sizes.append({"gb": round(text_bytes / 1e9, 3), "prepare": prep, "train": train})
    again = _child("prepare", str(root / "shards-0-again"), tokenizer, str(args.workers),
                   str(parts[0][0]))
    first, second = digests(root / "shards-0"), digests(root / "shards-0-again")
    blend = _child("blend", str(root / "shards-0"), str(root / "shards-1"))
    result = {
        "machine": f"{os.cpu_count()} cores", "sizes": sizes,
        "second_prepare": {"seconds": again["seconds"], "files": len(second),
                           "identical": first == second,
                           "sha256_manifest": second.get("manifest.json")},
        "blend": blend,
        "growth_mb": {
            "prepare_parent": round(sizes[1]["prepare"]["parent_peak_rss_mb"]
                                    - sizes[0]["prepare"]["parent_peak_rss_mb"], 1),
            "prepare_worker": round(sizes[1]["prepare"]["largest_worker_peak_rss_mb"]
                                    - sizes[0]["prepare"]["largest_worker_peak_rss_mb"], 1),
            "train_worker": round(sizes[1]["train"]["worker_peak_rss_mb"]
                                  - sizes[0]["train"]["worker_peak_rss_mb"], 1),
        },
    }
    emit_result(result, args.json)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] in STEPS:
        print(json.dumps(STEPS[sys.argv[1]](*sys.argv[2:])))
    else:
        main()
