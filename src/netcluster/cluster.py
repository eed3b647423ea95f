"""An emulated cluster on one machine: one network namespace per "node", joined by shaped links.

Why (DESIGN.md §6)
    Communication-bound features (gradient compression, hierarchical collectives) only show
    their worth when the link between machines is slow. Without a real cluster, each "node" is a
    Linux network namespace; its ranks talk over loopback inside it (playing NVLink) and over a
    rate-limited, delayed virtual link to the other nodes (playing the inter-node fabric).

Topology
    ::

        node 0 ns                 switch ns                  node 1 ns
        lo (intra-node)           +--------------------+      lo
        nc-n0 10.77.0.1 ==veth== nc-s0   switch   nc-s1 ==veth== nc-n1 10.77.0.2

    * one namespace per node (``<prefix>-n<k>``) and one "switch" namespace (``<prefix>-sw``),
      so the host's own network is never touched; the per-run prefix ``mcnc-<pid>-<random>``
      keeps parallel runs apart, and since every node owns its network stack, two runs can use
      the same subnet without colliding;
    * one veth pair per node, created directly inside its namespaces (never in the host's);
    * rate: ``tbf`` on BOTH ends' egress (node -> switch and switch -> node), so every node has
      ``rate`` up and ``rate`` down, as with a switched NIC. tbf lets a burst of up to its
      bucket leave at once (64 KiB here, so that GSO frames pass unsplit), which would let a
      message of that size cross an idle link in the delay alone; the forwarder below
      therefore also serializes every frame at ``rate`` (``LinkModel``), so small messages pay
      their bytes too, and tbf only gives the nodes' TCP the back-pressure a NIC gives (with
      netem, tbf's burst stays: ``describe()`` says which);
    * delay: ``delay`` is the ONE-WAY node-to-node latency (RTT = 2 x delay). With ``netem`` in
      the kernel, each hop's egress gets ``netem delay delay/2`` above its ``tbf`` and a kernel
      bridge switches the frames. Many small VMs' kernels (this one included) ship without
      ``sch_netem``; then the switch is a small user-space process in the switch namespace
      (``netcluster.forwarder``) that reads frames from the switch-side veths with
      AF_PACKET sockets, holds each until the wire would have delivered it (serialized at
      ``rate`` on the sender's uplink and the receiver's downlink, plus ``delay``), and sends
      it on. Frames travel with their virtio-net header
      (``PACKET_VNET_HDR``), so TCP's 64 KiB GSO segments cross in one piece with their checksum
      state: a few hundred frames per second at 100 Mbit/s, a few percent of one core. It runs
      at real-time priority where allowed: it plays the wire, which on a real cluster takes no
      CPU from the nodes, and at normal priority it would add the scheduler's delays to the
      link's;
    * TCP congestion control: every namespace uses ``congestion_control`` (default ``cubic``,
      the Linux default), whatever the host uses. Measured on this link with a host set to
      BBR: after a bulk phase, BBR paces every later message at its bandwidth estimate, so a
      55 KB all-to-all took 9.3 ms against 4.5 ms under cubic; results must not depend on
      such a host setting. A namespace may only pick an algorithm the host allows, so the
      first use adds it to the host's ``tcp_allowed_congestion_control`` (which changes no
      existing socket) and leaves it there.

Teardown
    Everything is removed on exit, on exceptions and on SIGINT/SIGTERM (the handlers turn the
    signal into an exception so the ``with`` block unwinds); processes started on the nodes are
    killed first. If the owner was SIGKILLed, ``python -m netcluster cleanup`` removes
    leftovers whose owner is dead (``--all``: every ``mcnc-`` namespace).

CLI
    python -m netcluster run --nodes 2 --rate 100mbit --delay 1ms --nproc-per-node 1 \\
        -- script.py args...          # torchrun on every node, exit code of the worst node
    python -m netcluster run ... -- -m mcpar.cli train --run-dir runs/x
    python -m netcluster cleanup [--all]
"""

from __future__ import annotations

import abc
import argparse
import atexit
import contextlib
import ipaddress
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from types import FrameType
from typing import TypeVar

from .host import (
    ROOT_PREFIX,
    NetClusterError,
    allow_congestion_control,
    available,
    cleanup,
    death_signal_preexec,
    kill_ns_processes,
    netem_available,
    ns_exec,
    sh,
)

DEFAULT_SUBNET = "10.77.0.0/24"
DEFAULT_CONGESTION_CONTROL = "cubic"
NODE_IF = "nc-n{k}"    # node end of node k's veth, inside node k's namespace
SWITCH_IF = "nc-s{k}"  # switch end, inside the switch namespace
DEFAULT_MASTER_PORT = 29400

_RATE_UNITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12,
               "bps": 8, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"s": 1.0, "sec": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6, "usec": 1e-6}


def parse_rate(rate: str | float) -> float:
    """``"100mbit"`` -> 1e8 bits/s (tc's units; a bare number is bits/s)."""
    if isinstance(rate, (int, float)):
        return float(rate)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", rate)
    unit = (m.group(2) or "bit").lower() if m else ""
    if m is None or unit not in _RATE_UNITS:
        raise ValueError(f"cannot parse rate {rate!r} (e.g. 100mbit, 1gbit, 20mbit)")
    return float(m.group(1)) * _RATE_UNITS[unit]


def parse_delay(delay: str | float) -> float:
    """``"1ms"`` -> 0.001 s (a bare number is seconds)."""
    if isinstance(delay, (int, float)):
        return float(delay)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", delay)
    unit = (m.group(2) or "s").lower() if m else ""
    if m is None or unit not in _TIME_UNITS:
        raise ValueError(f"cannot parse delay {delay!r} (e.g. 1ms, 500us, 0)")
    return float(m.group(1)) * _TIME_UNITS[unit]


# --- the clusters -----------------------------------------------------------------------------

_NS = TypeVar("_NS", bound="_Namespaces")


class _Namespaces(abc.ABC):
    """Owns a set of namespaces and the processes started in them; tears all down once."""

    num_nodes: int

    def __init__(self, congestion_control: str | None = DEFAULT_CONGESTION_CONTROL) -> None:
        self.prefix = f"{ROOT_PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self.congestion_control = congestion_control  # None: the host's default
        self.namespaces: list[str] = []
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed = True
        self._old_handlers: dict[int, object] = {}

    # Subclasses: which namespace runs node k, its address and the interface gloo should use.
    @abc.abstractmethod
    def node_ns(self, k: int) -> str:
        """Defined by each cluster kind."""

    @abc.abstractmethod
    def node_addr(self, k: int) -> str:
        """Defined by each cluster kind."""

    @abc.abstractmethod
    def node_ifname(self, k: int) -> str:
        """Defined by each cluster kind."""

    @abc.abstractmethod
    def _build(self) -> None:
        """Defined by each cluster kind."""

    def _add_ns(self, name: str) -> None:
        sh(["ip", "netns", "add", name])
        self.namespaces.append(name)
        ns_exec(name, "ip", "link", "set", "lo", "up")
        # No IPv6 chatter (router solicitations, DAD) on the emulated links.
        ns_exec(name, "sysctl", "-qw", "net.ipv6.conf.all.disable_ipv6=1", check=False)
        if self.congestion_control:
            allow_congestion_control(self.congestion_control)
            ns_exec(name, "sysctl", "-qw",
                f"net.ipv4.tcp_congestion_control={self.congestion_control}")

    def __enter__(self: _NS) -> _NS:
        ok, why = available()
        if not ok:
            raise NetClusterError(why)
        self._closed = False
        atexit.register(self.close)
        if threading.current_thread() is threading.main_thread():
            # SIGTERM unwinds the with-block like Ctrl-C does, so __exit__ tears down.
            for sig in (signal.SIGTERM, signal.SIGHUP):
                self._old_handlers[sig] = signal.signal(sig, self._on_signal)
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    def __exit__(self, *exc: object) -> None:
        self.close()

    def run_on_node(self, k: int, argv: Sequence[str], env: dict[str, str] | None = None,
                    **popen_kwargs: object) -> subprocess.Popen[bytes]:
        """Start ``argv`` inside node ``k``'s namespace (``ip netns exec``); ``env`` is added
        to this process's environment. The process leads its own process group and is killed
        at teardown if still running."""
        if self._closed:
            raise NetClusterError("the cluster is not set up (use it as a context manager)")
        if not 0 <= k < self.num_nodes:
            raise IndexError(f"node {k} of {self.num_nodes}")
        full_env = dict(os.environ, **(env or {}))
        popen_kwargs.setdefault("start_new_session", True)
        if threading.current_thread() is threading.main_thread():
            # The kernel ties the death signal to the forking thread: only the main thread
            # is sure to live as long as this process.
            popen_kwargs.setdefault("preexec_fn", death_signal_preexec())
        proc: subprocess.Popen[bytes] = subprocess.Popen(  # type: ignore[call-overload]
            ["ip", "netns", "exec", self.node_ns(k), *argv], env=full_env, **popen_kwargs)
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        """Kill what runs on the nodes, delete every namespace (and with it every veth)."""
        if self._closed:
            return
        self._closed = True
        held: dict[int, object] = {}
        caught: list[int] = []
        if threading.current_thread() is threading.main_thread():
            # A Ctrl-C or SIGTERM must not cut the teardown short: hold it, deliver it after.
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                held[sig] = signal.signal(sig, lambda s, _f: caught.append(s))
        try:
            self._teardown()
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            for sig, handler in self._old_handlers.items():
                signal.signal(sig, handler)  # type: ignore[arg-type]
            self._old_handlers = {}
            atexit.unregister(self.close)
        if caught:
            os.kill(os.getpid(), caught[0])

    def _teardown(self) -> None:
        for proc in self._procs:
            _terminate(proc)
        for ns in reversed(self.namespaces):
            kill_ns_processes(ns, grace_s=1.0)
            sh(["ip", "netns", "del", ns], check=False)
        self.namespaces = []


def _terminate(proc: subprocess.Popen[bytes], grace_s: float = 3.0) -> None:
    """TERM the process group of ``proc``, KILL it after ``grace_s``, and reap it."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5)


class NetCluster(_Namespaces):
    """``num_nodes`` namespaces joined through a switch by links of ``rate`` and ``delay``.

    ``delay`` is one-way node to node (RTT 2 x delay). ``delay_backend``: ``"auto"`` (netem when
    the kernel has it, else the user-space forwarder; a zero delay needs neither and uses a
    kernel bridge), ``"netem"`` or ``"forwarder"``. ``burst`` is tbf's bucket (default: 64 KiB
    or 2 ms of traffic, whichever is larger, so GSO segments pass unsplit); ``queue`` how long
    a queue tbf keeps before dropping (default 100 ms).
    """

    def __init__(self, num_nodes: int, rate: str | float = "100mbit", delay: str | float = "1ms",
                 subnet: str = DEFAULT_SUBNET, delay_backend: str = "auto",
                 burst: int | None = None, queue: str | float = "100ms",
                 congestion_control: str | None = DEFAULT_CONGESTION_CONTROL):
        super().__init__(congestion_control)
        if num_nodes < 1:
            raise ValueError("num_nodes must be at least 1")
        self.num_nodes = num_nodes
        self.rate_bps = parse_rate(rate)
        self.delay_s = parse_delay(delay)
        self.net = ipaddress.ip_network(subnet)
        if self.net.num_addresses - 2 < num_nodes:
            raise ValueError(f"subnet {subnet} has no room for {num_nodes} nodes")
        if delay_backend not in ("auto", "netem", "forwarder"):
            raise ValueError("delay_backend must be auto, netem or forwarder")
        self.requested_backend = delay_backend
        self.backend = ""  # "bridge", "netem" or "forwarder", known after setup
        self.burst = burst or max(65536 + 1514, int(self.rate_bps / 8 * 0.002))
        self.queue_s = parse_delay(queue)
        self.switch_ns = f"{self.prefix}-sw"
        self._forwarder: subprocess.Popen[bytes] | None = None

    def node_ns(self, k: int) -> str:
        return f"{self.prefix}-n{k}"

    def node_addr(self, k: int) -> str:
        return str(self.net.network_address + 1 + k)

    def node_ifname(self, k: int) -> str:
        return NODE_IF.format(k=k)

    def describe(self) -> dict[str, object]:
        """The link as configured (for a benchmark's JSON)."""
        return {"nodes": self.num_nodes, "rate_bit_s": self.rate_bps,
                "one_way_delay_s": self.delay_s, "delay_backend": self.backend,
                "tbf_burst_bytes": self.burst, "tbf_queue_s": self.queue_s,
                "frames_serialized_at_rate": self.backend == "forwarder",
                "tcp_congestion_control": self.congestion_control or "host default"}

    def _tbf(self, ns: str, dev: str, parent: list[str]) -> None:
        limit = int(self.rate_bps / 8 * self.queue_s) + self.burst
        ns_exec(ns, "tc", "qdisc", "add", "dev", dev, *parent, "tbf",
            "rate", f"{int(self.rate_bps)}bit", "burst", str(self.burst), "limit", str(limit))

    def _shape(self, ns: str, dev: str, hop_delay_s: float) -> None:
        if self.backend == "netem":
            # netem delays, its child tbf paces what comes out (tc-netem(8)'s own example).
            ns_exec(ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                f"{hop_delay_s * 1e6:.0f}us", "limit", "100000")
            self._tbf(ns, dev, ["parent", "1:1", "handle", "10:"])
        else:
            self._tbf(ns, dev, ["root", "handle", "1:"])

    def _build(self) -> None:
        if self.delay_s == 0 and self.requested_backend == "auto":
            self.backend = "bridge"
        elif self.requested_backend == "auto":
            self.backend = "netem" if netem_available() else "forwarder"
        else:
            self.backend = self.requested_backend
        if self.backend == "netem" and not netem_available():
            raise NetClusterError("this kernel has no sch_netem; use delay_backend='forwarder'")
        self._add_ns(self.switch_ns)
        if self.backend != "forwarder":
            ns_exec(self.switch_ns, "ip", "link", "add", "br0", "type", "bridge")
            ns_exec(self.switch_ns, "ip", "link", "set", "br0", "up")
        for k in range(self.num_nodes):
            ns, node_if, sw_if = self.node_ns(k), self.node_ifname(k), SWITCH_IF.format(k=k)
            self._add_ns(ns)
            # Both ends are born in their namespaces: nothing appears in the host's.
            sh(["ip", "link", "add", node_if, "netns", ns, "type", "veth",
                 "peer", "name", sw_if, "netns", self.switch_ns])
            ns_exec(ns, "ip", "addr", "add", f"{self.node_addr(k)}/{self.net.prefixlen}",
                "dev", node_if)
            ns_exec(ns, "ip", "link", "set", node_if, "up")
            if self.backend != "forwarder":
                ns_exec(self.switch_ns, "ip", "link", "set", sw_if, "master", "br0")
            ns_exec(self.switch_ns, "ip", "link", "set", sw_if, "up")
            hop = self.delay_s / 2
            self._shape(ns, node_if, hop)
            self._shape(self.switch_ns, sw_if, hop)
        if self.backend == "forwarder":
            self._start_forwarder()

    @property
    def forwarder_pid(self) -> int | None:
        """The user-space switch's process, while the cluster is up (forwarder backend)."""
        return None if self._forwarder is None else self._forwarder.pid

    def _start_forwarder(self) -> None:
        ifaces = ",".join(SWITCH_IF.format(k=k) for k in range(self.num_nodes))
        argv = ["ip", "netns", "exec", self.switch_ns, sys.executable, "-m",
                "netcluster.forwarder",
                "--delay-s", repr(self.delay_s), "--rate-bps", repr(self.rate_bps),
                "--queue-s", repr(self.queue_s), "--ifaces", ifaces]
        proc: subprocess.Popen[bytes] = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, start_new_session=True,
            preexec_fn=death_signal_preexec())
        self._forwarder = proc
        self._procs.append(proc)
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "ready <priority>" once every socket is bound
        if not line.startswith(b"ready"):
            raise NetClusterError(f"the switch forwarder did not start (exit {proc.poll()})")

    def close(self) -> None:
        super().close()
        self._forwarder = None


class LoopbackCluster(_Namespaces):
    """The same interface as ``NetCluster``, but every "node" runs in ONE unshaped namespace
    and talks over loopback: the reference for what the slow link costs."""

    def __init__(self, num_nodes: int,
                 congestion_control: str | None = DEFAULT_CONGESTION_CONTROL):
        super().__init__(congestion_control)
        self.num_nodes = num_nodes
        self.backend = "loopback"

    def node_ns(self, k: int) -> str:
        return f"{self.prefix}-lo"

    def node_addr(self, k: int) -> str:
        return "127.0.0.1"

    def node_ifname(self, k: int) -> str:
        return "lo"

    def describe(self) -> dict[str, object]:
        return {"nodes": self.num_nodes, "link": "loopback (one namespace)",
                "tcp_congestion_control": self.congestion_control or "host default"}

    def _build(self) -> None:
        self._add_ns(self.node_ns(0))


# --- CLI --------------------------------------------------------------------------------------

def _run_main(args: argparse.Namespace) -> int:
    from .torchrun import launch_torchrun  # it builds on this module

    script = list(args.script)
    if script and script[0] == "--":
        script = script[1:]
    if not script:
        print("netcluster: nothing to run (give the script after --)", file=sys.stderr)
        return 2
    with NetCluster(args.nodes, rate=args.rate, delay=args.delay, subnet=args.subnet,
                    delay_backend=args.delay_backend, burst=args.burst,
                    congestion_control=_congestion_control_arg(args.congestion_control)
                    ) as cluster:
        print(f"netcluster: {cluster.describe()}; nodes at "
              f"{[cluster.node_addr(k) for k in range(args.nodes)]}", file=sys.stderr, flush=True)
        result = launch_torchrun(cluster, args.nproc_per_node, script, timeout_s=args.timeout,
                                 echo=True, cwd=os.getcwd())
    if result.timed_out:
        print(f"netcluster: timed out after {args.timeout:.0f} s", file=sys.stderr)
    else:
        print(f"netcluster: torchrun exit codes {result.returncodes} in "
              f"{result.elapsed_s:.1f} s", file=sys.stderr)
    return result.exit_code()


def _congestion_control_arg(value: str) -> str | None:
    return None if value == "host" else value


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m netcluster",
                                description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True, metavar="{run,cleanup}")
    run = sub.add_parser("run", help="run torchrun on every node of a fresh cluster")
    run.add_argument("--nodes", type=int, default=2)
    run.add_argument("--rate", default="100mbit", help="link rate, tc units (100mbit, 1gbit)")
    run.add_argument("--delay", default="1ms", help="one-way node-to-node delay (1ms, 0)")
    run.add_argument("--subnet", default=DEFAULT_SUBNET)
    run.add_argument("--delay-backend", default="auto", choices=["auto", "netem", "forwarder"])
    run.add_argument("--burst", type=int, default=None,
                     help="tbf bucket in bytes (default: the NetCluster default)")
    run.add_argument("--congestion-control", default=DEFAULT_CONGESTION_CONTROL,
                     help="TCP congestion control of every node ('host': the host's default)")
    run.add_argument("--nproc-per-node", type=int, default=1)
    run.add_argument("--timeout", type=float, default=3600.0, help="seconds before all is killed")
    run.add_argument("script", nargs=argparse.REMAINDER, help="-- script.py args...")
    clean = sub.add_parser("cleanup", help="remove namespaces left by dead runs")
    clean.add_argument("--all", action="store_true", help="also those of runs still alive")
    args = p.parse_args(argv)
    ok, why = available()
    if not ok:
        print(f"netcluster: {why}", file=sys.stderr)
        return 2
    if args.command == "cleanup":
        removed = cleanup(all_runs=args.all)
        print(f"netcluster: removed {len(removed)}: {' '.join(removed)}" if removed
              else "netcluster: nothing to remove", file=sys.stderr)
        return 0
    try:
        return _run_main(args)
    except NetClusterError as err:
        print(f"netcluster: {err}", file=sys.stderr)
        return 1
