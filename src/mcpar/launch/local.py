"""Local multi-process launcher: ``mcpar train --nproc N`` starts, watches and restarts a job.

Why not ``torch.distributed.elastic`` (what ``torchrun`` runs on)? Three things mcpar needs that it
does not give cheaply:

* exact per-rank failure reports: the user is told which rank died first and why (the exception
  summary from that rank's error file, or the signal that killed it), not the cascade of peers that
  failed afterwards because a collective lost a member;
* fast teardown: once one rank is gone the others are signalled at once and killed after a short
  grace period, so a dead job stops within seconds instead of waiting on rendezvous timeouts;
* a restart policy that fits mcpar's fault recovery: after a failure the whole job is torn down
  and started again (``max_restarts`` times at most) with ``MCPAR_RESTART_COUNT`` set, and the
  workers resume from the newest valid checkpoint themselves; an elastic agent restarting on its
  own would fight that.

mcpar's own workers (``-m mcpar.launch.worker``) are forked by one ``mcpar.launch.zygote``
process per start of the job, which imported torch and mcpar once, instead of N fresh
interpreters importing them at once on the same cores (3-4 s of CPU each);
``MCPAR_FORK_WORKERS=0`` starts fresh ones.

Under ``torchrun`` or SLURM the CLI does not launch anything: ``mcpar.launch.env.detect_env``
reads what those launchers set and the workers use it as is.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType

from mcpar.errors import UserError
from mcpar.launch.env import find_free_port

WORKER_MODULE = "mcpar.launch.worker"  # what ``mcpar train`` runs, by module name


@dataclass
class WorkerFailure:
    """How one rank ended when it was not a clean exit."""

    rank: int
    exitcode: int | None
    signal_name: str | None
    error: str | None  # first line of the error the rank recorded, if it recorded one
    # The problems of a user error (bad config, path, layout) the rank found: the job stops
    # with exit 2 and is not restarted, which could only find the same problems again.
    user_errors: list[str] | None = None

    def describe(self) -> str:
        if self.signal_name is not None:
            text = f"rank {self.rank} was killed by signal {self.signal_name}"
        else:
            text = f"rank {self.rank} exited with code {self.exitcode}"
        return f"{text}: {self.error}" if self.error else text


class LaunchFailed(Exception):
    """A worker failed; ``failure`` is the first failure seen, the likely root cause."""

    def __init__(self, failure: WorkerFailure):
        super().__init__(failure.describe())
        self.failure = failure


PR_SET_PDEATHSIG, PR_SET_NAME = 1, 15  # prctl(2) options


def libc_prctl() -> Callable[..., int] | None:
    """libc's prctl, or None off Linux. Resolve it before forking: loading a library in the
    child of a threaded parent can hang."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def die_with_parent(prctl: Callable[..., int] | None, parent: int) -> None:
    """In a forked child: the kernel SIGKILLs it when the thread that forked it dies; if the
    parent died before that took effect, no signal will come: leave now."""
    if prctl is not None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def _death_signal_preexec() -> Callable[[], None] | None:
    """Build a preexec_fn that makes the kernel SIGKILL the worker if the launcher dies.

    The kernel ties this to the thread that forked; launch_local blocks that thread until every
    worker is reaped, so it outlives them unless the launcher process itself dies.
    """
    prctl = libc_prctl()
    if prctl is None:
        return None
    parent = os.getpid()
    return lambda: die_with_parent(prctl, parent)


def _read_error(path: str) -> tuple[str | None, list[str] | None]:
    """(first line of the recorded error, the user error's problems if it was one)."""
    try:
        with open(path, encoding="utf-8") as f:
            record = json.load(f)
        error, problems = record.get("error"), record.get("user_errors")
    except (OSError, ValueError, AttributeError):
        return None, None
    if not isinstance(problems, list):
        problems = None
    return (str(error).splitlines()[0] if error else None,
            [str(p) for p in problems] if problems else None)


def _failure(rank: int, code: int, error_file: str) -> WorkerFailure:
    sig_name = None
    if code < 0:
        try:
            sig_name = signal.Signals(-code).name
        except ValueError:
            sig_name = f"signal {-code}"
    error, user_errors = _read_error(error_file)
    return WorkerFailure(rank, None if code < 0 else code, sig_name, error, user_errors)


def _pick_first(failures: list[WorkerFailure]) -> WorkerFailure:
    # Failures seen in the same poll: a rank that was killed or recorded an error is the likely
    # cause; ranks that merely exited non-zero usually did so because that peer vanished.
    return min(failures, key=lambda f: (f.signal_name is None and f.error is None, f.rank))


def _name_stalled_ranks(first: WorkerFailure, procs: list[Worker],
                        err_files: list[str], poll_interval_s: float,
                        settle_s: float = 2.0) -> WorkerFailure:
    """A collective timed out: the ranks of the job that did not time out themselves are the
    ones that stalled (or died first). Peers blocked in the same collective time out within
    moments of each other, so their records are given ``settle_s`` to arrive."""
    deadline = time.monotonic() + settle_s
    timed_out: set[int] = set()
    while True:
        timed_out = {r for r, f in enumerate(err_files)
                     if "timed out" in (_read_error(f)[0] or "")}
        alive = [r for r, p in enumerate(procs) if p.poll() is None and r not in timed_out]
        if not alive or time.monotonic() >= deadline:
            break
        time.sleep(poll_interval_s)
    stalled = [r for r in range(len(procs)) if r not in timed_out]
    if not stalled:
        return first
    note = f"; rank(s) {stalled} never timed out: they stalled or failed first"
    return dataclasses.replace(first, error=(first.error or "") + note)


def local_worker_pids(run_dir: str | os.PathLike[str],
                      first_start_only: bool = False) -> dict[int, int]:
    """RANK -> pid of the live local workers of the job whose run directory is ``run_dir``
    (fault drills and their tests kill them): ``mcpar.launch.worker`` and the run dir in the
    command line, not a zombie, the rank from ``RANK`` in the environment a fresh worker was started
    with or from the name (``mcpar-rank<R>``) a forked one gives itself; the zygote (no rank)
    and processes a worker forked (their parent matches too) are left out.
    ``first_start_only``: only workers of the job's first start (``MCPAR_RESTART_COUNT`` 0)."""
    candidates: dict[int, tuple[int, int]] = {}  # pid -> (ppid, rank)
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"{entry.path}/cmdline", "rb") as f:
                cmdline = f.read().split(b"\0")
            if WORKER_MODULE.encode() not in cmdline or os.fsencode(run_dir) not in cmdline:
                continue
            with open(f"{entry.path}/stat") as f:
                stat = f.read()
            comm = stat[stat.index("(") + 1:stat.rindex(")")]
            fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
            with open(f"{entry.path}/environ", "rb") as f:
                environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if fields[0] == "Z" or (first_start_only and environ.get(b"MCPAR_RESTART_COUNT", b"0")
                                not in (b"", b"0")):
            continue
        if b"RANK" in environ:
            rank = int(environ[b"RANK"])
        elif comm.startswith("mcpar-rank") and comm[len("mcpar-rank"):].isdigit():
            rank = int(comm[len("mcpar-rank"):])
        else:
            continue
        candidates[int(entry.name)] = (int(fields[1]), rank)
    return {rank: pid for pid, (ppid, rank) in candidates.items() if ppid not in candidates}


class _ForkedJob:
    """The workers of one job, forked by one ``mcpar.launch.zygote`` process (see there why):
    its report pipe tells each rank's pid and exit code."""

    def __init__(self, nproc: int, argv: list[str], base: dict[str, str],
                 rank_envs: list[dict[str, str]], preexec: Callable[[], None] | None):
        read_fd, write_fd = os.pipe()
        try:
            self.zygote = subprocess.Popen(
                [sys.executable, "-m", "mcpar.launch.zygote", str(write_fd), *argv], env=base,
                stdin=subprocess.PIPE, start_new_session=True, preexec_fn=preexec,
                pass_fds=(write_fd,))
        finally:
            os.close(write_fd)
        self._fd, self._pending = read_fd, b""
        self.pids: list[int | None] = [None] * nproc
        self.codes: list[int | None] = [None] * nproc
        assert self.zygote.stdin is not None
        with contextlib.suppress(BrokenPipeError):
            self.zygote.stdin.write(json.dumps({"ranks": rank_envs}).encode() + b"\n")
            self.zygote.stdin.close()
        while None in self.pids and self.pump(block=True):
            pass

    def pump(self, block: bool) -> bool:
        """Read what the zygote reported; False once it has closed the pipe."""
        if self._fd < 0:
            return False
        if not block and not select.select([self._fd], [], [], 0)[0]:
            return True
        data = os.read(self._fd, 65536)
        if not data:  # the zygote is gone: its workers were killed with it (PDEATHSIG)
            os.close(self._fd)
            self._fd = -1
            self.codes = [-int(signal.SIGKILL) if c is None else c for c in self.codes]
            return False
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            what, rank, value = line.split()
            (self.pids if what == b"start" else self.codes)[int(rank)] = int(value)
        return True

    def close(self) -> None:
        while self.pump(block=True):
            pass
        self.zygote.wait()


class _ForkedWorker:
    """One rank of a ``_ForkedJob``, with the part of ``Popen``'s interface the launcher uses."""

    def __init__(self, job: _ForkedJob, rank: int):
        self.job, self.rank = job, rank

    @property
    def pid(self) -> int | None:
        return self.job.pids[self.rank]

    def poll(self) -> int | None:
        self.job.pump(block=False)
        return self.job.codes[self.rank]

    def wait(self) -> int:
        while self.job.codes[self.rank] is None and self.job.pump(block=True):
            pass
        code = self.job.codes[self.rank]
        assert code is not None
        return code


Worker = subprocess.Popen | _ForkedWorker
# What signal.signal takes and gives back: a function, SIG_DFL / SIG_IGN, or None (not set from
# Python).
_SignalHandler = Callable[[int, FrameType | None], object] | int | None


def _signal_group(proc: Worker, sig: int) -> None:
    # Each worker leads its own process group, so this also reaches processes it started.
    if proc.pid is None:  # never started
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _teardown(procs: list[Worker], kill_grace_s: float) -> None:
    for p in procs:
        _signal_group(p, signal.SIGTERM)
    deadline = time.monotonic() + kill_grace_s
    while any(p.poll() is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.02)
    for p in procs:
        # Even exited leaders may have left children in their group; SIGKILL reaches those too.
        _signal_group(p, signal.SIGKILL)
    for p in procs:
        p.wait()


# Starts tried again when the rendezvous port was taken before rank 0 could listen on it.
PORT_RETRIES = 3


def port_taken(failure: WorkerFailure) -> bool:
    """Whether a start failed because the rendezvous port the launcher picked (free when it
    looked, ``find_free_port``) was taken by another process before rank 0 bound it: the job
    never began, so starting again on another port loses nothing."""
    return "EADDRINUSE" in (failure.error or "")


def launch_local(nproc: int, argv: list[str], env: dict[str, str] | None = None,
                 poll_interval_s: float = 0.1, kill_grace_s: float = 3.0, max_restarts: int = 0,
                 on_restart: Callable[[int, WorkerFailure], None] | None = None,
                 stop_grace_s: float | None = None) -> None:
    """Run ``nproc`` workers ``[sys.executable, *argv]`` on this host and wait for all of them.

    Returns when every worker exits 0. A start whose rendezvous port another process took
    first is made again on a new port (``PORT_RETRIES`` times), which is not a restart. When a
    worker fails, all others are stopped; if fewer than ``max_restarts`` restarts happened,
    ``on_restart(attempt, failure)`` is called and the whole job starts again with
    ``MCPAR_RESTART_COUNT=attempt``; otherwise ``LaunchFailed`` is raised with the first
    failure. If the launcher gets SIGINT/SIGTERM the workers are stopped
    too (never restarted) and ``KeyboardInterrupt`` / ``SystemExit(128 + signum)`` is raised.
    Workers get SIGTERM, then SIGKILL after ``kill_grace_s`` when a peer failed, or after
    ``stop_grace_s`` (default ``kill_grace_s``) when the launcher was stopped: time for them to
    save a checkpoint.
    """
    if nproc < 1:
        raise UserError(f"--nproc: must be at least 1, got {nproc}")
    attempt = 0
    port_retries = 0
    while True:
        try:
            _launch_once(nproc, argv, env, poll_interval_s, kill_grace_s, attempt,
                         kill_grace_s if stop_grace_s is None else stop_grace_s)
            return
        except LaunchFailed as failed:
            if port_taken(failed.failure) and port_retries < PORT_RETRIES:
                # Nothing ran: the same start again on a new port, not a restart.
                port_retries += 1
                continue
            # A diverged run would replay the same numbers from its checkpoint: no restart.
            diverged = (failed.failure.error or "").startswith("TrainingDiverged")
            # Neither would a user error a worker found: the restart would find it again.
            if attempt >= max_restarts or diverged or failed.failure.user_errors:
                raise
            attempt += 1
            if on_restart is not None:
                on_restart(attempt, failed.failure)


def _launch_once(nproc: int, argv: list[str], env: dict[str, str] | None,
                 poll_interval_s: float, kill_grace_s: float, attempt: int,
                 stop_grace_s: float) -> None:
    """One start of the job: see ``launch_local``."""
    base = dict(os.environ if env is None else env)
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), MCPAR_LAUNCHED="1",
                WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                MCPAR_RESTART_COUNT=str(attempt))
    err_dir = tempfile.mkdtemp(prefix="mcpar-launch-")
    err_files = [os.path.join(err_dir, f"rank-{r}.json") for r in range(nproc)]

    # Signals are turned into a flag checked by the poll loop, so teardown never runs half-way
    # inside a handler. Handlers can only be installed from the main thread.
    received: list[int] = []
    previous: dict[signal.Signals, _SignalHandler] = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, lambda s, _f: received.append(s))

    procs: list[Worker] = []
    job: _ForkedJob | None = None
    try:
        preexec = _death_signal_preexec()
        rank_envs = [dict(RANK=str(rank), LOCAL_RANK=str(rank), MCPAR_ERROR_FILE=err_files[rank])
                     for rank in range(nproc)]
        if argv[:2] == ["-m", WORKER_MODULE] and base.get("MCPAR_FORK_WORKERS", "1") != "0":
            # mcpar's own workers fork from one process that imported torch once
            # (MCPAR_FORK_WORKERS=0: each starts a fresh interpreter instead).
            job = _ForkedJob(nproc, argv, base, rank_envs, preexec)
            procs = [_ForkedWorker(job, rank) for rank in range(nproc)]
        for rank in range(nproc if job is None else 0):
            # stdout/stderr are inherited so the user sees progress; stdin is not, since workers
            # in their own session must not compete for the terminal.
            procs.append(subprocess.Popen([sys.executable, *argv],
                                          env=dict(base, **rank_envs[rank]),
                                          stdin=subprocess.DEVNULL, start_new_session=True,
                                          preexec_fn=preexec))
        first: WorkerFailure | None = None
        while not received:
            codes = [p.poll() for p in procs]
            failed = [_failure(r, c, err_files[r]) for r, c in enumerate(codes) if c]
            if failed:
                first = _pick_first(failed)
                if first.error and "timed out" in first.error:
                    first = _name_stalled_ranks(first, procs, err_files, poll_interval_s)
                break
            if all(c == 0 for c in codes):
                return
            time.sleep(poll_interval_s)
        _teardown(procs, kill_grace_s if first is not None else stop_grace_s)
        if first is not None:
            raise LaunchFailed(first)
        if received[0] == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + received[0])
    finally:
        # Covers exceptions from Popen or a KeyboardInterrupt raised outside our handler.
        if any(p.poll() is None for p in procs):
            _teardown(procs, kill_grace_s)
        if job is not None:
            job.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        shutil.rmtree(err_dir, ignore_errors=True)


@contextlib.contextmanager
def record_worker_errors() -> Iterator[None]:
    """Wrap a worker's main: record why it failed in ``$MCPAR_ERROR_FILE``, then re-raise."""
    try:
        yield
    except BaseException as exc:
        if isinstance(exc, SystemExit) and exc.code in (0, None):
            raise
        path = os.environ.get("MCPAR_ERROR_FILE")
        # The innermost recorder wins: an outer one sees the same exception with less context.
        if path and not os.path.exists(path):
            if isinstance(exc, UserError):
                error = "; ".join(exc.problems)
            else:
                message = str(exc)
                error = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
            rank_raw = os.environ.get("RANK", "")
            record: dict[str, object] = {
                "rank": int(rank_raw) if rank_raw.isdigit() else None, "error": error,
                "traceback": traceback.format_exc()}
            if isinstance(exc, UserError):
                record["user_errors"] = list(exc.problems)
            with contextlib.suppress(OSError):
                # Write then rename, so the launcher never reads a half-written file.
                tmp = f"{path}.{os.getpid()}.tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    json.dump(record, f)
                os.replace(tmp, path)
        raise
