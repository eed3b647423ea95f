"""The tree's structure, checked: layering without import circles, small files, a trainer that
neither inspects the optimizer's type nor injects faults."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
MAX_LINES = 600


def test_no_source_file_is_over_600_lines() -> None:
    long = {str(p.relative_to(REPO)): n for p in SRC.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}, f"split these files: {long}"


def test_import_contracts_are_kept() -> None:
    """The layering, the controllers' independence and the absence of import circles
    (pyproject.toml's [tool.importlinter] contracts)."""
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent))
    if exe is None:
        pytest.fail("lint-imports is missing: pip install -e '.[dev]'")
    proc = subprocess.run([exe, "--no-cache"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "3 kept, 0 broken" in proc.stdout


def _trainer_tree() -> ast.Module:
    return ast.parse((SRC / "mcpar" / "trainer.py").read_text())


def test_the_trainer_never_checks_the_optimizer_type() -> None:
    offending = []
    for node in ast.walk(_trainer_tree()):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("isinstance", "type", "getattr", "hasattr"):
            text = ast.unparse(node)
            if "optimizer" in text or "OneBitAdam" in text or "AdamW" in text:
                offending.append(text)
    assert offending == []


def test_the_trainer_holds_no_fault_injection() -> None:
    source = (SRC / "mcpar" / "trainer.py").read_text()
    for needle in ("MCPAR_FAULT", "os.environ", "time.sleep", "fault_rank", "fault_steps"):
        assert needle not in source, needle
    # What a test injects reaches the trainer as one object, called at one place.
    assert source.count("self.faults.") == 1
