"""Settings a worker would only notice once started are refused before any worker starts."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from conftest import TINY, run_cli_in_process, sets

from mcpar import capabilities
from mcpar.config import apply_overrides, parse_config


def test_a_token_dtype_on_a_text_source_is_refused(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*TINY, "data.token_dtype=uint16"),
                              "--nproc", "1", "--run-dir", str(tmp_path / "never"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "data.token_dtype: applies to a .bin file of token ids" in proc.stderr
    assert not (tmp_path / "never").exists()


@pytest.mark.parametrize("setting,package,key", [
    ("training.tensorboard=true", "tensorboard", "training.tensorboard"),
    ("optimization.checkpoint.compression=zstd", "zstandard",
     "optimization.checkpoint.compression"),
])
def test_a_setting_whose_package_is_missing_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                       setting: str, package: str,
                                                       key: str) -> None:
    cfg = parse_config(apply_overrides({}, [setting]))
    assert capabilities.environment_problems(cfg) == []  # installed here (the dev extras)
    real = importlib.util.find_spec
    missing = {package, "pyzstd"}
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in missing else real(name, *a))
    (line,) = capabilities.environment_problems(cfg)
    assert line.startswith(key + ":") and "pip install" in line
