"""User-facing errors.

A ``UserError`` is a mistake the user can fix (bad config, missing path, impossible layout). The CLI
prints each problem on its own line and exits with code 2, without a traceback. Anything else is an
internal error and may trace.
"""

from __future__ import annotations


class UserError(Exception):
    """One or more problems, each naming the config key or path at fault and how to fix it."""

    def __init__(self, problems: str | list[str]):
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        super().__init__("\n".join(self.problems))


def problem(key: str, message: str) -> str:
    """Format one problem line: ``<key>: <message>``."""
    return f"{key}: {message}"


class TrainingDiverged(RuntimeError):
    """Too many steps in a row with non-finite loss or gradients. Restarting from a checkpoint
    would replay the same numbers, so the launcher does not restart the job for it."""
