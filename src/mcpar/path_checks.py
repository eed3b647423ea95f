"""Paths a job will read or write, checked before any worker starts.

A worker that meets an unreadable corpus or an unwritable checkpoint directory fails after the
job has started, and the launcher would restart it for what is the user's to fix. Each check
here is the same test the worker would meet, done early: a path to read must exist and be
readable (a directory also listable); a directory to write must be creatable, which means its
nearest existing ancestor is a directory this user may write into, with no file in the way.
``os.access`` answers as the real user, and reports a read-only filesystem too.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from mcpar.config import JobConfig
from mcpar.errors import UserError, problem

# Errors of the filesystem the launcher writes to that the user must fix (a full disk, a quota,
# a read-only or denied place), rather than faults a restart could cure.
STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES,
                            errno.EPERM})


def writable_dir_problem(key: str, path: Path) -> str | None:
    """Why ``path`` cannot be created and written as a directory, naming ``key``; or None."""
    path = Path(os.path.expanduser(path))
    try:
        return _writable_dir_problem(key, path)
    except OSError as err:  # e.g. a name longer than the filesystem allows
        return problem(key, f"{path} cannot be used ({err.strerror}); choose another directory")


def _writable_dir_problem(key: str, path: Path) -> str | None:
    probe = path
    while not probe.exists():
        if probe.is_symlink():  # a dangling link: mkdir would fail on it
            return problem(key, f"{probe} is a broken symbolic link; fix it or choose another "
                           "directory")
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return problem(key, f"{probe} is a file, not a directory, so {path} cannot be created; "
                       "choose another directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        what = "is not writable by this user" if probe.exists() else "cannot be created"
        return problem(key, f"{probe} {what}, so nothing can be written to {path}; choose a "
                       "writable directory or fix its permissions")
    return None


def readable_path_problem(key: str, path: Path) -> str | None:
    """Why ``path`` (a file, or a directory to list and read) cannot be read; or None."""
    path = Path(os.path.expanduser(path))
    try:
        is_dir = stat.S_ISDIR(path.stat().st_mode)
    except FileNotFoundError:
        return None  # the data loader names a missing source (or a glob) with its own hint
    except OSError as err:  # e.g. a parent directory this user may not enter
        return problem(key, f"{path} cannot be reached by this user ({err.strerror}); fix the "
                       "permissions of its directories or point the key at a readable copy")
    if not os.access(path, os.R_OK | (os.X_OK if is_dir else 0)):
        return problem(key, f"{path} is not readable by this user; fix its permissions or "
                       "point the key at a readable copy")
    return None


def name_problem(key: str, path: Path) -> str | None:
    """Why the filesystem refuses ``path``'s name (too long, a loop of links); or None."""
    path = Path(os.path.expanduser(path))
    try:
        path.exists()
    except OSError as err:
        return problem(key, f"{path} cannot be used ({err.strerror}); choose another path")
    return None


def path_problems(cfg: JobConfig, run_dir: Path) -> list[str]:
    """Every path ``cfg`` reads or writes that this user cannot, one problem line each."""
    data, ckpt = cfg.data, cfg.optimization.checkpoint
    found = [readable_path_problem("data.source", Path(data.source))
             if data.source != "stdlib" else None,
             writable_dir_problem("--run-dir", run_dir)]
    if ckpt.dir is not None:
        found.append(writable_dir_problem("optimization.checkpoint.dir", Path(ckpt.dir)))
    offload_dir = cfg.controllers.memory.offload_dir
    if offload_dir is not None and cfg.controllers.memory.offload == "nvme":
        found.append(writable_dir_problem("controllers.memory.offload_dir", Path(offload_dir)))
    # data.cache_dir is not checked for writing here: a complete cache may be read-only; the
    # loader names the key when it must write a new entry and cannot. A name the filesystem
    # refuses is refused here.
    if data.cache_dir is not None:
        found.append(name_problem("data.cache_dir", Path(data.cache_dir)))
    return [p for p in found if p is not None]


def storage_error_line(err: OSError, where: str, key: str | None = None) -> str | None:
    """A one-line message for a file operation the filesystem refused, with the fix (None for
    errors that are not the user's to fix). A failed write to an open file carries no file
    name: ``where`` then names the place it was writing to. ``key``: the setting or option
    that chose the place (the line starts with it and its fix names it); without it, the
    launcher's own writes under ``--run-dir``."""
    if err.errno not in STORAGE_ERRNOS:
        return None
    full = err.errno in (errno.ENOSPC, errno.EDQUOT)
    other = key or "--run-dir"
    fix = (f"free space there or choose another {other}" if full else
           f"fix its permissions or choose another {other}")
    line = f"{err.filename or 'writing under ' + str(where)}: {err.strerror}; {fix}"
    return problem(key, line) if key else line


def named(err: OSError, path: str | Path) -> OSError:
    """``err`` naming ``path`` when it names no file (a failed write to an open file)."""
    if err.filename is not None or err.errno is None:
        return err
    return type(err)(err.errno, err.strerror, str(path))


@contextlib.contextmanager
def storage_errors(where: str | Path, key: str) -> Iterator[None]:
    """Within: an OSError that is the user's to fix (a full disk, a quota, a read-only or
    denied place) becomes a UserError of one line naming the file (else ``where``) and
    ``key``; other OS errors pass as they are."""
    try:
        yield
    except OSError as err:
        line = storage_error_line(err, str(where), key)
        if line is None:
            raise
        raise UserError(line) from err
