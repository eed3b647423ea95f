"""Settings a worker would only notice once started are refused before any worker starts."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import TINY, run_cli_in_process, run_mcpar, sets

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


def _train(capsys: pytest.CaptureFixture[str], run_dir: Path,
           *settings: str) -> subprocess.CompletedProcess[str]:
    return run_cli_in_process(capsys, "train", *sets(*TINY, "training.steps=2", *settings),
                              "--nproc", "1", "--run-dir", str(run_dir))


@pytest.mark.parametrize("key", ["--run-dir", "optimization.checkpoint.dir", "data.cache_dir"])
def test_a_file_in_the_way_of_a_directory_is_refused_before_anything_runs(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str) -> None:
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory\n")
    run_dir, settings = tmp_path / "run", ["data.tokenizer=bpe", "model.vocab_size=300"]
    if key == "--run-dir":
        run_dir = blocker / "run"
    elif key == "optimization.checkpoint.dir":
        settings.append(f"optimization.checkpoint.dir={blocker / 'ckpt'}")
    else:
        settings.append(f"data.cache_dir={blocker / 'cache'}")
    proc = _train(capsys, run_dir, *settings)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"mcpar: error: {key}: ") and str(blocker) in line, line
    assert not (tmp_path / "run").exists()


def _as_another_user(*args: str) -> subprocess.CompletedProcess[str]:
    """``mcpar ARGS`` as the unprivileged user 'nobody' (root passes every permission check):
    in a forked child of this process, which has already imported everything the command
    runs, so that the check does not depend on 'nobody' being able to read the source tree."""
    if os.geteuid() != 0:
        return run_mcpar(*args)
    import mcpar.trainer  # noqa: F401  (cmd_train imports it late; nobody may not read it)
    from mcpar.cli import main

    read_out, write_out = os.pipe()
    read_err, write_err = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, run, report the exit code
        code = 1
        try:
            os.dup2(write_out, 1)
            os.dup2(write_err, 2)
            sys.stdout = os.fdopen(1, "w", closefd=False)
            sys.stderr = os.fdopen(2, "w", closefd=False)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            code = main(list(args))
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write_out)
    os.close(write_err)
    with os.fdopen(read_out) as out, os.fdopen(read_err) as err:
        stdout, stderr = out.read(), err.read()
    _, status = os.waitpid(pid, 0)
    return subprocess.CompletedProcess(list(args), os.waitstatus_to_exitcode(status), stdout,
                                       stderr)


@pytest.fixture
def shared_tmp() -> Iterator[Path]:
    """A directory every user may enter (pytest's tmp_path is private to its owner)."""
    path = Path(tempfile.mkdtemp(prefix="mcpar-perm-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path)


def test_unwritable_and_unreadable_paths_are_refused_with_their_keys(shared_tmp: Path) -> None:
    """As a user without the permissions: a checkpoint directory inside a read-only directory
    and an unreadable corpus are both named, before any worker starts (no run directory)."""
    tmp_path = shared_tmp
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o555)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text nobody may read\n" * 100)
    corpus.chmod(0o600 if os.geteuid() == 0 else 0o000)  # root owns it: 'nobody' cannot read
    proc = _as_another_user(
        "train", *sets(*TINY, f"data.source={corpus}",
                       f"optimization.checkpoint.dir={locked / 'ckpt'}"),
        "--nproc", "2", "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.splitlines()
    assert lines[0].startswith(f"mcpar: error: data.source: {corpus} is not readable"), lines
    assert lines[1].startswith(f"mcpar: error: optimization.checkpoint.dir: {locked} is not "
                               "writable"), lines
    assert "starting" not in proc.stdout and not (tmp_path / "run").exists()


@pytest.fixture
def full_disk(tmp_path: Path) -> Iterator[Path]:
    """A 256 KiB tmpfs filled to the last byte (needs root's mount; skipped elsewhere)."""
    mount = tmp_path / "full"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip("mounting a small tmpfs needs root")
    try:
        with contextlib.suppress(OSError), open(mount / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
                f.flush()
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_disk_under_the_launchers_writes_is_one_clear_line(
        full_disk: Path, capsys: pytest.CaptureFixture[str]) -> None:
    proc = _train(capsys, full_disk / "run")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    (line,) = proc.stderr.splitlines()
    assert line.startswith(f"mcpar: error: {full_disk / 'run' / '.lock'}: "), line
    assert "No space left on device" in line and "free space" in line


def test_names_the_filesystem_refuses_are_named_with_their_keys(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A name longer than the filesystem allows, in each key that names a directory to write,
    is one line naming the key (exit 2, no traceback), not an OSError from a probe."""
    long = tmp_path / ("x" * 300)
    proc = run_cli_in_process(
        capsys, "train", *sets(*TINY, "controllers.memory.offload=nvme",
                               f"controllers.memory.offload_dir={long}",
                               f"optimization.checkpoint.dir={long}",
                               f"data.cache_dir={long}"),
        "--run-dir", str(long))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    keys = ["--run-dir", "optimization.checkpoint.dir", "controllers.memory.offload_dir",
            "data.cache_dir"]
    lines = proc.stderr.splitlines()
    assert [line.split(": ")[2] for line in lines] == keys, lines
    assert all("File name too long" in line for line in lines), lines
