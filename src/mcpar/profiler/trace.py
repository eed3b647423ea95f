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

    def stop(self, out_dir: Path, rank: int) -> list[Path]:
        """Stops tracing; the files written. :attr:`memory` is then the last traced step's
        memory over time."""
        if self._range is not None:  # a run that ended inside a step
            self.end_step()
        with _without_kineto_marks():
            self.prof.stop()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"trace_rank{rank}.json"
        self.prof.export_chrome_trace(str(path))
        written = [path]
        trace = json.loads(path.read_text())
        self.memory = step_memory(trace, cuda=self.cuda)
        if self.detail != "ops":
            path.write_text(json.dumps(at_detail(trace, self.detail), separators=(",", ":")))
        if self.cuda:
            snap = out_dir / f"memory_snapshot_rank{rank}.pickle"
            with snap.open("wb") as out:
                pickle.dump(torch.cuda.memory._snapshot(), out, protocol=4)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snap)
        return written


def at_detail(trace: dict[str, Any], detail: str) -> dict[str, Any]:
    """``trace`` with the events of ``detail``'s categories only (every event for "ops")."""
    if detail == "ops":
        return trace
    kept = KEPT_CATEGORIES[detail]
    events = [e for e in trace.get("traceEvents", [])
              if e.get("ph") == "M" or e.get("cat") is None or e.get("cat") in kept]
    return {**trace, "traceEvents": events}


@contextlib.contextmanager
def _without_kineto_marks() -> Iterator[None]:
    """Holds back what this process writes to stderr (fd 2) during a profiler start or stop,
    then writes it all out but kineto's two marker lines."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as caught:
            os.dup2(caught.fileno(), 2)
            try:
                yield
            finally:
                sys.stderr.flush()
                os.dup2(saved, 2)
                caught.seek(0)
                rest = [line for line in caught.read().splitlines(keepends=True)
                        if not _KINETO_MARK.match(line)]
                if rest:
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
