"""The fuzz tests' time limit reaches the test even through code that catches OSError or
Exception around the call that hangs (a hang swallowed there would pass as an answer)."""

from __future__ import annotations

import time

import pytest
from conftest import TimeLimitExceeded, time_limit


def _sleeps_catching(kind: type[BaseException]) -> int:
    """Three short sleeps, each inside ``except kind``; how many raised and were swallowed."""
    swallowed = 0
    for _ in range(3):
        try:
            time.sleep(0.3)
        except kind:
            swallowed += 1
    return swallowed


@pytest.mark.parametrize("kind", [OSError, Exception])
def test_the_time_limit_is_not_swallowed_by_a_broad_except(kind: type[BaseException]) -> None:
    with pytest.raises(TimeLimitExceeded, match="no answer within 0.1 s"), time_limit(0.1):
        _sleeps_catching(kind)


def test_a_block_within_its_limit_runs_to_the_end() -> None:
    with time_limit(5):
        assert _sleeps_catching(OSError) == 0
