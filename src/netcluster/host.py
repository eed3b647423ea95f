"""The host side of an emulated cluster: running ``ip`` / ``tc``, probing what the kernel can
do, and removing what a dead run left behind.

Split from ``netcluster.cluster``, which builds the clusters on top of these helpers.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

ROOT_PREFIX = "mcnc-"
_TCP_SYSCTL = "/proc/sys/net/ipv4/tcp_{}_congestion_control"


class NetClusterError(RuntimeError):
    """Setting up the emulated cluster failed (the message names the command)."""


def sh(argv: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetClusterError(f"`{' '.join(argv)}` failed ({proc.returncode}): "
                              f"{(proc.stderr or proc.stdout).strip()}")
    return proc


def allow_congestion_control(algorithm: str) -> None:
    """Let network namespaces pick ``algorithm`` (loading its module if it is one)."""
    def listed(kind: str) -> list[str]:
        with open(_TCP_SYSCTL.format(kind)) as f:
            return f.read().split()

    if algorithm not in listed("available"):
        sh(["modprobe", f"tcp_{algorithm}"], check=False)
        if algorithm not in listed("available"):
            raise NetClusterError(
                f"TCP congestion control {algorithm!r} is not available on this kernel "
                f"(available: {' '.join(listed('available'))}); choose one of those")
    allowed = listed("allowed")
    if algorithm not in allowed:
        with open(_TCP_SYSCTL.format("allowed"), "w") as f:
            f.write(" ".join([*allowed, algorithm]))


def ns_exec(ns: str, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return sh(["ip", "netns", "exec", ns, *argv], check=check)


def list_namespaces() -> list[str]:
    """Names of all named network namespaces (``ip netns list``)."""
    out = sh(["ip", "netns", "list"], check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def kill_ns_processes(ns: str, grace_s: float = 2.0) -> None:
    """Stop every process still running inside ``ns`` (TERM, then KILL)."""
    def pids() -> list[int]:
        out = sh(["ip", "netns", "pids", ns], check=False).stdout.split()
        return [int(p) for p in out if p.isdigit() and int(p) != os.getpid()]

    found = pids()
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while found and time.monotonic() < deadline:
        time.sleep(0.05)
        found = pids()
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def cleanup(all_runs: bool = False) -> list[str]:
    """Delete leftover namespaces (and anything with the prefix in the host namespace).

    By default only runs whose owner process is gone (its pid is in the name); ``all_runs``
    removes every ``mcnc-`` namespace, live runs included. Returns the names removed.
    """
    removed = []
    for ns in list_namespaces():
        if not ns.startswith(ROOT_PREFIX):
            continue
        m = re.match(re.escape(ROOT_PREFIX) + r"(\d+)-", ns)
        if not all_runs and m is not None and pid_alive(int(m.group(1))):
            continue
        kill_ns_processes(ns)
        sh(["ip", "netns", "del", ns], check=False)
        removed.append(ns)
    # Links are created inside the run's namespaces, so none should be here; a crash of an
    # older version could have left one.
    for line in sh(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1 and parts[1].strip().split("@")[0].startswith(ROOT_PREFIX):
            name = parts[1].strip().split("@")[0]
            sh(["ip", "link", "del", name], check=False)
            removed.append(name)
    return removed


_AVAILABLE: tuple[bool, str] | None = None
_NETEM: bool | None = None


def available() -> tuple[bool, str]:
    """Can this process build a cluster? ``(True, "")`` or ``(False, why)``; probed once."""
    global _AVAILABLE
    if _AVAILABLE is not None:
        return _AVAILABLE
    if not sys.platform.startswith("linux"):
        _AVAILABLE = (False, "network namespaces need Linux")
    elif os.geteuid() != 0:
        _AVAILABLE = (False, "network namespaces need root (run as root or in a root container)")
    elif shutil.which("ip") is None or shutil.which("tc") is None:
        _AVAILABLE = (False, "`ip` and `tc` (iproute2) are not installed")
    else:
        probe = f"{ROOT_PREFIX}{os.getpid()}-probe{secrets.token_hex(2)}"
        try:
            sh(["ip", "netns", "add", probe])
            sh(["ip", "-n", probe, "link", "add", "p0", "type", "veth", "peer", "name", "p1"])
            ns_exec(probe, "tc", "qdisc", "add", "dev", "p0", "root", "tbf", "rate", "10mbit",
                "burst", "32kb", "latency", "50ms")
            _AVAILABLE = (True, "")
        except (NetClusterError, OSError, subprocess.SubprocessError) as err:
            _AVAILABLE = (False, f"cannot build a namespace with a shaped veth: {err}")
        finally:
            sh(["ip", "netns", "del", probe], check=False)
    return _AVAILABLE


def netem_available() -> bool:
    """Whether the kernel has ``sch_netem`` (probed once, in a scratch namespace)."""
    global _NETEM
    if _NETEM is None:
        probe = f"{ROOT_PREFIX}{os.getpid()}-netem{secrets.token_hex(2)}"
        try:
            sh(["ip", "netns", "add", probe])
            _NETEM = ns_exec(probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem", "delay",
                         "1ms", check=False).returncode == 0
        except (NetClusterError, OSError, subprocess.SubprocessError):
            _NETEM = False
        finally:
            sh(["ip", "netns", "del", probe], check=False)
    return _NETEM


def death_signal_preexec() -> Callable[[], None] | None:
    """preexec_fn: the child gets SIGKILL when this process dies (Linux prctl)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None

    def preexec() -> None:
        prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG

    return preexec
