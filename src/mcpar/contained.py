"""Files that a directory names are kept inside it.

A Hugging Face folder's index, a prepared directory's manifest and a directory given as a
tokenizer all name files by a path relative to their directory. Each such name is checked here
before anything is opened: it must be a relative path without ``..``, resolve (symbolic links
followed) to a place inside the directory, and be a regular file there. A name that escapes
would have mcpar read (or train on) a file the directory does not hold, a device such as
``/dev/zero`` would be read without end, and a FIFO would block the reader forever; each is
refused as a user error naming the key and the name.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path, PurePosixPath

from mcpar.errors import UserError, problem


def _escape_reason(root: Path, name: object) -> str | None:
    """Why ``name`` cannot name a file inside ``root`` as written (None: it can)."""
    if not isinstance(name, str) or not name:
        return "not a file name"
    if "\x00" in name or "\\" in name:
        return "not a plain file name"
    pure = PurePosixPath(name)
    if pure.is_absolute() or os.path.isabs(name):
        return f"an absolute path, outside {root}"
    if ".." in pure.parts:
        return f"a path through '..', outside {root}"
    return None


def contained_file(root: Path, name: object, key: str, named_by: str,
                   fix: str = "name a regular file inside the directory") -> Path:
    """``root / name``, checked to be a regular file inside ``root`` before it is opened.

    ``named_by`` says what names the file (e.g. ``"DIR/model.safetensors.index.json's
    weight_map"``); a refusal is one problem line naming ``key``, ``named_by`` and ``name``.
    A missing file is refused too, so callers that allow one check ``exists`` first."""
    reason = _escape_reason(root, name)
    if reason is None:
        assert isinstance(name, str)
        path = root / name
        try:
            inside = path.resolve().is_relative_to(root.resolve())
        except (OSError, RuntimeError):  # a symbolic-link loop
            inside = False
        if not inside:
            reason = f"it resolves to {path.resolve(strict=False)}, outside {root}"
        else:
            try:
                mode = os.stat(path).st_mode  # stat never opens: a FIFO cannot block it
            except FileNotFoundError:
                mode = None
                reason = "no such file"
            except OSError as exc:
                mode = None
                reason = f"it cannot be read ({exc.strerror})"
            if mode is not None and not stat.S_ISREG(mode):
                what = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode)
                        else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                        else "not a regular file")
                reason = f"{what}, not a regular file"
        if reason is None:
            return path
    raise UserError(problem(key, f"{named_by} names {name!r}: {reason}; {fix}"))
