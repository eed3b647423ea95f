"""A torch.profiler trace over the profiled window, one Chrome/Perfetto JSON file per rank.

The ComputeController's tasks and the Communicator's collectives appear in it as named ranges
(``mcpar.forward(chunk 0, micro 3)``, ``mcpar.all_reduce[dp]``: ``record_function`` while the
window is open), next to the operators torch records. On CUDA the allocator's history is recorded
over the window too and dumped as a memory snapshot (``memory_snapshot_rank<r>.pickle``, for
https://pytorch.org/memory_viz), the tool for an out-of-memory.
"""

from __future__ import annotations

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
        self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
        self.prof.start()

    def step(self) -> None:
        self.prof.step()

    def stop(self, out_dir: Path, rank: int) -> list[Path]:
        """Stops tracing; the files written."""
        self.prof.stop()
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"trace_rank{rank}.json"
        self.prof.export_chrome_trace(str(path))
        written = [path]
        if self.cuda:
            snap = out_dir / f"memory_snapshot_rank{rank}.pickle"
            with snap.open("wb") as out:
                pickle.dump(torch.cuda.memory._snapshot(), out, protocol=4)
            torch.cuda.memory._record_memory_history(enabled=None)
            written.append(snap)
        return written
