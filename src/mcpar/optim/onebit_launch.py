"""1-bit Adam's launched exchanges: each segment's averaged momentum, awaited on its own.

A step's exchanges run on the CommunicationController's one thread, as ONE job fed one
segment at a time (:class:`ExchangeFeed`), whether they are launched from the
backward pass bucket by bucket or all at once after clipping: the job compresses segment 0 and
puts its signs on the wire while the caller is still computing segment 1 (its gradients, or its
local momentum), and the pipelined exchange (``onebit_compressed_allreduce_many``) serves
segment 0 while segment 1's signs cross the link. Without the feed, a bucket launched from the
backward pass waited for the whole exchange of the one before it (measured on the emulated
100 Mbit/s link: the second bucket's compression started 10 ms after its launch).

The optimizer waits for each segment's result separately (a ``Future`` per segment), so that it
updates the parameters of segment k while segment k+1 is still crossing the link.

While a job waits for its next segment it holds the communication thread: in 1-bit Adam's
compression stage nothing else runs there (the gradients are not all-reduced), and a caller
that fails before handing over every segment must :meth:`ExchangeFeed.abandon` the job.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from concurrent.futures import Future

import torch

from mcpar.comm.communicator import CommHandle, Communicator

# Runs exchanges of (segment index, local momentum) pairs, produced lazily, and reports each
# (segment index, averaged momentum) as it lands.
RunExchanges = Callable[[Iterator[tuple[int, torch.Tensor]],
                         Callable[[int, torch.Tensor], None]], None]


class ExchangeFeed:
    """Segments handed over one by one to a single pipelined job on the communication thread.

    ``results[index]`` resolves to segment ``index``'s averaged momentum, or to the error that
    stopped the job (every segment not yet done gets it).
    """

    def __init__(self, indices: list[int], run: RunExchanges, comm: Communicator):
        self.results: dict[int, Future[torch.Tensor]] = {i: Future() for i in indices}
        self._count = len(indices)
        self._queue: queue.SimpleQueue[tuple[int, torch.Tensor] | None] = queue.SimpleQueue()
        self._run = run
        self.handle: CommHandle = comm.run_async(self._job)

    def put(self, index: int, local: torch.Tensor) -> None:
        self._queue.put((index, local))

    def abandon(self) -> None:
        """The caller failed before handing over every segment: end the job (with an error)
        instead of leaving it to hold the communication thread forever."""
        self._queue.put(None)

    def _fed(self) -> Iterator[tuple[int, torch.Tensor]]:
        for _ in range(self._count):
            item = self._queue.get()
            if item is None:
                raise RuntimeError("1-bit Adam's exchange was abandoned before every segment "
                                   "was handed over")
            yield item

    def _job(self) -> None:
        try:
            self._run(self._fed(), lambda index, averaged: self.results[index].set_result(averaged))
        except BaseException as err:
            for future in self.results.values():
                if not future.done():
                    future.set_exception(err)
            raise
