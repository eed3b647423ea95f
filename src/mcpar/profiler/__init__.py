"""The profiler: where a step's time, bytes and memory go, in a report people read.

- ``session.RunProfiler``: the trainer's hooks (MFU every step; a profiled window of a run,
  ``training.profile`` / ``mcpar profile``) writing ``<run_dir>/profile/`` (``report.py``);
- ``api``: the seed's ``MCPProfiler`` / ``CommunicationProfiler`` around a user's own loop;
- ``bandwidth``, ``mfu``, ``timeline``: the definitions the figures follow (nccl-tests'
  algbw/busbw, model FLOPs utilisation, the step-time split).
"""

from mcpar.profiler.api import CommunicationProfiler, CommunicationReport, MCPProfiler

__all__ = ["CommunicationProfiler", "CommunicationReport", "MCPProfiler"]
