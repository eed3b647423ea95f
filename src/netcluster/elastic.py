"""An elastic job on an emulated cluster: one ``torchrun --nnodes MIN:MAX`` per node with a
c10d rendezvous, and a node lost for good (every process in its namespace SIGKILLed).

Node 0 hosts the rendezvous store (its address is the endpoint), so it is the node that must
survive; every other node may be lost. ``--local-addr`` gives each agent its node's address:
hostnames are the same in every namespace, and the workers' ``MASTER_ADDR`` is the rank-0
agent's address.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from .cluster import DEFAULT_MASTER_PORT, _Namespaces, _terminate
from .host import sh
from .torchrun import threads_per_worker


class ElasticJob:
    """The nodes' torchrun agents, their output, and the means to lose a node and to bring it
    back."""

    def __init__(self, cluster: _Namespaces, nproc_per_node: int, script_argv: Sequence[str],
                 *, min_nodes: int = 1, max_restarts: int = 3,
                 rdzv_port: int = DEFAULT_MASTER_PORT, last_call_s: int = 1,
                 env: dict[str, str] | None = None, cwd: str | None = None,
                 echo: bool = False) -> None:
        self.cluster = cluster
        total = cluster.num_nodes * nproc_per_node
        threads = threads_per_worker(total)
        base = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
                "PYTHONUNBUFFERED": "1", **(env or {})}
        self.outputs: list[list[str]] = [[] for _ in range(cluster.num_nodes)]
        self.times: list[list[float]] = [[] for _ in range(cluster.num_nodes)]  # per line
        self._lock = threading.Lock()
        self.procs: list[subprocess.Popen[bytes]] = []
        self.lost: set[int] = set()
        self._start = dict(nproc_per_node=nproc_per_node, script_argv=list(script_argv),
                           min_nodes=min_nodes, max_restarts=max_restarts, rdzv_port=rdzv_port,
                           last_call_s=last_call_s, env=base, cwd=cwd, echo=echo)
        for k in range(cluster.num_nodes):
            self.procs.append(self._launch(k))

    def _launch(self, k: int) -> subprocess.Popen[bytes]:
        """Node ``k``'s torchrun agent, its output pumped into ``outputs[k]``."""
        o = self._start
        cluster = self.cluster
        node_env = dict(o["env"], GLOO_SOCKET_IFNAME=cluster.node_ifname(k),
                        TP_SOCKET_IFNAME=cluster.node_ifname(k), NETCLUSTER_NODE=str(k))
        argv = [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", f"{o['min_nodes']}:{cluster.num_nodes}",
                "--nproc-per-node", str(o["nproc_per_node"]),
                "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"{cluster.node_addr(0)}:{o['rdzv_port']}",
                "--rdzv-id", "netcluster-elastic",
                # After the fewest nodes have joined, wait this long for the others; node 0
                # hosts the store (its address is no hostname's: say so). A node without a
                # heartbeat for 1 s x 5 is dropped from the rendezvous (the default, 5 s x 3,
                # makes the nodes left wait 15 s for the dead one).
                "--rdzv-conf", f"last_call_timeout={o['last_call_s']},join_timeout=120,"
                f"keep_alive_interval=1,keep_alive_max_attempt=5,is_host={int(k == 0)}",
                "--local-addr", cluster.node_addr(k),
                "--max-restarts", str(o["max_restarts"]), "--monitor-interval", "0.2",
                *o["script_argv"]]
        proc = cluster.run_on_node(k, argv, env=node_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   cwd=o["cwd"])
        threading.Thread(target=self._pump, args=(k, proc.stdout, o["echo"]),
                         daemon=True).start()
        return proc

    def restart_node(self, k: int) -> float:
        """Start node ``k``'s agent again after it was lost (the node came back): its agent
        joins the running rendezvous, which the others' agents answer by a new round on the
        larger world; the monotonic time of the start."""
        if k not in self.lost:
            raise ValueError(f"node {k} was not lost")
        self.lost.discard(k)
        when = time.monotonic()
        self.procs[k] = self._launch(k)
        return when

    def _pump(self, k: int, stream: object, echo: bool) -> None:
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode(errors="replace")
            with self._lock:
                self.outputs[k].append(line)
                self.times[k].append(time.monotonic())
            if echo:
                sys.stderr.write(f"[node {k}] {line}")
                sys.stderr.flush()

    def output(self, k: int, since: float | None = None) -> str:
        """Node ``k``'s output; with ``since`` (a monotonic time), the lines that came after
        it, each prefixed with its seconds since then."""
        with self._lock:
            if since is None:
                return "".join(self.outputs[k])
            return "".join(f"{t - since:+7.2f} {line}" for t, line in
                           zip(self.times[k], self.outputs[k], strict=True) if t >= since)

    def kill_node(self, k: int) -> float:
        """SIGKILL every process of node ``k`` (its agent and its workers), for good; the
        monotonic time of the kill."""
        if k == 0:
            raise ValueError("node 0 hosts the rendezvous store; lose another node")
        ns = self.cluster.node_ns(k)
        when = time.monotonic()
        for _ in range(20):  # until the namespace runs nothing (a worker may be forking)
            pids = [int(p) for p in sh(["ip", "netns", "pids", ns], check=False).stdout.split()
                    if p.isdigit() and int(p) != os.getpid()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)
        self.procs[k].wait(10)
        self.lost.add(k)
        return when

    def wait(self, timeout_s: float) -> list[int | None]:
        """Wait for the nodes not lost to end (killing all at ``timeout_s``); their exit codes
        (None: still running at the timeout)."""
        deadline = time.monotonic() + timeout_s
        alive = [p for k, p in enumerate(self.procs) if k not in self.lost]
        while time.monotonic() < deadline and any(p.poll() is None for p in alive):
            time.sleep(0.2)
        codes = [p.poll() for p in self.procs]
        self.close()
        return codes

    def close(self) -> None:
        for p in self.procs:
            _terminate(p, 3.0)
