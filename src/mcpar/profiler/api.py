"""The seed's profiler API around a user's own loop: ``MCPProfiler`` / ``CommunicationProfiler``.

    profiler = MCPProfiler(comm)            # comm: mcpar's Communicator / CommunicationController
    profiler.start_profiling()
    for batch in data: ...                  # the user's loop, collectives through ``comm``
    report = profiler.end_profiling()       # CommunicationReport
    print(report.to_markdown())
    profiler.analyze_communication_pattern()

Between start and end the Communicator's books are diffed (bytes, seconds and calls per
operation, axis and codec), the main thread's blocking collectives are kept (the exposed
communication), and, with ``trace_dir``, a torch.profiler trace runs with every collective a
named range. Figures follow the same definitions as ``mcpar profile`` (``bandwidth.py``).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mcpar.comm.communicator import Communicator
from mcpar.profiler.bandwidth import from_sent
from mcpar.profiler.trace import WindowTrace

if TYPE_CHECKING:
    from mcpar.controllers.compute.controller import ComputeController


@dataclass
class CommunicationReport:
    wall_s: float  # from start_profiling to end_profiling
    exposed_s: float  # the main thread waiting on blocking collectives
    collectives: list[dict[str, Any]] = field(default_factory=list)
    trace_files: list[str] = field(default_factory=list)
    tasks: list[dict[str, Any]] = field(default_factory=list)  # MCPProfiler's, with a compute

    @property
    def comm_time_s(self) -> float:
        return sum(c["time_s"] for c in self.collectives)

    @property
    def comm_share(self) -> float:
        """Exposed communication over wall time: the seed's 'communication share'."""
        return self.exposed_s / self.wall_s if self.wall_s > 0 else 0.0

    def bytes_by_axis(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for c in self.collectives:
            out[c["axis"]] = out.get(c["axis"], 0.0) + c["bytes"]
        return out

    def to_markdown(self) -> str:
        lines = [f"wall {self.wall_s:.3f} s; exposed communication {self.exposed_s:.3f} s "
                 f"({100 * self.comm_share:.1f}%); all collectives {self.comm_time_s:.3f} s",
                 "", "| op | axis | codec | n | calls | bytes sent | time s | algbw GB/s | "
                 "busbw GB/s |", "|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {c['op']} | {c['axis']} | {c['codec']} | {c['n']} | {c['calls']} | "
                  f"{c['bytes']:.4g} | {c['time_s']:.4f} | {c['algbw'] / 1e9:.4f} | "
                  f"{c['busbw'] / 1e9:.4f} |" for c in self.collectives]
        return "\n".join(lines) + "\n"

    __str__ = to_markdown


class CommunicationProfiler:
    """Profiles the collectives a Communicator issues between start and end."""

    def __init__(self, comm: Communicator, trace_dir: str | Path | None = None):
        self.comm = comm
        self.trace_dir = Path(trace_dir) if trace_dir is not None else None
        self.last_report: CommunicationReport | None = None
        self._before: dict[tuple[str, str, str], tuple[float, float, int]] = {}
        self._start = 0.0
        self._trace: WindowTrace | None = None

    def start_profiling(self) -> None:
        import torch

        self._before = {k: (c.bytes, c.time_s, c.calls) for k, c in self.comm.stats.total.items()}
        self.comm.stats.waits = []
        self.comm.trace_ranges = True
        if self.trace_dir is not None:
            self._trace = WindowTrace(torch.device("cpu"))
        self._start = time.perf_counter()

    def end_profiling(self) -> CommunicationReport:
        wall = time.perf_counter() - self._start
        waits = self.comm.stats.waits or []
        self.comm.stats.waits = None
        self.comm.trace_ranges = False
        files: list[str] = []
        if self._trace is not None and self.trace_dir is not None:
            files = [str(p) for p in self._trace.stop(self.trace_dir, self.comm.axis_rank("world"))]
            self._trace = None
        rows = []
        for key, c in sorted(self.comm.stats.total.items()):
            b0, t0, n0 = self._before.get(key, (0.0, 0.0, 0))
            if c.calls == n0:
                continue
            op, axis, codec = key
            n = self.comm.axis_size(axis)
            bw = from_sent(op, c.bytes - b0, c.time_s - t0, n)
            rows.append({"op": op, "axis": axis, "codec": codec, "n": n, "calls": c.calls - n0,
                         "bytes": c.bytes - b0, "time_s": c.time_s - t0,
                         "size_bytes": bw.size_bytes, "algbw": bw.algbw, "busbw": bw.busbw})
        exposed = sum(end - start for _, _, start, end in waits)
        self.last_report = CommunicationReport(wall, exposed, rows, files)
        return self.last_report

    def analyze_communication_pattern(self) -> dict[str, Any]:
        """What dominates the profiled communication, and what to try: the share of each
        operation and axis in the collectives' time and bytes."""
        report = self.last_report
        if report is None:
            raise RuntimeError("call end_profiling() first")
        total_t = report.comm_time_s or 1.0
        total_b = sum(c["bytes"] for c in report.collectives) or 1.0
        rows = sorted(({"op": c["op"], "axis": c["axis"], "time_share": c["time_s"] / total_t,
                        "bytes_share": c["bytes"] / total_b, "busbw": c["busbw"]}
                       for c in report.collectives), key=lambda r: -r["time_share"])
        advice = []
        top = rows[0] if rows else None
        if top is not None and top["op"] == "all_reduce" and top["axis"].startswith("dp"):
            advice.append("data-parallel gradient all-reduce dominates: try "
                          "controllers.communication.compression or a hierarchical topology")
        if report.comm_share > 0.3:
            advice.append(f"{100 * report.comm_share:.0f}% of the time waits on communication: "
                          "overlap more (bucket size) or communicate less")
        return {"comm_share": report.comm_share, "by_collective": rows,
                "bytes_by_axis": report.bytes_by_axis(), "advice": advice}


class MCPProfiler(CommunicationProfiler):
    """The seed's name: the communication profile, plus the ComputeController's task log of
    the last step when one is given (``report.tasks``)."""

    def __init__(self, comm: Communicator, compute: ComputeController | None = None,
                 trace_dir: str | Path | None = None):
        super().__init__(comm, trace_dir)
        self.compute = compute

    def start_profiling(self) -> None:
        if self.compute is not None:
            self.compute.trace_ranges = True
        super().start_profiling()

    def end_profiling(self) -> CommunicationReport:
        report = super().end_profiling()
        if self.compute is not None:
            self.compute.trace_ranges = False
            report.tasks = [asdict(r) for r in self.compute.task_log]
        return report
