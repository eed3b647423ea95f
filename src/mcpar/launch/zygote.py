"""One job's workers, forked from a process that imported the worker's modules once.

Why: a worker spends 3-4 s of CPU importing torch and mcpar before its first step, and the N
workers of a local job pay it N times at once, on the same cores. The launcher
(``mcpar.launch.local``) starts this process instead: it imports ``mcpar.trainer`` once and forks
the N workers from that state (copy-on-write). Nothing here runs a torch operation or starts a
thread before forking, so each child starts as clean as a fresh interpreter: torch's thread pool
and RNG are untouched, Python's ``random`` reseeds itself in the child.

Why not ``multiprocessing``'s forkserver: it keeps one server per parent process, whose
standard streams, environment and preloaded modules are fixed at its first use; a launcher
(or a test process) starting many jobs needs each job's own streams and environment, and each
worker in a session of its own that the launcher signals by process group, as before.

Protocol: ``python -m mcpar.launch.zygote REPORT_FD -m mcpar.launch.worker RUN_DIR ...`` (the
worker's command line follows, so that ``ps`` and ``local_worker_pids`` find the job by it),
with the job's common environment; one JSON line on stdin lists each rank's own variables,
``{"ranks": [{"RANK": "0", ...}, ...]}``. Each worker names itself ``mcpar-rank<R>``
(``/proc/<pid>/comm``): its environment there is the zygote's. On REPORT_FD it writes
``start RANK PID`` for every worker, then ``exit RANK CODE`` as each one ends (CODE as
``subprocess`` gives it: negative for a signal). It leaves once every worker is reaped. Each
worker leads its own session, gets SIGKILL if this process dies (which itself dies with the
launcher), and reads its standard input from /dev/null.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import sys
from collections.abc import Callable

from mcpar.launch.local import PR_SET_NAME, WORKER_MODULE, die_with_parent, libc_prctl

COMM_PREFIX = "mcpar-rank"  # a forked worker's name in /proc/<pid>/comm, then its rank


def _become_worker(rank: int, env: dict[str, str], zygote_pid: int, report_fd: int,
                   prctl: Callable[..., int] | None) -> None:
    os.close(report_fd)
    os.setsid()
    die_with_parent(prctl, zygote_pid)
    if prctl is not None:
        prctl(PR_SET_NAME, ctypes.c_char_p(f"{COMM_PREFIX}{rank}".encode()[:15]), 0, 0, 0)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    os.environ.update(env)


def main() -> int:
    report_fd, argv = int(sys.argv[1]), sys.argv[2:]
    spec = json.loads(sys.stdin.readline())
    if argv[:2] != ["-m", WORKER_MODULE]:
        raise SystemExit(f"mcpar.launch.zygote runs {WORKER_MODULE} only, got {argv[:2]}")
    with contextlib.suppress(Exception):  # a broken install fails in the worker, reported there
        import mcpar.trainer  # noqa: F401  (the preload: what every worker would import)
    from mcpar.launch import worker

    zygote_pid, pids, prctl = os.getpid(), {}, libc_prctl()
    for rank, env in enumerate(spec["ranks"]):
        pid = os.fork()
        if pid == 0:
            _become_worker(rank, env, zygote_pid, report_fd, prctl)
            sys.argv = [worker.__file__, *argv[2:]]
            worker.main(argv[2:])  # exceptions end the child as they would `python -m`
            return 0
        pids[pid] = rank
        os.write(report_fd, f"start {rank} {pid}\n".encode())
    while pids:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            break
        if pid in pids:
            code = os.waitstatus_to_exitcode(status)  # -N for signal N, as subprocess
            os.write(report_fd, f"exit {pids.pop(pid)} {code}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
