"""Every CLI argument bounded and finite, worker counts checked: each bad value is refused with
exit 2 and one line naming the argument, before any work starts (DESIGN.md's CLI contract)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import run_cli_in_process


def _refused(result, key: str) -> None:
    assert result.returncode == 2, result
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and key in lines[0], result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(("flag", "value"), [
    ("--temperature", "nan"), ("--temperature", "inf"), ("--temperature", "-1"),
    ("--seed", str(2**70)), ("--seed", "-1"), ("--max-new-tokens", "0"),
    ("--max-new-tokens", "-5"), ("--max-new-tokens", str(10**12)), ("--top-k", "-1"),
])
def test_generate_refuses_out_of_range_numbers(capsys, tmp_path, flag, value) -> None:
    result = run_cli_in_process(capsys, "generate", str(tmp_path), "--prompt", "hi", flag, value)
    _refused(result, flag)


def test_generate_refuses_a_prompt_of_invalid_utf8(capsys, tmp_path) -> None:
    # A byte that is not UTF-8 reaches argv as a lone surrogate (surrogateescape).
    result = run_cli_in_process(capsys, "generate", str(tmp_path), "--prompt", "a\udcffb")
    _refused(result, "--prompt")


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-3"])
def test_export_refuses_a_bad_shard_size(capsys, tmp_path, value) -> None:
    result = run_cli_in_process(capsys, "export", str(tmp_path), str(tmp_path / "out"),
                                "--format", "hf", "--max-shard-mb", value)
    _refused(result, "--max-shard-mb")


@pytest.mark.parametrize("value", ["0", "-4"])
def test_check_refuses_a_worker_count_below_one(capsys, tmp_path, value) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("training:\n  steps: 1\n")
    _refused(run_cli_in_process(capsys, "check", str(cfg), "--nproc", value), "--nproc")


def test_train_refuses_absurd_worker_counts(capsys, tmp_path) -> None:
    result = run_cli_in_process(capsys, "train", "--nproc", "1000", "--run-dir",
                                str(tmp_path / "run"))
    _refused(result, "--nproc")
    assert "--oversubscribe" in result.stderr
    assert not (tmp_path / "run").exists()


def test_train_refuses_workers_whose_memory_does_not_fit(capsys, tmp_path, monkeypatch) -> None:
    from mcpar.commands import train

    monkeypatch.setattr(train, "_available_memory", lambda: 1 << 30)
    result = run_cli_in_process(capsys, "train", "--nproc", "4", "--run-dir",
                                str(tmp_path / "run"))
    _refused(result, "--nproc")
    assert "GiB" in result.stderr


def test_nproc_under_a_torchrun_environment_is_refused(capsys, tmp_path, monkeypatch) -> None:
    for key, value in {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "x"}.items():
        monkeypatch.setenv(key, value)
    result = run_cli_in_process(capsys, "train", "--nproc", "2", "--run-dir",
                                str(tmp_path / "run"))
    _refused(result, "--nproc")


def _tokenizer(path: Path) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(["some words of text\n"] * 50, trainer=trainer)
    tok.save(str(path))
    return path


def test_prepare_refuses_a_stray_shard_name_and_reads_lone_surrogates(capsys, tmp_path) -> None:
    tok = _tokenizer(tmp_path / "tokenizer.json")
    src = tmp_path / "docs.jsonl"
    src.write_text('{"text": "a lone \\ud800 surrogate"}\n{"text": "plain text"}\n')
    out = tmp_path / "out"
    result = run_cli_in_process(capsys, "prepare", str(src), "--tokenizer", str(tok),
                                "--out", str(out), "--quiet", "--workers", "1")
    assert result.returncode == 0, result.stderr  # the surrogate became U+FFFD
    assert "2 documents" in result.stdout
    (out / "shard-abc.bin").write_bytes(b"x")  # named like a shard, not one of prepare's
    result = run_cli_in_process(capsys, "prepare", str(src), "--tokenizer", str(tok),
                                "--out", str(out), "--quiet", "--workers", "1")
    _refused(result, "shard-abc.bin")


def test_profile_refuses_a_report_place_that_is_a_file(capsys, tmp_path) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "profile").write_text("not a folder")
    result = run_cli_in_process(capsys, "profile", "--run-dir", str(tmp_path / "run"))
    _refused(result, "--run-dir")


def test_a_truncated_bpe_cache_is_rebuilt(tmp_path) -> None:
    from mcpar.data.corpus import load_corpus

    text = tmp_path / "corpus.txt"
    text.write_text("".join(f"line {i} of some text to learn\n" for i in range(300)))
    first = load_corpus(str(text), "bpe", 300, 0.1, cache_dir=tmp_path / "cache")
    (cached,) = (tmp_path / "cache").glob("bpe-*/tokens.npy")
    cached.write_bytes(cached.read_bytes()[:-50])  # a copy cut short
    again = load_corpus(str(text), "bpe", 300, 0.1, cache_dir=tmp_path / "cache")
    assert "trained" in again.description
    assert np.array_equal(np.asarray(first.train), np.asarray(again.train))


def test_a_peak_cache_under_a_missing_folder_is_made(tmp_path, monkeypatch) -> None:
    from mcpar.profiler import mfu

    monkeypatch.setenv(mfu.CACHE_ENV, str(tmp_path / "missing" / "deeper" / "peak.json"))
    monkeypatch.setenv("MCPAR_LOCAL_PROFILE", str(tmp_path / "missing2" / "profile.json"))
    assert mfu.stored_cpu_peak(1) is None
    flops, source = mfu.store_cpu_peak(1, 1e9)
    assert flops == 1e9 and "cached" in source
    assert mfu.stored_cpu_peak(1)[0] == 1e9
