"""Which files a text ``data.source`` (or a ``mcpar prepare`` SOURCE) names, in a fixed order.

``stdlib`` is this interpreter's standard-library sources; otherwise a file, a directory (every
file under it, by relative path) or a glob (sorted). The order is part of the corpus's identity:
the same source gives the same bytes in the same order on every machine.
"""

from __future__ import annotations

import glob
import os
import sysconfig
from pathlib import Path

from mcpar.errors import UserError, problem

# Directory names left out of the stdlib corpus. Test suites hold deliberately malformed
# encodings and huge generated files, idlelib/lib2to3 are tools rather than library code, and
# installed third-party packages would make the corpus depend on the environment instead of on
# the Python version alone.
_STDLIB_EXCLUDED = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


def stdlib_files() -> list[Path]:
    """The ``.py`` files of this interpreter's standard library, sorted by relative POSIX path.

    Every ``*.py`` under ``sysconfig.get_paths()["stdlib"]``, except paths with a component in
    site-packages, dist-packages, test, tests, idlelib, lib2to3 or __pycache__: tests contain
    deliberately odd encodings and huge generated files, and third-party packages would tie the
    corpus to the environment. The same Python version therefore yields the same bytes anywhere.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    found: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Pruning in place stops os.walk from descending at all, which keeps this fast.
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_EXCLUDED]
        for name in filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root)
            if name.endswith(".py") and not _STDLIB_EXCLUDED.intersection(rel.parts):
                found.append((rel.as_posix(), path))
    found.sort(key=lambda item: item[0])
    return [path for _, path in found]


def resolve_text_files(source: str, key: str = "data.source") -> list[Path]:
    """The files a text ``data.source`` names, in their documented order."""
    if source == "stdlib":
        return stdlib_files()
    path = Path(os.path.expanduser(source))
    if path.is_file():
        return [path]
    if path.is_dir():
        files = [p for p in path.rglob("*") if p.is_file()]
        files.sort(key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise UserError(problem(key, f"directory '{source}' holds no files"))
        return files
    matches = sorted(glob.glob(os.path.expanduser(source), recursive=True))
    files = [Path(m) for m in matches if Path(m).is_file()]
    if not files:
        msg = f"no file matches '{source}'; give an existing file, a directory, a glob, or 'stdlib'"
        raise UserError(problem(key, msg))
    return files
