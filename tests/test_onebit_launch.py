"""1-bit Adam's launched exchanges (``mcpar.optim.onebit_launch``), without a process group.

The optimizer relies on three properties of the feed: a segment's result can be awaited while
later segments are still being exchanged (so their parameters update behind the wire); a
failure on the communication thread reaches every segment still waiting; and a caller that
fails half-way through handing segments over frees the communication thread instead of leaving
a job blocked on it forever.
"""

from __future__ import annotations

import threading

import pytest
import torch
from test_onebit_adam import single_comm

from mcpar.optim.onebit_adam import OneBitAdam
from mcpar.optim.onebit_launch import ExchangeFeed


def test_a_segment_lands_while_the_next_is_still_exchanged() -> None:
    comm = single_comm()
    release_second = threading.Event()

    def run(fed, on_result) -> None:  # type: ignore[no-untyped-def]
        for index, local in fed:
            if index == 1:
                assert release_second.wait(timeout=30), "segment 0 was never awaited"
            on_result(index, local * 2)

    feed = ExchangeFeed([0, 1], run, comm)
    feed.put(0, torch.ones(3))
    feed.put(1, torch.full((3,), 5.0))
    # Segment 0 is available although the job is still holding segment 1.
    assert torch.equal(feed.results[0].result(timeout=30), torch.full((3,), 2.0))
    assert not feed.results[1].done()
    release_second.set()
    assert torch.equal(feed.results[1].result(timeout=30), torch.full((3,), 10.0))
    feed.handle.wait()


def test_a_failed_exchange_reaches_every_waiting_segment() -> None:
    comm = single_comm()

    def run(fed, on_result) -> None:  # type: ignore[no-untyped-def]
        for index, local in fed:
            if index == 1:
                raise RuntimeError("link down")
            on_result(index, local)

    feed = ExchangeFeed([0, 1, 2], run, comm)
    for index in range(3):
        feed.put(index, torch.zeros(1))
    assert torch.equal(feed.results[0].result(timeout=30), torch.zeros(1))
    for index in (1, 2):
        with pytest.raises(RuntimeError, match="link down"):
            feed.results[index].result(timeout=30)
    with pytest.raises(RuntimeError, match="link down"):
        feed.handle.wait()


def test_an_abandoned_feed_frees_the_communication_thread() -> None:
    comm = single_comm()

    def run(fed, on_result) -> None:  # type: ignore[no-untyped-def]
        for index, local in fed:
            on_result(index, local)

    feed = ExchangeFeed([0, 1], run, comm)
    feed.put(0, torch.ones(1))
    feed.abandon()  # the caller failed before handing over segment 1
    with pytest.raises(RuntimeError, match="abandoned"):
        feed.results[1].result(timeout=30)
    # The thread is free again: the next job runs.
    ran = threading.Event()
    comm.run_async(ran.set)
    assert ran.wait(timeout=30)


def test_a_step_missing_a_segment_fails_and_frees_the_communication_thread() -> None:
    comm = single_comm()
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = OneBitAdam(model.parameters(), comm, freeze_step=1)
    params = list(model.parameters())
    opt.set_exchange_buckets([params[2:], params[:2]])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # the warm-up step
    opt.launch_exchange(0, torch.cat([p.grad.reshape(-1) for p in params[2:]]))
    with pytest.raises(RuntimeError, match=r"segments \[1\] were not launched"):
        opt.step()
    ran = threading.Event()
    comm.run_async(ran.set)
    assert ran.wait(timeout=30), "the abandoned exchange job still holds the thread"
