"""``mcpar generate``: text from a short run's newest checkpoint, the sampling rules, the
refusals."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch
from conftest import REPO, TINY, run_cli_in_process, sets
from tokenizers import Tokenizer

from mcpar.cli import main
from mcpar.config import load_config, to_yaml
from mcpar.generate import Sampling, sample_next


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 3-step single-process Llama run with a checkpoint, trained in this process, on a small
    text with mcpar's BPE tokenizer (so that text goes through a tokenizer.json)."""
    root = tmp_path_factory.mktemp("generate")
    words = "def return self value import class for in if else while".split()
    (root / "text.txt").write_text("\n".join(
        " ".join(words[(i * 7 + j * 3) % len(words)] for j in range(10)) for i in range(2000)))
    with contextlib.chdir(REPO):
        assert main(["train", *sets(*TINY, "model.kind=llama", "training.steps=3",
                                    "optimization.checkpoint.interval=3", "model.vocab_size=300",
                                    "data.tokenizer=bpe", f"data.source={root / 'text.txt'}",
                                    f"data.cache_dir={root / 'cache'}"),
                     "--nproc", "1", "--run-dir", str(root / "run")]) == 0
    return root / "run"


def test_generate_prints_the_prompt_and_sampled_text(run_dir: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", str(run_dir), "--prompt", "def ", "--max-new-tokens", "24",
            "--seed", "3"]
    proc = run_cli_in_process(capsys, *args)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("def ") and len(proc.stdout.rstrip("\n")) > len("def ")
    assert "step 3" in proc.stderr
    assert run_cli_in_process(capsys, *args).stdout == proc.stdout  # seeded
    greedy = run_cli_in_process(capsys, *args[:-2], "--temperature", "0", "--device", "cpu")
    assert greedy.returncode == 0 and greedy.stdout.startswith("def ")


def test_sampling_rules() -> None:
    logits = torch.tensor([0.0, 3.0, 2.5, -1.0, 1.0])
    gen = torch.Generator().manual_seed(0)
    assert sample_next(logits, Sampling(temperature=0.0), gen) == 1
    assert {sample_next(logits, Sampling(top_k=1), gen) for _ in range(20)} == {1}
    drawn = {sample_next(logits, Sampling(top_k=2, temperature=5.0), gen) for _ in range(200)}
    assert drawn == {1, 2}  # only the two best, both reachable


def test_generate_refusals(run_dir: Path, tmp_path: Path,
                           capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.yaml").write_text(to_yaml(load_config(None)))
    proc = run_cli_in_process(capsys, "generate", str(empty), "--prompt", "x")
    assert proc.returncode == 2 and "no valid checkpoint" in proc.stderr
    proc = run_cli_in_process(capsys, "generate", str(run_dir), "--prompt", "x",
                              "--temperature", "-1")
    assert proc.returncode == 2 and "--temperature" in proc.stderr


def test_export_carries_the_run_tokenizer(run_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """The export of the same run: its BPE travels as tokenizer.json, which transformers'
    AutoTokenizer reads and which encodes as the run did."""
    transformers = pytest.importorskip("transformers")
    proc = run_cli_in_process(capsys, "export", str(run_dir), "--format", "hf", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    ours = Tokenizer.from_file(str(next((run_dir.parent / "cache").rglob("tokenizer.json"))))
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path)
    text = "def value return self"
    assert theirs(text)["input_ids"] == ours.encode(text).ids
