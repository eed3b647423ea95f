"""What the emulated link did during a run: TCP loss recovery and queue drops per node.

Why
    A step time on the emulated cluster is only meaningful if the link behaved like the link it
    stands for. A dropped frame costs a small message a retransmission timeout (200 ms at
    least on Linux) where a bulk transfer barely notices it, so a handful of drops can double
    the mean step of a latency-bound job. These counters let a benchmark's JSON say whether a
    slow run was slow on the wire or in the ranks; ``WireMonitor`` and ``wire_tx_bytes`` say
    how many bytes really crossed a node's link.

The counters are the kernel's own, read inside each namespace (``/proc/net/snmp`` and
``/proc/net/netstat`` are per network namespace) and ``tc -s``'s drop count of each
interface's qdisc. A cluster is fresh per run, so the values count from its setup.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

from .cluster import SWITCH_IF, LoopbackCluster, NetCluster

# Tcp (snmp) and TcpExt (netstat) fields that say how TCP recovered from losses.
TCP_FIELDS = ("RetransSegs",)
TCP_EXT_FIELDS = ("TCPTimeouts", "TCPLossProbes", "TCPFastRetrans", "TCPSpuriousRTOs",
                  "TCPSlowStartRetrans", "TCPOFOQueue", "DelayedACKs")


def _read_in_ns(ns: str, path: str) -> str:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", path], capture_output=True,
                         text=True, check=False)
    return out.stdout


def _proc_net_table(text: str, prefix: str) -> dict[str, int]:
    """``/proc/net/snmp``-style text: a header line and a value line per protocol prefix."""
    rows = [line.split() for line in text.splitlines() if line.startswith(prefix + ":")]
    if len(rows) < 2:
        return {}
    names, values = rows[0][1:], rows[1][1:]
    table: dict[str, int] = {}
    for name, value in zip(names, values, strict=False):
        try:
            table[name] = int(value)
        except ValueError:
            continue
    return table


def tcp_counters(ns: str) -> dict[str, int]:
    """The loss-recovery counters of namespace ``ns`` (missing ones are left out)."""
    tcp = _proc_net_table(_read_in_ns(ns, "/proc/net/snmp"), "Tcp")
    ext = _proc_net_table(_read_in_ns(ns, "/proc/net/netstat"), "TcpExt")
    counters = {k: tcp[k] for k in TCP_FIELDS if k in tcp}
    counters.update({k: ext[k] for k in TCP_EXT_FIELDS if k in ext})
    return counters


def qdisc_drops(ns: str, dev: str) -> int | None:
    """Frames the qdiscs on ``dev`` in ``ns`` dropped (tbf's queue full), or None if unknown."""
    out = subprocess.run(["tc", "-n", ns, "-s", "-j", "qdisc", "show", "dev", dev],
                         capture_output=True, text=True, check=False)
    try:
        return sum(int(q.get("drops", 0)) for q in json.loads(out.stdout))
    except (ValueError, TypeError, AttributeError):
        return None


def process_cpu_s(pid: int) -> float | None:
    """User + system CPU seconds process ``pid`` has used, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def link_health(cluster: NetCluster | LoopbackCluster) -> dict[str, Any]:
    """Per node: TCP loss recovery in its namespace and drops on both ends of its link; and
    the CPU the user-space switch has used, which an emulated wire takes from the cores the
    ranks share (a real link takes none)."""
    health: dict[str, Any] = {}
    if isinstance(cluster, NetCluster) and cluster.forwarder_pid is not None:
        health["forwarder_cpu_s"] = process_cpu_s(cluster.forwarder_pid)
    for k in range(cluster.num_nodes):
        entry: dict[str, Any] = {"tcp": tcp_counters(cluster.node_ns(k)),
                                 "node_qdisc_drops": qdisc_drops(cluster.node_ns(k),
                                                                 cluster.node_ifname(k))}
        if isinstance(cluster, NetCluster):
            entry["switch_qdisc_drops"] = qdisc_drops(cluster.switch_ns, SWITCH_IF.format(k=k))
        health[f"node{k}"] = entry
    return health


class WireMonitor(threading.Thread):
    """Reads node 0's link counter each time rank 0 logs a step to metrics.jsonl.

    mcpar's ``comm_bytes`` counts logical bytes over all collectives; this says what really
    crossed the slow link during the measured steps (e.g. a hierarchical all-reduce sends less
    between nodes than a flat one of the same logical size). The counter is read through
    ``/proc/<pid>/net/dev`` of a process inside node 0's namespace, a plain file read from
    here. Step boundaries are seen within one poll (20 ms), which the window amortizes.
    """

    def __init__(self, pid: int, ifname: str, metrics: Path, interval_s: float = 0.02):
        super().__init__(daemon=True)
        self.netdev = Path(f"/proc/{pid}/net/dev")
        self.ifname, self.metrics, self.interval_s = ifname, metrics, interval_s
        self.samples: dict[int, int] = {}  # 1-based step -> tx bytes when its line appeared
        self._stop_event = threading.Event()

    def tx_bytes(self) -> int | None:
        try:
            for line in self.netdev.read_text().splitlines():
                name, _, rest = line.partition(":")
                if name.strip() == self.ifname:
                    return int(rest.split()[8])
        except (OSError, ValueError, IndexError):
            return None
        return None

    def run(self) -> None:
        offset, pending = 0, ""
        while not self._stop_event.wait(self.interval_s):
            try:
                with open(self.metrics, encoding="utf-8") as f:
                    f.seek(offset)
                    chunk = f.read()
            except OSError:
                continue
            if not chunk:
                continue
            offset += len(chunk.encode())
            tx = self.tx_bytes()
            pending += chunk
            *lines, pending = pending.split("\n")
            for line in lines:
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    if tx is not None:
                        self.samples[int(json.loads(line)["step"])] = tx

    def stop(self) -> None:
        self._stop_event.set()
        self.join(5)

    def per_step(self, first: int, last: int) -> float | None:
        """Mean bytes sent per step over steps first..last (needs the sample of first - 1)."""
        if first - 1 in self.samples and last in self.samples and last >= first:
            return (self.samples[last] - self.samples[first - 1]) / (last - first + 1)
        return None


def wire_tx_bytes(cluster: Any, k: int) -> int | None:
    """Bytes node k's link interface has sent (the cluster is fresh: since setup)."""
    if not isinstance(cluster, NetCluster):
        return None
    out = subprocess.run(["ip", "-n", cluster.node_ns(k), "-j", "-s", "link", "show", "dev",
                          cluster.node_ifname(k)], capture_output=True, text=True, check=False)
    try:
        return int(json.loads(out.stdout)[0]["stats64"]["tx"]["bytes"])
    except (ValueError, LookupError, TypeError):
        return None
