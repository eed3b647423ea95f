"""A torch.profiler trace over the profiled window, one Chrome/Perfetto JSON file per rank.

The ComputeController's tasks and the Communicator's collectives appear in it as named ranges
(``mcpar.forward(chunk 0, micro 3)``, ``mcpar.all_reduce[dp]``: ``record_function`` while the
window is open), next to the operators torch records. On CUDA the allocator's history is recorded
over the window too and dumped as a memory snapshot (``memory_snapshot_rank<r>.pickle``, for
https://pytorch.org/memory_viz), the tool for an out-of-memory.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile


class WindowTrace:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        if self.cuda:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        # profile_memory: every allocation is an event, from which the report draws the memory
        # over a step (allocated since the window opened, on this device).
        self.prof = profile(activities=activities, record_shapes=False, with_stack=False,
                            profile_memory=True)
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
        self.prof.stop()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"trace_rank{rank}.json"
        self.prof.export_chrome_trace(str(path))
        written = [path]
        self.memory = step_memory(json.loads(path.read_text()), cuda=self.cuda)
        if self.cuda:
            snap = out_dir / f"memory_snapshot_rank{rank}.pickle"
            with snap.open("wb") as out:
                pickle.dump(torch.cuda.memory._snapshot(), out, protocol=4)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snap)
        return written


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
