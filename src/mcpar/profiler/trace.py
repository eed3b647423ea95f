"""A torch.profiler trace over the profiled window, one Chrome/Perfetto JSON file per rank.

The ComputeController's tasks and the Communicator's collectives appear in it as named ranges
(``mcpar.forward(chunk 0, micro 3)``, ``mcpar.all_reduce[dp]``: ``record_function`` while the
window is open), next to the operators torch records. On CUDA the allocator's history is recorded
over the window too and dumped as a memory snapshot (``memory_snapshot_rank<r>.pickle``, for
https://pytorch.org/memory_viz), the tool for an out-of-memory.

``training.profile.trace_detail`` chooses what the file keeps (:data:`KEPT_CATEGORIES`): torch
records every operator, allocation and kernel launch, tens of thousands of events for a few
steps of a tiny model, and torch.profiler has no switch that records the annotations alone, so
the trace is recorded whole (the report's memory curve reads its allocator events) and the
file written with the event categories of its level only.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from mcpar.path_checks import named, storage_errors

# The categories of the events each trace_detail level writes ("ops": all of them). Metadata
# events (process and thread names) and events without a category stay at every level.
KEPT_CATEGORIES: dict[str, frozenset[str]] = {
    "steps": frozenset({"user_annotation", "Trace"}),
    "kernels": frozenset({"user_annotation", "gpu_user_annotation", "Trace", "kernel",
                          "gpu_memcpy", "gpu_memset"}),
}
# kineto prints these two lines on stderr when a trace starts and stops (its 'USDT' markers, at
# a level above its errors, so KINETO_LOG_LEVEL cannot drop them and keep the errors).
_KINETO_MARK = re.compile(rb"^USDT:.*\] profiler_(start|stop)\s*$")

# What a probe write asks of a folder where the exporter's file came out missing or cut short:
# a trace of a few steps is larger, so a disk that refuses this much is why.
PROBE_BYTES = 1 << 20


class WindowTrace:
    def __init__(self, device: torch.device, detail: str = "steps"):
        if detail != "ops" and detail not in KEPT_CATEGORIES:
            raise ValueError(f"trace detail {detail!r}: one of steps, kernels, ops")
        self.cuda = device.type == "cuda"
        self.detail = detail
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # profile_memory: every allocation is an event, from which the report draws the memory
        # over a step (allocated since the window opened, on this device).
        self.prof = profile(activities=activities, record_shapes=False, with_stack=False,
                            profile_memory=True)
        with _without_kineto_marks():
            self.prof.start()
        self._range: torch.profiler.record_function | None = None

    def begin_step(self, step: int) -> None:
        """Opens the range ``mcpar.step#<step>`` (1-based), closed by :meth:`end_step`."""
        self._range = torch.profiler.record_function(f"mcpar.step#{step}")
        self._range.__enter__()

    def end_step(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        self.prof.step()

    def stop(self, out_dir: Path, rank: int, key: str = "--run-dir") -> list[Path]:
        """Stops tracing; the files written. :attr:`memory` is then the last traced step's
        memory over time.

        Each file is written under a temporary name and renamed into place once whole, so a
        full disk leaves no trace file looking complete; it is one line naming the file and
        ``key`` (the option that chose the folder), not a traceback or, on a worker, a restart.
        """
        if self._range is not None:  # a run that ended inside a step
            self.end_step()
        path = out_dir / f"trace_rank{rank}.json"
        raw = _temporary(path, "raw")
        with storage_errors(out_dir, key):
            try:
                # What torch prints while stopping and exporting (allocator notes, kineto's
                # 'Failed to write' on a full disk) is dropped when the export fails: the one
                # line of the error says it all.
                with _without_kineto_marks(drop_on_error=True):
                    self.prof.stop()
                    out_dir.mkdir(parents=True, exist_ok=True)
                    self.prof.export_chrome_trace(str(raw))
                    trace = _read_export(raw, path)
                self.memory = step_memory(trace, cuda=self.cuda)
                text = (raw.read_text() if self.detail == "ops" else
                        json.dumps(at_detail(trace, self.detail), separators=(",", ":")))
                _write_then_rename(path, text.encode())
            finally:
                raw.unlink(missing_ok=True)
                # kineto writes RAW.tmp and renames it; a write it could not finish stays.
                raw.with_name(raw.name + ".tmp").unlink(missing_ok=True)
            written = [path]
            if self.cuda:
                snap = out_dir / f"memory_snapshot_rank{rank}.pickle"
                _write_then_rename(snap, pickle.dumps(torch.cuda.memory._snapshot(), protocol=4))
                torch.cuda.memory._record_memory_history(enabled=None)
                written.append(snap)
        return written


def _temporary(path: Path, what: str) -> Path:
    return path.with_name(f".{path.name}.{what}-{os.getpid()}")


def _read_export(raw: Path, path: Path) -> dict[str, Any]:
    """The trace torch's exporter wrote to ``raw``. The exporter reports no failed write: a
    file missing or cut short is a full disk when a probe write there fails too (it raises
    the disk's own error, naming ``path``); else the export itself failed."""
    try:
        return json.loads(raw.read_text())
    except (OSError, ValueError) as err:
        probe = _temporary(path, "probe")
        try:
            _write_then_rename(probe, b"\0" * PROBE_BYTES, rename=False)
        except OSError as full:
            raise named(OSError(full.errno, full.strerror), path) from err
        finally:
            probe.unlink(missing_ok=True)
        raise RuntimeError(f"torch.profiler wrote no readable trace to {raw} ({err})") from err


def _write_then_rename(dest: Path, data: bytes, rename: bool = True) -> None:
    """``data`` written to a temporary name beside ``dest``, synced, then renamed to it; a
    failed write names ``dest`` and leaves neither file."""
    tmp = _temporary(dest, "tmp") if rename else dest
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if rename:
            os.replace(tmp, dest)
    except OSError as err:
        raise named(OSError(err.errno, err.strerror), dest) from err
    finally:
        if rename:
            tmp.unlink(missing_ok=True)


def at_detail(trace: dict[str, Any], detail: str) -> dict[str, Any]:
    """``trace`` with the events of ``detail``'s categories only (every event for "ops")."""
    if detail == "ops":
        return trace
    kept = KEPT_CATEGORIES[detail]
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "M" or e.get("cat") is None or e.get("cat") in kept]
    return {**trace, "traceEvents": events}


@contextlib.contextmanager
def _without_kineto_marks(drop_on_error: bool = False) -> Iterator[None]:
    """Holds back what this process writes to stderr (fd 2) during a profiler start or stop,
    then writes it all out but kineto's two marker lines (none of it when the block raised
    and ``drop_on_error``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    failed = False
    try:
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield
            except BaseException:
                failed = True
                raise
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                caught.seek(0)
                rest = [line for line in caught.read().splitlines(keepends=True)
                        if not _KINETO_MARK.match(line)]
                if rest and not (failed and drop_on_error):
                    os.write(2, b"".join(rest))
    finally:
        os.close(saved)


def step_memory(trace: dict, cuda: bool) -> list[tuple[float, float]]:
    """(ms since the step's start, bytes allocated since the trace started) over the last
    whole step of a trace (its 'mcpar.step#k' range), from the allocator's events."""
    events = trace.get("traceEvents", [])
    steps = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(
        "mcpar.step#")]
    if not steps:
        return []
    last = max(steps, key=lambda e: e["ts"])
    begin, end = last["ts"], last["ts"] + last["dur"]
    kind = 1 if cuda else 0
    return sorted(((e["ts"] - begin) / 1e3, float(e["args"]["Total Allocated"]))
                  for e in events if e.get("name") == "[memory]" and begin <= e["ts"] <= end
                  and e.get("args", {}).get("Device Type") == kind)
