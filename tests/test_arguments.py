"""Every CLI argument bounded and finite, worker counts checked: each bad value is refused with
exit 2 and one line naming the argument, before any work starts (DESIGN.md's CLI contract)."""

from __future__ import annotations

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
