"""The pieces of an asynchronous checkpoint save: staging, coordination and the writer thread.

An asynchronous save (``optimization.checkpoint.async_save``) splits a save in two:

1. *Staging*, on the training thread, before the next optimizer step: every tensor of this
   rank's state dict is copied into CPU buffers owned by the checkpoint (``StagingBuffers``), and
   everything else that resume needs (step, data-stream position, RNG states) is captured. After
   this the optimizer may change the live tensors: the save no longer reads them.
2. *Writing and committing*, on a background thread (``BackgroundSave``): the DCP write, then the
   same commit as a synchronous save (rank 0 writes ``meta.json`` and the checksummed manifest,
   fsyncs, renames ``step-N.tmp`` to ``step-N``).

The thread's collectives (DCP's planning and gathering, the commit's barrier) run on a process
group of their own (``Coordination.for_group`` over a group made by ``dist.new_group``): on the
default group they would interleave with the training loop's collectives, which are issued
concurrently from the main thread, and the ranks would deadlock or exchange the wrong tensors.

At most one save is in flight per rank: the next save, a restore and the end of training wait for
it (``BackgroundSave.wait``), and an error of the thread is raised there, never lost.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from mcpar.checkpoint import packing

# Test hook, never set in production: "STEP:SECONDS" makes rank 0's writer sleep after the shard
# files of step STEP are written and before it commits them, so that a test can kill a worker
# while a save is in flight and check that no valid checkpoint results.
TEST_DELAY_ENV = "MCPAR_TEST_SAVE_DELAY"


class CheckpointSaveError(RuntimeError):
    """A checkpoint save failed (raised on every rank, at the wait that follows it)."""


def apply_test_delay(step: int, rank: int) -> None:
    """Sleep as ``MCPAR_TEST_SAVE_DELAY`` asks for this step (see ``TEST_DELAY_ENV``)."""
    spec = os.environ.get(TEST_DELAY_ENV)
    if not spec or rank != 0:
        return
    at, _, seconds = spec.partition(":")
    if int(at) == step:
        time.sleep(float(seconds))


class StagingBuffers:
    """CPU copies of a state dict, packed (``checkpoint_packing``) into buffers reused from one
    save to the next.

    Reuse matters: allocating (and, on CUDA, pinning) a model-sized buffer at every save would
    cost more than the copy. A buffer is only reused after the save that read it has finished,
    which ``BackgroundSave`` guarantees (one save in flight).
    """

    def __init__(self) -> None:
        self._packs: dict[str, torch.Tensor] = {}

    def stage(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
        """The packed copy of ``state`` DCP is to write, and a CUDA event the writer must wait
        for before it reads it (None when no tensor is on a GPU). GPU copies are issued
        non-blocking into pinned memory on the current stream, so the next optimizer step
        (later on the same stream) cannot overwrite a tensor before it has been copied."""
        on_gpu = any(t.device.type == "cuda" for t in state.values())
        previous, self._packs = self._packs, {}  # buffers of packs gone since are dropped

        def reuse(name: str, dtype: torch.dtype, numel: int) -> torch.Tensor:
            buffer = previous.get(name)
            if (buffer is None or buffer.numel() != numel or buffer.dtype != dtype
                    or buffer.is_pinned() != on_gpu):
                buffer = torch.empty(numel, dtype=dtype, device="cpu", pin_memory=on_gpu)
            self._packs[name] = buffer
            return buffer

        packed = packing.pack(state, reuse, non_blocking=on_gpu)
        ready = None
        if on_gpu:
            ready = torch.cuda.Event()
            ready.record()
        return packed, ready


def _gather_over(group: Any) -> Callable[[Any], list[Any] | None]:
    """Every rank's object, on rank 0 (None elsewhere), over ``group`` (None: the default)."""
    def gather(obj: Any) -> list[Any] | None:
        if not dist.is_initialized() or dist.get_world_size(group) == 1:
            return [obj]
        out: list[Any] | None = ([None] * dist.get_world_size(group)
                                 if dist.get_rank(group) == 0 else None)
        dist.gather_object(obj, out, group=group, group_dst=0)
        return out

    return gather


@dataclass
class Coordination:
    """The collectives a save needs, over one process group: rank 0's integer known to every
    rank (a barrier that also tells the others that rank 0 failed), and a gather of every
    rank's file checksums on rank 0."""

    agree: Callable[[int], int]
    gather: Callable[[Any], list[Any] | None]
    group: Any = None  # the process group DCP uses; None: the default group

    @staticmethod
    def for_group(group: Any, rank: int) -> Coordination:
        """Collectives over ``group`` (a gloo group: CPU tensors, any thread)."""
        def agree(value: int) -> int:
            mine = torch.tensor([value if rank == 0 else 0], dtype=torch.int64)
            dist.all_reduce(mine, group=group)
            return int(mine.item())

        return Coordination(agree, _gather_over(group), group)

    @staticmethod
    def default(agree: Callable[[int], int]) -> Coordination:
        """The training's own default group (synchronous saves, between steps); ``agree`` is
        the trainer's."""
        return Coordination(agree, _gather_over(None), None)


def _lower_this_threads_priority() -> None:
    """Run the calling thread at the lowest CPU priority (Linux; elsewhere a no-op).

    The writer's work can wait, training cannot: at nice 19 the kernel gives the writer a core
    only when training leaves it idle (a rank waiting on a collective or on the slower rank), so
    on a machine with no spare core the save fills the gaps instead of taking time from steps.
    On Linux each thread has its own nice value, set through its thread id.
    """
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:  # e.g. a sandbox that forbids it: the save still works, at normal priority
        pass


class BackgroundSave:
    """One save running on a daemon thread; ``wait`` joins it and re-raises its error.

    Daemon, so that a worker that fails or is stopped mid-save exits instead of hanging on a
    collective whose peers are gone: the save then never commits, and its ``.tmp`` folder is
    never taken for a checkpoint.
    """

    def __init__(self, step: int, work: Callable[[], None]):
        self.step = step
        self.error: BaseException | None = None
        self._finished = False
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                        name=f"mcpar-checkpoint-step-{step}")
        self._thread.start()

    def _run(self, work: Callable[[], None]) -> None:
        _lower_this_threads_priority()
        try:
            work()
            self._finished = True
        except Exception as error:  # handed to the training thread by wait()
            self.error = error

    def done(self) -> bool:
        return not self._thread.is_alive()

    def wait(self) -> float:
        """Block until the save is committed (or failed); the seconds waited. Raises
        ``CheckpointSaveError`` if it failed."""
        t0 = time.perf_counter()
        self._thread.join()
        if self.error is not None:
            raise CheckpointSaveError(f"the asynchronous save of the checkpoint of step "
                                      f"{self.step} failed: {self.error!r}") from self.error
        if not self._finished:  # ended by a BaseException, which a thread cannot hand over
            raise CheckpointSaveError(f"the asynchronous save of the checkpoint of step "
                                      f"{self.step} was interrupted")
        return time.perf_counter() - t0
