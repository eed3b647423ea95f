"""End-to-end runs on user data (text + BPE, token .bin), under torchrun, and the LR schedule."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO, TINY, launch_in_process, run_cli_in_process, run_mcpar, sets

from mcpar.config import parse_config
from mcpar.metrics import read_metrics
from mcpar.trainer import lr_at


def test_lr_schedule_warmup_then_cosine_to_the_floor() -> None:
    cfg = parse_config({"optimization": {"lr": 1.0, "warmup_steps": 10, "min_lr_ratio": 0.1},
                        "training": {"steps": 110}})
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    assert all(lr_at(s, cfg) >= lr_at(s + 1, cfg) for s in range(10, 110))


@pytest.mark.slow
def test_train_on_text_glob_with_bpe(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, path in enumerate(sorted((REPO / "src" / "mcpar").rglob("*.py"))):
        (corpus / f"{i:03d}.txt").write_bytes(path.read_bytes())
    run = tmp_path / "run"
    assert launch_in_process(
        "train", *sets(*TINY, f"data.source={corpus}/*.txt", "data.tokenizer=bpe",
                       "model.vocab_size=512", f"data.cache_dir={tmp_path / 'cache'}",
                       "data.val_fraction=0.1", "training.steps=5"),
        "--nproc", "2", "--run-dir", str(run)) == 0
    records = read_metrics(run)
    assert len(records) == 5
    # A fresh model predicts ~uniformly over the 512 BPE tokens: ln(512) = 6.24.
    assert abs(records[0]["loss"] - np.log(512)) < 0.3
    assert list((tmp_path / "cache").rglob("tokenizer.json"))


@pytest.mark.slow
def test_train_on_pretokenized_bin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokens = np.random.default_rng(0).integers(0, 1000, size=50_000, dtype=np.uint16)
    path = tmp_path / "tokens.bin"
    tokens.tofile(path)
    run = tmp_path / "run"
    proc = run_mcpar("train", *sets(*TINY, f"data.source={path}", "data.token_dtype=uint16",
                                    "model.vocab_size=1000", "training.steps=3"),
                     "--nproc", "1", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr
    assert abs(read_metrics(run)[0]["loss"] - np.log(1000)) < 0.3
    # Token ids beyond the vocabulary are a user error, before any worker starts (the CLI's
    # main in this process: nothing of it is multi-process).
    proc = run_cli_in_process(capsys, "train",
                              *sets(*TINY, f"data.source={path}", "data.token_dtype=uint16",
                                    "model.vocab_size=500"), "--run-dir", str(tmp_path / "r2"))
    assert proc.returncode == 2 and "model.vocab_size" in proc.stderr


@pytest.mark.slow
def test_torchrun_environment_matches_own_launcher(tmp_path: Path) -> None:
    common = sets(*TINY, "training.steps=4", "optimization.micro_batch_size=4")
    own = tmp_path / "own"
    assert launch_in_process("train", *common, "--nproc", "2", "--run-dir", str(own)) == 0
    via_torchrun = tmp_path / "torchrun"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD_SIZE"))}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         "-m", "mcpar.cli", "train", *common, "--run-dir", str(via_torchrun)],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=env,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    a, b = read_metrics(own), read_metrics(via_torchrun)
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], abs=1e-6)
    assert b[0]["comm_bytes"] > 0
