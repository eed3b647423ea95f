"""What the emulated link did during a run: TCP loss recovery and queue drops per node.

Why
    A step time on the emulated cluster is only meaningful if the link behaved like the link it
    stands for. A dropped frame costs a small message a retransmission timeout (200 ms at
    least on Linux) where a bulk transfer barely notices it, so a handful of drops can double
    the mean step of a latency-bound job. These counters let a benchmark's JSON say whether a
    slow run was slow on the wire or in the ranks.

The counters are the kernel's own, read inside each namespace (``/proc/net/snmp`` and
``/proc/net/netstat`` are per network namespace) and ``tc -s``'s drop count of each
interface's qdisc. A cluster is fresh per run, so the values count from its setup.
"""

from __future__ import annotations

import json
import os
import subprocess
from typing import Any

from netcluster import SWITCH_IF, LoopbackCluster, NetCluster

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
