"""Scale of ``mcpar prepare`` and of training reads from its shards (issue 20, must-show 3).

Makes ``--gb`` GB of text locally (this Python's standard-library sources, repeated; a copy
number line at the top of each repeat keeps the documents distinct), trains a small byte-level
BPE tokenizer on its first MB (no download), prepares it with ``--workers`` processes, and then
streams training windows from the prepared shards in a fresh process at two corpus sizes (the
first quarter of the shards and all of them). Prints one JSON object: throughput, peak resident
memory of prepare (the parent, and the largest worker) and of the two training reads.

Run: ``python bench/prepare_scale.py --gb 1 --workers 2 --dir /tmp/prep-bench``

Figures (fill in from a run on a named machine; none recorded yet: the session that wrote this
ran out of time on a 2-core machine shared with other test runs).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

_READ = textwrap.dedent("""
    import json, resource, sys
    import numpy as np
    from mcpar.shards import PreparedSource, PreparedSplit
    src = PreparedSource(__import__("pathlib").Path(sys.argv[1]), "bench")
    keep = int(sys.argv[2])
    src.shard_tokens[keep:] = 0  # a smaller corpus: only the first `keep` shards have windows
    train = PreparedSplit([src], [1.0], "train", 0.01)
    for k in range(500):
        train.windows(np.arange(k * 32, k * 32 + 32), 1024, 1)
    print(json.dumps({"tokens": int(src.shard_tokens.sum()),
                      "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
""")


def make_text(root: Path, gigabytes: float) -> int:
    from mcpar.text_files import stdlib_files

    root.mkdir(parents=True, exist_ok=True)
    sources = [p.read_bytes() for p in stdlib_files()]
    total, copy = 0, 0
    while total < gigabytes * 1e9:
        with open(root / f"part-{copy:04d}.txt", "wb") as f:
            f.write(f"# copy {copy}\n".encode())
            for data in sources:
                f.write(data)
                total += len(data)
        copy += 1
    return total


def make_tokenizer(text_dir: Path, out: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=8192, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    sample = (text_dir / "part-0000.txt").read_bytes()[: 1 << 20].decode("utf-8", "replace")
    tok.train_from_iterator([sample], trainer=trainer)
    tok.save(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--dir", default="/tmp/mcpar-prepare-bench")
    args = parser.parse_args()
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    text_bytes = make_text(root / "text", args.gb)
    tokenizer = make_tokenizer(root / "text", root / "tokenizer.json")

    from mcpar.prepare import prepare

    start = time.perf_counter()
    result = prepare([str(root / "text")], str(tokenizer), root / "shards", workers=args.workers,
                     shard_tokens=1 << 24, progress=False)
    seconds = time.perf_counter() - start
    shards = len(result["shards"])
    reads = []
    for keep in (max(1, shards // 4), shards):
        proc = subprocess.run([sys.executable, "-c", _READ, str(root / "shards"), str(keep)],
                              capture_output=True, text=True, check=True)
        reads.append(json.loads(proc.stdout))
    print(json.dumps({
        "text_bytes": text_bytes, "tokens": result["total_tokens"], "shards": shards,
        "workers": args.workers, "prepare_s": round(seconds, 1),
        "prepare_mb_per_s": round(text_bytes / seconds / 1e6, 2),
        "prepare_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "prepare_worker_peak_rss_mb":
            resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
        "training_read": reads,
    }, indent=1))


if __name__ == "__main__":
    main()
