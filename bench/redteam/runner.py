"""One probe run: its set-up in a fresh temporary folder, its command line in a subprocess (with
``--src``'s tree first on PYTHONPATH), and what it did wrong. For each probe it records the exit
code and:

* ``traceback``: stderr holds a Python traceback;
* ``hang``: the command ran past its timeout (killed, with its whole process group);
* ``restarts``: worker restart lines the launcher printed (a user error must never restart);
* ``outside_read``: a file of the sandbox folder beside the input (which nothing may read) had its
  access time moved, or a FIFO that must stay unopened was opened for reading;
* ``wrong_exit``: the probe expects exit 2 with one line (a refusal; for full disks the line
  must name the option that chose the place) or exit 0 (the input is fine after all), and the
  command did otherwise. torch's notice of every profiled run (TORCH_NOTICE) is not counted as
  a line.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from .probe import Ctx, Probe, Skip, command_env

OLD_ATIME = 1_000_000_000  # 2001: any read on a relatime mount moves it
RESTART = re.compile(r"restart.*\d+/\d+", re.IGNORECASE)
# torch's own notice on every profiled run (a block allocated before tracing started is freed
# while tracing): printed by successful runs too, so it is no line of the error.
TORCH_NOTICE = re.compile(r"^(\[rank\d+\]:)?\[W\d{4} [^\]]*CPUAllocator\.cpp:\d+\] Memory block of "
                          r"unknown size was allocated before the profiling started")


def _age_sandbox(sandbox: Path) -> None:
    for p in sandbox.rglob("*"):
        if p.is_file() and not p.is_symlink():
            os.utime(p, (OLD_ATIME, OLD_ATIME))


def _read_in_sandbox(sandbox: Path) -> list[str]:
    return sorted(str(p.relative_to(sandbox)) for p in sandbox.rglob("*")
                  if p.is_file() and not p.is_symlink() and p.stat().st_atime != OLD_ATIME)


def _watch_fifos(fifos: list[Path], stop: threading.Event, opened: list[str],
                 held: list[int]) -> None:
    """A FIFO opened for reading lets a non-blocking writer open it: note that, and keep the
    writer open, so a reader that hangs on it keeps hanging."""
    while not stop.is_set():
        for fifo in fifos:
            if str(fifo) in opened:
                continue
            try:
                held.append(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                opened.append(str(fifo))
            except OSError as exc:
                if exc.errno != errno.ENXIO:
                    raise
        stop.wait(0.05)


def run_probe(probe: Probe, src: Path, fixtures: Path, old: bool) -> dict:
    record: dict = {"name": probe.name, "family": probe.family, "expect": probe.expect}
    if old and not probe.old_code:
        return {**record, "skipped": probe.skip_old}
    with tempfile.TemporaryDirectory(prefix=f"rt-{probe.name}-") as tmp:
        work = Path(tmp) / "work"
        work.mkdir()
        sandbox = Path(tmp) / "outside"
        sandbox.mkdir()
        c = Ctx(work, sandbox, fixtures, src)
        try:
            try:
                args = probe.setup(c)
            except Skip as why:
                return {**record, "skipped": str(why)}
            _age_sandbox(sandbox)
            stop, opened, held = threading.Event(), [], []
            watcher = threading.Thread(target=_watch_fifos, args=(c.fifos, stop, opened, held),
                                       daemon=True)
            watcher.start()
            start = time.monotonic()
            proc = subprocess.Popen([sys.executable, "-m", "mcpar.cli", *args], cwd=work,
                                    env=command_env(src, c.env), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
            hang = False
            try:
                out, err = proc.communicate(timeout=probe.timeout)
            except subprocess.TimeoutExpired:
                hang = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # any worker left behind
            stop.set()
            watcher.join()
            for fd in held:
                os.close(fd)
            seconds = time.monotonic() - start
            stdout = out.decode(errors="replace")
            stderr = err.decode(errors="replace")
            lines = [ln for ln in stderr.splitlines()
                     if ln.strip() and not TORCH_NOTICE.match(ln)]
            reads = _read_in_sandbox(sandbox) + [f"FIFO {Path(f).name} opened" for f in opened]
            restarts = sum(1 for ln in (stdout + "\n" + stderr).splitlines()
                           if RESTART.search(ln))
            ok = (not hang and proc.returncode == probe.expect
                  and (probe.expect != 2 or (len(lines) == 1 and probe.needle in lines[0])))
            return {**record, "rc": None if hang else proc.returncode, "seconds": round(seconds, 1),
                    "traceback": "Traceback" in stderr, "hang": hang, "restarts": restarts,
                    "outside_read": bool(reads), "outside_files": reads,
                    "wrong_exit": not ok, "stderr_lines": len(lines),
                    "stderr_tail": "\n".join(lines[-3:])[-600:]}
        except Exception as exc:  # a probe whose set-up broke: recorded, the rest still run
            return {**record, "error": f"{type(exc).__name__}: {exc}"[:600]}
        finally:
            for mount in reversed(c.mounts):
                subprocess.run(["umount", "-l", str(mount)], capture_output=True)
