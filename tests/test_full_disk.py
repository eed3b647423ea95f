"""A full disk anywhere mcpar writes is the user's to fix: one line naming the path and the key
or option that chose it, exit 2, no traceback, no restart, and nothing half-written left looking
complete. Full disks are emulated two ways: a write monkeypatched to raise ENOSPC in-process,
and (where mount is permitted, as root) a small tmpfs filled to the last byte."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY, launch_in_process, sets

from mcpar.config import load_config
from mcpar.controllers.memory.offload import FileBacking
from mcpar.errors import UserError

NVME = ["controllers.memory.offload=nvme", "controllers.memory.offload_buffer_mb=0.01"]
ENOSPC_TEXT = os.strerror(errno.ENOSPC)


def _enospc(*_args: object, **_kwargs: object) -> None:
    raise OSError(errno.ENOSPC, ENOSPC_TEXT)


@contextlib.contextmanager
def _tmpfs(where: Path, size: str) -> Iterator[Path]:
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root (mount was refused here)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=True)


def _fill(mount: Path) -> None:
    with contextlib.suppress(OSError), open(mount / "filler", "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


# --- controllers.memory.offload_buffer_mb -------------------------------------------------------

def test_a_tiny_offload_buffer_is_refused_with_the_reason() -> None:
    """1e-9 MiB made groups of one element: the step ran ~500x slower. Refused, saying why."""
    with pytest.raises(UserError) as caught:
        load_config(None, ["controllers.memory.offload_buffer_mb=1e-9"])
    (line,) = caught.value.problems
    assert line.startswith("controllers.memory.offload_buffer_mb: must be at least 0.01 MiB"), line
    assert "slower" in line
    assert load_config(None, ["controllers.memory.offload_buffer_mb=0.01"])  # the tests' size


# --- controllers.memory.offload_dir ---------------------------------------------------------------

def test_a_full_offload_file_is_a_user_error_naming_the_file_and_key(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "offload" / "rank0.state"
    backing = FileBacking(path, 1024)
    monkeypatch.setattr(os, "pwritev", _enospc)
    with pytest.raises(UserError) as caught:
        backing.write(0, torch.zeros(16))
    backing.close()
    (line,) = caught.value.problems
    assert line.startswith(f"controllers.memory.offload_dir: writing under {path}: "
                           f"{ENOSPC_TEXT}; free space there or choose another "
                           "controllers.memory.offload_dir"), line


def test_a_full_offload_dir_stops_the_job_without_restarts_and_keeps_its_checkpoint(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """Two workers stream their AdamW state through files on a 2 MiB tmpfs; the job stops at
    step 10 with its checkpoint. The tmpfs is then filled and the job resumed: each worker's
    first write back of the state meets ENOSPC. Before: three restarts, then 'training
    failed: ... OSError: [Errno 28] No space left on device' naming neither file nor key."""
    with _tmpfs(tmp_path / "nvme", "2m") as mount:
        run_dir = tmp_path / "run"
        args = ["train", *sets(*TINY, *NVME, "training.steps=20",
                               "optimization.micro_batch_size=2",
                               "optimization.global_batch_size=8", "parallelism.data=2",
                               "optimization.checkpoint.interval=10",
                               f"controllers.memory.offload_dir={mount}"),
                "--nproc", "2", "--run-dir", str(run_dir)]
        assert launch_in_process(*args, "--stop-after", "10") == 0
        checkpoints = run_dir / "checkpoints"
        before = _digests(checkpoints)
        assert any(name.startswith("step-10/") for name in before), before
        capfd.readouterr()
        _fill(mount)
        assert launch_in_process(*args, "--resume") == 2
        err = capfd.readouterr().err
        assert "Traceback" not in err
        lines = [line for line in err.splitlines() if line.startswith("mcpar: error: ")]
        assert lines, err
        assert lines[0].startswith("mcpar: error: controllers.memory.offload_dir: writing "
                                   f"under {mount}/rank"), lines
        assert ENOSPC_TEXT in lines[0] and "free space there" in lines[0]
        assert "restart" not in err
        assert _digests(checkpoints) == before  # the last checkpoint is intact
