"""Starting a job on an emulated cluster the way users start a multi-node job: one ``torchrun``
per node (network namespace of ``netcluster.cluster``), with a static rendezvous across the
nodes."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from .cluster import DEFAULT_MASTER_PORT, _Namespaces, _terminate


@dataclass
class TorchrunResult:
    """How each node's torchrun ended; ``output[k]`` is node k's stdout+stderr."""

    returncodes: list[int | None]
    output: list[str]
    elapsed_s: float
    timed_out: bool = False
    failed_node: int | None = None
    env: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.returncodes)

    def worker_exitcodes(self, k: int) -> list[int]:
        """Exit codes of node k's failed workers, from torchrun's failure report (torchrun
        itself exits 1 whatever its workers did; mcpar's refusals are exit 2)."""
        return [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", self.output[k])]

    def exit_code(self) -> int:
        """One code for the job: 0, 124 on timeout, else the first failed worker's own code
        (falling back to its torchrun's)."""
        if self.ok:
            return 0
        if self.timed_out:
            return 124
        k = self.failed_node if self.failed_node is not None else 0
        codes = self.worker_exitcodes(k)
        return next((c for c in codes if c), 0) or self.returncodes[k] or 1


def threads_per_worker(total_workers: int, cores: int | None = None) -> int:
    """DESIGN §5's ``max(1, cores // workers)``: all emulated nodes share this host's cores."""
    return max(1, (cores or os.cpu_count() or 1) // max(1, total_workers))


def launch_torchrun(cluster: _Namespaces, nproc_per_node: int, script_argv: Sequence[str], *,
                    master_port: int = DEFAULT_MASTER_PORT, env: dict[str, str] | None = None,
                    timeout_s: float = 600.0, echo: bool = False, cwd: str | None = None,
                    kill_grace_s: float = 5.0) -> TorchrunResult:
    """Start one ``torchrun`` per node of ``cluster`` and wait for all of them.

    Static rendezvous: node k runs ``torchrun --nnodes N --node-rank k --nproc-per-node m
    --master-addr <node 0> --master-port P``; ``script_argv`` is what follows (a script and its
    arguments, or ``-m module ...``). Every worker gets ``GLOO_SOCKET_IFNAME`` (the node's
    link: hostnames are the same in every namespace, so gloo must not guess from them),
    ``OMP_NUM_THREADS = max(1, cores // all workers)`` unless ``env`` sets it, and ``env``.
    When a node fails, or ``timeout_s`` passes, the other nodes are killed. ``echo`` copies
    every line to stderr, prefixed with its node.
    """
    total = cluster.num_nodes * nproc_per_node
    threads = threads_per_worker(total)
    base = {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1"}
    base.update(env or {})
    procs: list[subprocess.Popen[bytes]] = []
    outputs: list[list[str]] = [[] for _ in range(cluster.num_nodes)]
    readers: list[threading.Thread] = []
    lock = threading.Lock()

    def pump(k: int, stream: object) -> None:
        for raw in iter(stream.readline, b""):  # type: ignore[attr-defined]
            line = raw.decode(errors="replace")
            with lock:
                outputs[k].append(line)
                if echo:
                    sys.stderr.write(f"[node {k}] {line}")
                    sys.stderr.flush()

    start = time.monotonic()
    for k in range(cluster.num_nodes):
        node_env = dict(base, GLOO_SOCKET_IFNAME=cluster.node_ifname(k),
                        TP_SOCKET_IFNAME=cluster.node_ifname(k), NETCLUSTER_NODE=str(k))
        argv = [sys.executable, "-m", "torch.distributed.run",
                "--nnodes", str(cluster.num_nodes), "--node-rank", str(k),
                "--nproc-per-node", str(nproc_per_node),
                "--master-addr", cluster.node_addr(0), "--master-port", str(master_port),
                "--max-restarts", "0", "--monitor-interval", "0.2", *script_argv]
        proc = cluster.run_on_node(k, argv, env=node_env, stdout=subprocess.PIPE,
                                   stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=cwd)
        procs.append(proc)
        reader = threading.Thread(target=pump, args=(k, proc.stdout), daemon=True)
        reader.start()
        readers.append(reader)
    timed_out, failed = False, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [k for k, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                failed = bad[0]
                break
            if all(c == 0 for c in codes):
                break
            if time.monotonic() - start > timeout_s:
                timed_out = True
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.poll() is None:
                _terminate(p, kill_grace_s)
        for r in readers:
            r.join(5)
    return TorchrunResult([p.returncode for p in procs], ["".join(o) for o in outputs],
                          time.monotonic() - start, timed_out, failed, base)


