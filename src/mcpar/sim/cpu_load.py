"""How much of this machine's cores other processes use while we measure (Linux's /proc/stat).

A local profile measured while another job kept a core busy prices this machine slow (the
all-core matmul and memory rates fall with the cores taken: 4-8x on a 2-core machine with one
foreign busy process), and every plan priced on it then misses by that much. The measurement
records the share (``localprofile.measure``) and says so when it passes ``MAX_FOREIGN_SHARE``
(``localprofile.load_local_cluster``). Where /proc/stat cannot be read (not Linux) the share is
unknown and nothing is said.
"""

from __future__ import annotations

import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

# Other processes' share of the cores above which a measurement is not trusted: a timed run
# shares its cores with them and slows by about that share, past the cost model's own error.
MAX_FOREIGN_SHARE = 0.10


def busy_cpu_s() -> float | None:
    """CPU seconds all processes on the machine have used since boot (None: unknown)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:8]]
    except (OSError, ValueError):
        return None
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process and its finished children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        usage = resource.getrusage(who)
        total += usage.ru_utime + usage.ru_stime
    return total


def foreign_share(fn: Callable[[], T]) -> tuple[T, float | None]:
    """Run ``fn``; also return the share of the cores other processes used meanwhile (None
    where the machine's CPU time cannot be read)."""
    busy0, ours0, wall0 = busy_cpu_s(), own_cpu_s(), time.monotonic()
    result = fn()
    busy1, ours1, wall1 = busy_cpu_s(), own_cpu_s(), time.monotonic()
    if busy0 is None or busy1 is None or wall1 <= wall0:
        return result, None
    cores = len(os.sched_getaffinity(0))
    return result, max(0.0, (busy1 - busy0) - (ours1 - ours0)) / (cores * (wall1 - wall0))
