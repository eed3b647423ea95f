"""Loading a checkpoint cannot act or wander: a crafted ``.metadata`` builds nothing outside an
exact allowlist, no file outside the checkpoint's own checksummed folder is ever opened, and any
damage to ``manifest.json`` or ``.metadata`` makes the checkpoint invalid (resume falls back to
the previous one, logged) rather than raising. One tiny ``mcpar train`` run supplies the real
checkpoints (steps 2 and 4); everything else runs in this process."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import shutil
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from conftest import TINY, recovery_events, run_mcpar, sets
from torch.distributed.checkpoint import filesystem

from mcpar.checkpoint.files import (
    METADATA_GLOBALS,
    InvalidCheckpointError,
    RecoveryLog,
    SafeFileSystemReader,
    find_latest_valid,
    load_tensors,
    verify_checkpoint,
)

SETTINGS = [*TINY, "training.steps=4", "optimization.checkpoint.interval=2",
            "optimization.checkpoint.async_save=false"]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished run with valid checkpoints at steps 2 and 4."""
    run = tmp_path_factory.mktemp("safety") / "run"
    proc = run_mcpar("train", *sets(*SETTINGS), "--nproc", "1", "--run-dir", str(run))
    assert proc.returncode == 0, proc.stderr[-2000:]
    for step in (2, 4):
        assert verify_checkpoint(run / "checkpoints" / f"step-{step}") is None
    return run


@pytest.fixture
def copy(run: Path, tmp_path: Path) -> Path:
    """A copy of the run to damage; its recovery log starts empty."""
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    (out / "recovery.jsonl").unlink(missing_ok=True)
    return out


def _rehash(folder: Path, *names: str) -> None:
    """Rewrite the manifest entries of ``names`` to match the files as they now are (what an
    attacker who can write the folder does)."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in names:
        data = (folder / name).read_bytes()
        manifest["files"][name] = {"sha256": hashlib.sha256(data).hexdigest(),
                                   "bytes": len(data)}
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=2))


def _metadata(folder: Path):  # noqa: ANN202  (DCP's Metadata)
    return pickle.loads((folder / ".metadata").read_bytes())


def _assert_fallback(run_dir: Path, reason: str) -> None:
    """Resume picks step 2, and the log says step 4 was invalid and why."""
    ckpts = run_dir / "checkpoints"
    found = find_latest_valid(ckpts, RecoveryLog(run_dir))
    assert found is not None and found[0] == 2
    events = recovery_events(run_dir)
    (invalid,) = [e for e in events if e["event"] == "invalid_checkpoint"]
    assert invalid["step"] == 4 and reason in invalid["reason"], invalid
    assert [e["step"] for e in events if e["event"] == "fallback"] == [2]


# --- (i) nothing outside the allowlist is built ------------------------------------------------

MARKER_MODULE = "torch.distributed.checkpoint._mcpar_test_marker"


class Marker:
    """A stand-in for a class whose construction acts (opens a socket, closes descriptors):
    constructing it writes a file. It lives under DCP's module prefix, which the former
    prefix allowlist admitted."""

    def __init__(self, path: str) -> None:
        Path(path).write_text("built")

    def __reduce__(self) -> tuple:
        return Marker, (self.path,)


Marker.__module__ = MARKER_MODULE


def _marker_pickle(folder: Path, marker: Path) -> bytes:
    """The step's real metadata with a ``Marker`` hidden in its planner data."""
    module = types.ModuleType(MARKER_MODULE)
    module.Marker = Marker  # type: ignore[attr-defined]
    sys.modules[MARKER_MODULE] = module  # the unpickler can import it: only the list refuses
    metadata = _metadata(folder)
    stand_in = Marker.__new__(Marker)
    stand_in.path = str(marker)  # type: ignore[attr-defined]
    metadata.planner_data = {"x": stand_in}
    return pickle.dumps(metadata)


def test_the_allowlist_is_exact_names() -> None:
    modules = {m for m, _ in METADATA_GLOBALS}
    assert modules == {"torch", "torch.serialization", "pathlib",
                       "torch.distributed.checkpoint.metadata",
                       "torch.distributed.checkpoint.filesystem"}
    assert ("torch", "load") not in METADATA_GLOBALS
    assert ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata") not in \
        METADATA_GLOBALS


def test_a_metadata_class_outside_the_allowlist_is_never_built(copy: Path) -> None:
    step4 = copy / "checkpoints" / "step-4"
    marker = copy / "built-marker"
    try:
        (step4 / ".metadata").write_bytes(_marker_pickle(step4, marker))
        _rehash(step4, ".metadata")
        reason = verify_checkpoint(step4)
        assert reason is not None and MARKER_MODULE in reason and "refusing" in reason
        with pytest.raises(pickle.UnpicklingError, match="refusing"):
            SafeFileSystemReader(step4).read_metadata()
        with pytest.raises(pickle.UnpicklingError):
            load_tensors(step4)
        _assert_fallback(copy, "refusing")
        assert not marker.exists()
    finally:
        sys.modules.pop(MARKER_MODULE, None)


def test_resume_skips_a_crafted_metadata_without_building_it(copy: Path) -> None:
    """The same crafted step 4 through ``mcpar train --resume``: the run resumes from step 2
    and finishes, the marker never appears, and the log says why."""
    step4 = copy / "checkpoints" / "step-4"
    marker = copy / "built-marker"
    try:
        (step4 / ".metadata").write_bytes(_marker_pickle(step4, marker))
    finally:
        sys.modules.pop(MARKER_MODULE, None)
    _rehash(step4, ".metadata")
    proc = run_mcpar("train", *sets(*SETTINGS, "training.steps=5"), "--nproc", "1",
                     "--run-dir", str(copy), "--resume")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    events = recovery_events(copy)
    invalid = [e for e in events if e["event"] == "invalid_checkpoint"]
    assert invalid and invalid[0]["step"] == 4 and "refusing" in invalid[0]["reason"]
    assert [e["step"] for e in events if e["event"] == "load"] == [2]
    assert not marker.exists()


# --- (ii) no file outside the folder is read ---------------------------------------------------

def _point_outside(step4: Path, how: str) -> None:
    """Make every storage path of step 4's metadata name step 2's shard file."""
    outside = step4.parent / "step-2" / "__0_0.distcp"
    if how == "dotdot":
        target = "../step-2/__0_0.distcp"
    elif how == "absolute":
        target = str(outside)
    else:  # a symlink inside the folder, listed in the manifest with the target's checksum
        target = "__9_0.distcp"
        os.symlink(outside, step4 / target)
    metadata = _metadata(step4)
    for info in metadata.storage_data.values():
        info.relative_path = target
    (step4 / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(step4, ".metadata", *([target] if how == "symlink" else []))
    # The shard file of step 4 itself is gone: only the outside one could be read.
    (step4 / "__0_0.distcp").unlink()
    manifest = json.loads((step4 / "manifest.json").read_text())
    del manifest["files"]["__0_0.distcp"]
    (step4 / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink"])
def test_storage_paths_outside_the_folder_are_refused(copy: Path, how: str,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    step4 = copy / "checkpoints" / "step-4"
    _point_outside(step4, how)
    opened: list[Path] = []
    real = filesystem.FileSystem.create_stream

    def spy(self, path, mode):  # noqa: ANN001, ANN202
        opened.append(Path(path))
        return real(self, path, mode)

    monkeypatch.setattr(filesystem.FileSystem, "create_stream", spy)
    reason = verify_checkpoint(step4)
    assert reason is not None and "outside" in reason, reason
    with pytest.raises(InvalidCheckpointError, match="outside"):
        load_tensors(step4)
    assert opened == []  # DCP opened no shard file at all
    _assert_fallback(copy, "outside")


def test_manifest_entries_outside_the_folder_are_refused(copy: Path) -> None:
    step4 = copy / "checkpoints" / "step-4"
    manifest = json.loads((step4 / "manifest.json").read_text())
    manifest["files"]["../step-2/meta.json"] = manifest["files"]["meta.json"]
    (step4 / "manifest.json").write_text(json.dumps(manifest))
    assert "outside" in (verify_checkpoint(step4) or "")


def test_a_tensor_larger_than_its_bytes_is_refused_before_allocating(copy: Path) -> None:
    """A crafted size (a terabyte of float32) is refused from the metadata alone."""
    step4 = copy / "checkpoints" / "step-4"
    metadata = _metadata(step4)
    key = next(k for k in metadata.state_dict_metadata if k.endswith("/float32"))
    md = metadata.state_dict_metadata[key]
    md.size = torch.Size([1 << 38])
    md.chunks[0].sizes = torch.Size([1 << 38])
    (step4 / ".metadata").write_bytes(pickle.dumps(metadata))
    _rehash(step4, ".metadata")
    assert "claims more elements" in (verify_checkpoint(step4) or "")
    with pytest.raises(InvalidCheckpointError, match="claims more elements"):
        load_tensors(step4)
    _assert_fallback(copy, "claims more elements")


def test_a_meta_json_without_what_resume_reads_is_refused(copy: Path) -> None:
    step4 = copy / "checkpoints" / "step-4"
    meta = json.loads((step4 / "meta.json").read_text())
    del meta["layout"]
    (step4 / "meta.json").write_text(json.dumps(meta))
    _rehash(step4, "meta.json")
    _assert_fallback(copy, "layout")


# --- (iii) damage is a reason, never a traceback ------------------------------------------------

def _damage_json(rng: random.Random, data: bytes) -> bytes:
    """A field of the manifest deleted, renamed or given another type."""
    manifest = json.loads(data)
    holders: list[dict] = [manifest, manifest["files"], *manifest["files"].values()]
    holder = rng.choice(holders)
    key = rng.choice(sorted(holder))
    kind = rng.choice(["delete", "rename", "type"])
    if kind == "delete":
        del holder[key]
    elif kind == "rename":
        holder[key + rng.choice(["_", "s", "X"])] = holder.pop(key)
    else:
        holder[key] = rng.choice([None, 1.5, -1, True, "x", [], {}, [1, 2], "0" * 64,
                                  {"sha256": 1}])
    return json.dumps(manifest).encode()


def _damage_bytes(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.3:
        return data[:rng.randrange(len(data))]
    out = bytearray(data)
    for _ in range(rng.choice([1, 1, 2, 4])):
        out[rng.randrange(len(out))] = rng.randrange(256)
    return bytes(out)


def test_fuzzed_damage_is_refused_or_harmless(run: Path, tmp_path: Path) -> None:
    """100 seeded damages of step 4's manifest.json and .metadata (byte flips, truncations,
    field deletions, renames and type changes; ``.metadata`` damage mostly with the manifest
    rehashed, so that the unpickler and the metadata checks meet it): each checkpoint is either
    valid and reads back the very tensors of the undamaged one, or refused with a reason, and
    resume then falls back to step 2."""
    rng = random.Random(20261201)
    pristine = run / "checkpoints" / "step-4"
    want = load_tensors(pristine)
    run_dir = tmp_path / "fuzz"
    ckpts = run_dir / "checkpoints"
    shutil.copytree(run / "checkpoints" / "step-2", ckpts / "step-2")
    step4 = ckpts / "step-4"
    outcomes = {"valid": 0, "refused": 0}
    tracebacks = []
    start = time.process_time()
    for case in range(100):
        shutil.rmtree(step4, ignore_errors=True)
        shutil.copytree(pristine, step4)
        (run_dir / "recovery.jsonl").unlink(missing_ok=True)
        target = "manifest.json" if rng.random() < 0.4 else ".metadata"
        data = (step4 / target).read_bytes()
        if target == "manifest.json" and rng.random() < 0.6:
            (step4 / target).write_bytes(_damage_json(rng, data))
        else:
            (step4 / target).write_bytes(_damage_bytes(rng, data))
            if target == ".metadata" and rng.random() < 0.8:
                _rehash(step4, ".metadata")
        try:
            reason = verify_checkpoint(step4)
            found = find_latest_valid(ckpts, RecoveryLog(run_dir))
            if reason is None:
                outcomes["valid"] += 1
                got = load_tensors(step4)
                assert got.keys() == want.keys()
                assert all(torch.equal(got[k], want[k]) for k in want), case
                assert found is not None and found[0] == 4
            else:
                outcomes["refused"] += 1
                assert isinstance(reason, str) and reason
                assert found is not None and found[0] == 2
                events = recovery_events(run_dir)
                assert [e["event"] for e in events] == ["invalid_checkpoint", "fallback"]
        except Exception as exc:  # noqa: BLE001  (counted: the test is that there are none)
            tracebacks.append((case, target, repr(exc)))
    assert tracebacks == [], tracebacks[:5]
    assert outcomes["refused"] >= 80, outcomes
    assert time.process_time() - start < 60
