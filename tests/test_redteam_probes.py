"""bench/redteam_probes.py keeps working: a few of its probes against this checkout (each a
real ``mcpar`` command line), and its detectors of reads outside the input folder."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
# Cheap probes of four families: an HF index and a manifest naming a file outside, a worker
# count, an earlier prepare output with a stray shard name.
SUBSET = ["index_dotdot", "manifest_dotdot", "check_nproc_0", "train_nproc_1000",
          "prepare_stray_shard"]


@pytest.fixture(scope="module")
def runner(monkeypatch_module: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    # The bench's helpers are the package bench/redteam, imported with bench/ on sys.path as the
    # bench scripts import their siblings; gone from sys.modules again after this file's tests.
    monkeypatch_module.syspath_prepend(str(BENCH))
    before = set(sys.modules)
    yield importlib.import_module("redteam.runner")
    for name in set(sys.modules) - before:
        if name == "redteam" or name.startswith("redteam."):
            del sys.modules[name]


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as m:
        yield m


def test_a_subset_of_the_probes_finds_no_miss_here(tmp_path: Path) -> None:
    out = tmp_path / "probes.json"
    done = subprocess.run([sys.executable, str(BENCH / "redteam_probes.py"), "--only",
                           ",".join(SUBSET), "--out", str(out)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    body = json.loads(out.read_text())
    assert sorted(r["name"] for r in body["results"]) == sorted(SUBSET)
    for r in body["results"]:
        assert "error" not in r and "skipped" not in r, r
        assert r["rc"] == 2 and r["stderr_lines"] == 1, r
        assert not (r["traceback"] or r["hang"] or r["restarts"] or r["outside_read"]
                    or r["wrong_exit"]), r
    assert body["families"]["all"]["probes"] == len(SUBSET)


def test_a_read_in_the_sandbox_is_seen(runner, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    sandbox = tmp_path / "outside"
    sandbox.mkdir()
    for name in ("a.bin", "b.bin"):
        (sandbox / name).write_bytes(b"x" * 64)
    runner._age_sandbox(sandbox)
    assert runner._read_in_sandbox(sandbox) == []
    (sandbox / "b.bin").read_bytes()
    assert runner._read_in_sandbox(sandbox) == ["b.bin"]


def test_a_fifo_opened_for_reading_is_seen(runner, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    stop, opened, held = threading.Event(), [], []
    watcher = threading.Thread(target=runner._watch_fifos, args=([fifo], stop, opened, held))
    watcher.start()
    try:
        fd = os.open(fifo, os.O_RDONLY)  # blocks until the watcher opens the writing end
        os.close(fd)
    finally:
        stop.set()
        watcher.join()
        for w in held:
            os.close(w)
    assert opened == [str(fifo)]
