"""``pip install -e .`` beside an installed torch keeps that torch: the package's requirement is
the range of torch versions mcpar supports, not one version, and pip plans no torch download or
replacement in this environment (whose torch is the CPU build of the newest supported version).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import tomllib
import torch
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]


def _torch_requirement() -> Requirement:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_dep,) = [Requirement(d) for d in deps if Requirement(d).name == "torch"]
    return torch_dep


def test_torch_requirement_is_the_supported_range() -> None:
    spec = _torch_requirement().specifier
    # CUDA builds of the oldest supported release, of a middle one, and this CPU build.
    for version in ("2.7.0", "2.7.1+cu126", "2.11.0+cu128", "2.13.0", torch.__version__):
        assert spec.contains(Version(version), prereleases=True), version
    # Neither older releases (APIs mcpar calls are missing) nor untested newer ones.
    assert not spec.contains("2.6.0") and not spec.contains("2.14.0")


def test_pip_install_editable_keeps_the_installed_torch(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    # No build isolation: the installed setuptools builds the metadata, nothing is fetched.
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--no-build-isolation",
         "--disable-pip-version-check", "--report", str(report), "-e", str(REPO)],
        capture_output=True, text=True, timeout=300, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-2000:]
    planned = {item["metadata"]["name"].lower(): item["metadata"]["version"]
               for item in json.loads(report.read_text())["install"]}
    assert "mcpar" in planned
    assert "torch" not in planned, f"pip would replace torch {torch.__version__}: {planned}"
    assert set(planned) == {"mcpar"}, f"pip would download {planned}"
