"""A full disk anywhere mcpar writes is the user's to fix: one line naming the path and the key
or option that chose it, exit 2, no traceback, no restart, and nothing half-written left looking
complete. Full disks are emulated two ways: a write monkeypatched to raise ENOSPC in-process,
and (where mount is permitted, as root) a small tmpfs filled to the last byte."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY, launch_in_process, run_cli_in_process, sets

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


# --- controllers.memory.offload_buffer_mb --------------------------------------------------------

def test_a_tiny_offload_buffer_is_refused_with_the_reason() -> None:
    """1e-9 MiB made groups of one element: the step ran ~500x slower. Refused, saying why."""
    with pytest.raises(UserError) as caught:
        load_config(None, ["controllers.memory.offload_buffer_mb=1e-9"])
    (line,) = caught.value.problems
    assert line.startswith("controllers.memory.offload_buffer_mb: must be at least 0.01 MiB"), line
    assert "slower" in line
    assert load_config(None, ["controllers.memory.offload_buffer_mb=0.01"])  # the tests' size


# --- controllers.memory.offload_dir --------------------------------------------------------------

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


# --- export --------------------------------------------------------------------------------------

def _main(*args: str) -> subprocess.CompletedProcess[str]:
    """``mcpar ARGS`` in this process, its output captured here (usable from a module fixture)."""
    import io

    from mcpar.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return subprocess.CompletedProcess(list(args), code, out.getvalue(), err.getvalue())


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-step single-process run with its checkpoint."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    done = _main("train", *sets(*TINY, "training.steps=2", "optimization.checkpoint.interval=2"),
                 "--nproc", "1", "--run-dir", str(run_dir))
    assert done.returncode == 0, done.stderr
    return run_dir


def _one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    (line,) = proc.stderr.splitlines()
    return line


def test_an_export_cut_short_by_a_full_disk_leaves_no_folder(
        trained: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The weights' write meets ENOSPC after config.json was written. Before: OUT was left
    holding config.json (a folder that looks like a start of a model) and the line named
    --run-dir; now OUT is not there, nor any temporary, and the line names OUT."""
    from mcpar.interop import hf_export

    written = []
    real = hf_export.atomic_write

    def fills_up(dest: Path, data: bytes) -> None:
        if written:
            _enospc()
        written.append(dest)
        real(dest, data)

    monkeypatch.setattr(hf_export, "atomic_write", fills_up)
    out = tmp_path / "exports" / "model"
    line = _one_error_line(_main("export", str(trained), "--format", "hf", str(out)))
    assert line == (f"mcpar: error: {out}: {ENOSPC_TEXT} while writing the export (nothing was "
                    "written there); free space there or give another output path"), line
    assert written and not out.exists() and list(out.parent.iterdir()) == []


def test_an_export_onto_an_empty_folder_is_renamed_into_place(trained: Path,
                                                              tmp_path: Path) -> None:
    out = tmp_path / "model"
    out.mkdir()
    done = _main("export", str(trained), "--format", "hf", str(out))
    assert done.returncode == 0, done.stderr
    assert {"config.json", "model.safetensors", "generation_config.json"} <= {
        p.name for p in out.iterdir()}
    assert [p.name for p in tmp_path.iterdir()] == ["model"]  # no temporary left beside it


def test_an_export_onto_a_full_tmpfs_is_one_line_and_leaves_nothing(trained: Path,
                                                                    tmp_path: Path) -> None:
    with _tmpfs(tmp_path / "full", "256k") as mount:
        _fill(mount)
        out = mount / "model"
        line = _one_error_line(_main("export", str(trained), "--format", "hf", str(out)))
        assert line.startswith(f"mcpar: error: {out}: {ENOSPC_TEXT} while writing"), line
        assert [p.name for p in mount.iterdir()] == ["filler"]


# --- prepare -------------------------------------------------------------------------------------

WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()


def _text(n_lines: int) -> str:
    return "".join(" ".join(WORDS[(i + j) % len(WORDS)] for j in range(8)) + "\n"
                   for i in range(n_lines))


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([_text(200)], trainer=trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return path


def _no_shard_looks_complete_unless_it_is(out: Path) -> None:
    from mcpar.data.shards import MANIFEST, complete_shard

    assert not (out / MANIFEST).exists()
    assert not [p for p in out.iterdir() if ".tmp-" in p.name]  # no temporary left
    for record in out.glob("shard-*.json"):
        unit = json.loads(record.read_text())["unit"]
        assert complete_shard(out, record.stem, unit) is not None, record


def test_prepare_onto_a_full_disk_names_out_and_the_file(
        tokenizer_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The second shard's first write meets ENOSPC. Before: 'writing under runs/: ...; choose
    another --run-dir' (prepare has no --run-dir); now --out and the file."""
    from mcpar.data import shards

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_text(3000))
    calls = []
    real = os.fsync

    def fills_up(fd: int) -> None:
        calls.append(fd)
        if len(calls) == 4:  # shard 0: .bin, .idx, .json; then shard 1's .bin
            _enospc()
        real(fd)

    monkeypatch.setattr(shards.os, "fsync", fills_up)
    out = tmp_path / "out"
    proc = run_cli_in_process(capsys, "prepare", str(corpus), "--tokenizer", str(tokenizer_file),
                              "--out", str(out), "--workers", "1", "--shard-tokens", "2000",
                              "--quiet")
    line = _one_error_line(proc)
    assert line == (f"mcpar: error: --out: {out / 'shard-00001.bin'}: {ENOSPC_TEXT}; free "
                    "space there or choose another --out"), line
    _no_shard_looks_complete_unless_it_is(out)


def test_prepare_onto_a_small_tmpfs_stops_with_one_line(
        tokenizer_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(_text(20000))  # ~1 MiB of text: far more tokens than 64 KiB holds
    with _tmpfs(tmp_path / "small", "64k") as mount:
        out = mount / "out"
        proc = run_cli_in_process(capsys, "prepare", str(corpus), "--tokenizer",
                                  str(tokenizer_file), "--out", str(out), "--workers", "1",
                                  "--shard-tokens", "4000", "--quiet")
        line = _one_error_line(proc)
        assert line.startswith(f"mcpar: error: --out: {out}/"), line
        assert line.endswith(f"{ENOSPC_TEXT}; free space there or choose another --out"), line
        _no_shard_looks_complete_unless_it_is(out)


# --- profile -------------------------------------------------------------------------------------

def test_a_profile_report_onto_a_full_disk_names_the_profile_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """Before: 'writing under RUN: ...', the profile folder unnamed; now the report's file."""
    real = Path.write_text

    def fills_up(self: Path, *args: object, **kwargs: object) -> int:
        if self.parent.name == "profile" and self.name.startswith("report"):
            _enospc()
        return real(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "write_text", fills_up)
    run_dir = tmp_path / "run"
    proc = run_cli_in_process(capsys, "profile", "--steps", "2", *sets(*TINY), "--nproc", "1",
                              "--run-dir", str(run_dir))
    line = _one_error_line(proc)
    report = run_dir / "profile" / "report.json"
    assert line == (f"mcpar: error: --run-dir: {report}: {ENOSPC_TEXT}; free space there or "
                    "choose another --run-dir"), line
    assert not (run_dir / "profile" / "report.html").exists()


def _no_trace_left(profile: Path) -> None:
    left = sorted(p.name for p in profile.iterdir()) if profile.exists() else []
    assert not [n for n in left if n.startswith(("trace_", ".trace_"))], left


def test_a_trace_onto_a_full_disk_names_the_trace_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """torch's exporter reports no failed write: on a full disk it leaves the trace cut short
    (or no file) and the read of it was a traceback (JSONDecodeError, FileNotFoundError). Now
    a probe write finds the full disk, and the line names the trace file and --run-dir."""
    from mcpar.profiler import trace

    real_export = trace.profile.export_chrome_trace

    def cut_short(self: object, path: str) -> None:
        real_export(self, path)
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)

    monkeypatch.setattr(trace.profile, "export_chrome_trace", cut_short)
    monkeypatch.setattr(trace.os, "fsync", _enospc)
    run_dir = tmp_path / "run"
    proc = run_cli_in_process(capsys, "profile", "--steps", "2", *sets(*TINY), "--nproc", "1",
                              "--run-dir", str(run_dir))
    line = _one_error_line(proc)
    assert line == (f"mcpar: error: --run-dir: {run_dir / 'profile' / 'trace_rank0.json'}: "
                    f"{ENOSPC_TEXT}; free space there or choose another --run-dir"), line
    _no_trace_left(run_dir / "profile")


def test_a_two_worker_trace_onto_a_full_tmpfs_is_one_line(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """The run directory fits on the tmpfs, the traces do not. Before: a traceback on each
    rank and 'training failed' (exit 1); each worker's own copy of a user error's line made
    one problem three lines."""
    with _tmpfs(tmp_path / "small", "400k") as mount:
        run_dir = mount / "run"
        code = launch_in_process("train", *sets(*TINY, "training.profile.enabled=true",
                                                "training.profile.start_step=2",
                                                "training.profile.steps=1",
                                                "optimization.checkpoint.interval=0"),
                                 "--steps", "2", "--nproc", "2", "--run-dir", str(run_dir))
        err = capfd.readouterr().err
        assert code == 2, err
        assert "Traceback" not in err and "terminate called" not in err, err
        lines = [ln for ln in err.splitlines() if ln.startswith("mcpar:")]
        assert len(lines) == 1, err
        assert lines[0].startswith(f"mcpar: error: --run-dir: {run_dir / 'profile'}/trace_rank")
        assert lines[0].endswith(f"{ENOSPC_TEXT}; free space there or choose another --run-dir")
        assert "restart" not in err
        _no_trace_left(run_dir / "profile")
