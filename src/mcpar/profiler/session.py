"""The trainer's profiler hooks: MFU on every step, and a profiled window of steps.

The trainer calls :meth:`RunProfiler.before_step`, :meth:`RunProfiler.after_step` and
:meth:`RunProfiler.finish`; everything else lives here, so that the training loop keeps three
lines. Outside the window nothing is recorded and no range is opened: the Communicator and the
ComputeController's tracing flags stay off, the Communicator keeps no wait list, so a run
without ``training.profile`` pays one multiplication per step (the MFU).

Inside the window each rank keeps, per step: the ComputeController's task log, the main thread's
blocking collectives (``CommStats.waits``), the time before the first task (data loading), the
step time and the step's collective books; a torch.profiler trace runs over the window when
``training.profile.trace`` is on, its file as detailed as ``training.profile.trace_detail`` says.
At the end of the run every rank's record is gathered to rank 0, which writes
``<run_dir>/profile/`` (``report.py``).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from mcpar.profiler.mfu import (
    Peak,
    cpu_peak_cache,
    device_peak,
    measured_matmul_flops,
    mfu,
    store_cpu_peak,
    stored_cpu_peak,
)
from mcpar.profiler.report import ReportedRun
from mcpar.profiler.trace import WindowTrace

if TYPE_CHECKING:
    from mcpar.controllers.communication.controller import CommunicationController
    from mcpar.controllers.compute.controller import ComputeController
    from mcpar.models.spec import ModelSpec


class ProfiledRun(ReportedRun, Protocol):
    """What the profiler reads of the run it profiles (the Trainer is one), read-only."""

    @property
    def rank(self) -> int: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def comm(self) -> CommunicationController: ...
    @property
    def compute(self) -> ComputeController: ...


class RunProfiler:
    def __init__(self, trainer: ProfiledRun):
        self.trainer = trainer
        cfg = trainer.cfg
        prof = cfg.training.profile
        self.window = (range(prof.start_step, prof.start_step + prof.steps) if prof.enabled
                       else range(0))
        self.trace_on = prof.trace
        self.trace_detail = prof.trace_detail
        self.flops_per_token = float(trainer.spec.flops_per_token(cfg.model))
        self.peak: Peak | None = None
        self.steps: list[dict[str, Any]] = []
        self.mfu_per_step: list[float] = []
        self._t0 = 0.0
        self._trace: WindowTrace | None = None
        self.memory_over_step: list[tuple[float, float]] = []  # from the trace, when on

    @property
    def out_dir(self) -> Path:
        return self.trainer.run_dir / "profile"

    # --- hooks ---------------------------------------------------------------------------------
    def before_step(self, step: int) -> None:
        if self.peak is None:
            self.peak = self._measure_peak()
        if step + 1 == self.window.start:
            self._tracing(True)
        if self._trace is not None:
            self._trace.begin_step(step + 1)
        self._t0 = time.perf_counter()

    def after_step(self, step: int, record: dict[str, Any]) -> None:
        """Adds the step's MFU to ``record`` (before it is logged); in the window, keeps the
        step's timeline."""
        assert self.peak is not None
        record["mfu"] = mfu(self.flops_per_token, record["tokens_per_s"], self.peak)
        self.mfu_per_step.append(record["mfu"])
        if step + 1 not in self.window:
            return
        self.steps.append(self._step_record(record))
        if self._trace is not None:
            self._trace.end_step()
        if step + 1 == self.window[-1]:
            self._tracing(False)

    def finish(self, summary: dict[str, Any]) -> None:
        """Adds the run's MFU to ``summary``; writes the report if a window was profiled."""
        assert self.peak is not None or not self.mfu_per_step
        if self.peak is not None:
            per_step = self.mfu_per_step or [0.0]
            summary["mfu"] = {
                "mean": statistics.fmean(per_step),
                # The steady figure: a first step's warm-up or a step slowed by another process
                # moves the mean, not the median.
                "median": statistics.median(per_step),
                "flops_per_token": self.flops_per_token, "peak": self.peak.to_json(),
                "formula": "flops_per_token x tokens_per_s / (peak per device x devices)",
            }
        if not self.window:
            return
        self._tracing(False)  # a run shorter than its window
        if not self.steps:  # every rank ran the same steps: they all return here
            if self.trainer.rank == 0:
                print(f"mcpar: training.profile.start_step {self.window.start} is past the "
                      f"run's last step ({summary['final_step']}): no profile written; lower "
                      "training.profile.start_step", flush=True)
            return
        ranks = self._gather(self._rank_record())
        if self.trainer.rank == 0:
            from mcpar.profiler.report import write_report

            write_report(self.out_dir, ranks, summary, self.trainer)

    # --- internals -----------------------------------------------------------------------------
    def _measure_peak(self) -> Peak:
        t = self.trainer
        world = t.dims.world_size
        if t.device.type == "cuda":
            return device_peak(t.device, t.cfg.training.dtype, world)
        # A stored figure (calibrated profile, or measured once and cached) when every rank
        # has one; else every rank measures at once, as they compute during training (ranks
        # sharing cores share them here too), and rank 0 caches the mean for later runs.
        threads = torch.get_num_threads()
        stored = stored_cpu_peak(threads)
        lacking = torch.tensor([0.0 if stored else 1.0], dtype=torch.float64)
        t.comm.all_reduce(lacking, axis="world")
        if lacking.item() > 0:
            t.comm.barrier()
            stored = (measured_matmul_flops(), "")
        assert stored is not None
        total = torch.tensor([stored[0]], dtype=torch.float64)
        t.comm.all_reduce(total, axis="world")
        flops, source = float(total.item()) / world, stored[1]
        if lacking.item() > 0:
            # Every rank names the cache; only rank 0 writes it.
            flops, source = (store_cpu_peak(threads, flops) if t.rank == 0 else
                             (flops, f"fp32 matmul rate measured at start, cached at "
                              f"{cpu_peak_cache()} by rank 0; not a datasheet"))
        return Peak(flops, world, source)

    def _tracing(self, on: bool) -> None:
        t = self.trainer
        t.comm.trace_ranges = t.compute.trace_ranges = on
        t.comm.stats.waits = [] if on else None
        if on and self.trace_on and self._trace is None:
            self._trace = WindowTrace(t.device, self.trace_detail)
        elif not on and self._trace is not None:
            self._trace.stop(self.out_dir, t.rank)
            self.memory_over_step = self._trace.memory
            self._trace = None

    def _step_record(self, record: dict[str, Any]) -> dict[str, Any]:
        t = self.trainer
        start = t.compute.step_start
        waits = [(w1 - start, w2 - start) for op, _, w1, w2 in (t.comm.stats.waits or [])
                 if op != "recv"]
        return {
            "step": record["step"], "step_s": record["step_time_s"],
            "data_s": start - self._t0,
            "tasks": [{"name": r.name, "chunk": r.chunk, "micro": r.micro, "start": r.start,
                       "end": r.end} for r in t.compute.task_log],
            "waits": waits, "comm": t.comm.stats.breakdown("step"),
            "tokens_per_s": record["tokens_per_s"], "loss": record["loss"],
            "mfu": record["mfu"], "moe": record.get("moe"),
        }

    def _rank_record(self) -> dict[str, Any]:
        t = self.trainer
        axes = {row["axis"] for s in self.steps for row in s["comm"]}
        return {"rank": t.rank, "steps": self.steps,
                "axis_sizes": {a: t.comm.axis_size(a) for a in sorted(axes)},
                "peak_mem_bytes": _peak_memory(t.device),
                "memory_over_step": self.memory_over_step}

    def _gather(self, mine: dict[str, Any]) -> list[dict[str, Any]]:
        """Every rank's record, on every rank, in rank order (JSON bytes over the world)."""
        t = self.trainer
        if t.dims.world_size == 1:
            return [mine]
        data = torch.frombuffer(bytearray(json.dumps(mine).encode()), dtype=torch.uint8)
        sizes = t.comm.all_gather(torch.tensor([data.numel()], device=t.device), axis="world")
        width = int(max(int(s.item()) for s in sizes))
        padded = torch.zeros(width, dtype=torch.uint8, device=t.device)
        padded[:data.numel()] = data.to(t.device)
        rows = t.comm.all_gather(padded, axis="world")
        return [json.loads(row[:int(n.item())].cpu().numpy().tobytes().decode())
                for row, n in zip(rows, sizes, strict=True)]


def _peak_memory(device: torch.device) -> int:
    from mcpar.device import peak_memory_bytes

    return int(peak_memory_bytes(device))
