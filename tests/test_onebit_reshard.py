"""1-bit Adam's error feedback follows a change of the data degree (``comm/onebit_reshard.py``).

Per element of the flat momentum, the old ranks' mean worker error and the server error must be
what the new ranks hold, whatever the old and new bucket segments and chunkings; the padding
holds nothing. End to end: data 4 past the freeze step resumed at data 2 carries them (the
load's log says 'carried', not 'restarted'), and the new run's own checkpoint holds them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TINY, recovery_events, train_metrics

from mcpar.checkpoint.files import load_tensors
from mcpar.comm.compression import OneBitErrorBuffers, onebit_padded_size
from mcpar.comm.onebit_reshard import ErrorMerge, fill_errors, flat_errors, ranges_table

NUMEL = 37


def _buffers(segments: list[list[tuple[int, int]]], world: int) -> OneBitErrorBuffers:
    sizes = [onebit_padded_size(sum(e - s for s, e in ranges), world) for ranges in segments]
    return OneBitErrorBuffers(torch.zeros(sum(sizes)), torch.zeros(sum(sizes) // world))


def _views(segments: list[list[tuple[int, int]]], world: int,
           storage: OneBitErrorBuffers) -> list[OneBitErrorBuffers]:
    out, w_at, s_at = [], 0, 0
    for ranges in segments:
        size = onebit_padded_size(sum(e - s for s, e in ranges), world)
        out.append(OneBitErrorBuffers(storage.worker[w_at:w_at + size],
                                      storage.server[s_at:s_at + size // world]))
        w_at, s_at = w_at + size, s_at + size // world
    return out


def _merge(storages: list[OneBitErrorBuffers], segments: list[list[tuple[int, int]]]
           ) -> tuple[torch.Tensor, torch.Tensor]:
    merge = ErrorMerge(NUMEL)
    world = len(storages)
    for rank, storage in enumerate(storages):
        merge.add(storage.worker, storage.server, ranges_table(segments),
                  torch.tensor([world, rank, 1]))
    return merge.result()


# Old and new exchange segments differ (buckets follow the layout), and so do the worlds.
OLD = [[(30, 37), (20, 30)], [(0, 20)]]
NEW = [[(25, 37)], [(10, 25), (0, 10)]]


@pytest.mark.parametrize("old_world, new_world", [(4, 2), (2, 4), (3, 2), (4, 1)])
def test_mean_worker_and_server_errors_survive_per_element(old_world: int,
                                                           new_world: int) -> None:
    gen = torch.Generator().manual_seed(old_world * 10 + new_world)
    old = [_buffers(OLD, old_world) for _ in range(old_world)]
    for storage in old:
        storage.worker.copy_(torch.randn(storage.worker.shape, generator=gen))
        storage.server.copy_(torch.randn(storage.server.shape, generator=gen))
    mean, server = _merge(old, OLD)
    # By hand: rank i's worker error of flat element x sits at x's place in its segment.
    flat_of_rank = [flat_errors(s.worker, s.server, OLD, old_world, r, NUMEL)[0]
                    for r, s in enumerate(old)]
    assert torch.allclose(mean, torch.stack(flat_of_rank).mean(0), atol=1e-7)
    assert mean[30] == pytest.approx(sum(float(s.worker[0]) for s in old) / old_world, abs=1e-6)
    new = [_buffers(NEW, new_world) for _ in range(new_world)]
    for rank, storage in enumerate(new):
        fill_errors(NEW, _views(NEW, new_world, storage), mean, server, rank)
    new_mean, new_server = _merge(new, NEW)
    assert torch.allclose(new_mean, mean, atol=1e-6)
    assert torch.equal(new_server, server)
    for storage in new:  # the padding of every segment holds nothing
        for view, ranges in zip(_views(NEW, new_world, storage), NEW, strict=True):
            assert not view.worker[sum(e - s for s, e in ranges):].any()


def test_a_gap_in_the_server_errors_is_refused() -> None:
    storages = [_buffers(OLD, 2) for _ in range(2)]
    merge = ErrorMerge(NUMEL)
    merge.add(storages[0].worker, storages[0].server, ranges_table(OLD), torch.tensor([2, 0, 1]))
    with pytest.raises(ValueError, match="no saved server error"):
        merge.result()  # rank 1's chunks are missing
    with pytest.raises(ValueError, match="hold 37 elements, this flat momentum 36"):
        ErrorMerge(NUMEL - 1).add(storages[1].worker, storages[1].server, ranges_table(OLD),
                                  torch.tensor([2, 1, 1]))


ONEBIT = ["controllers.communication.compression=1bit", "optimization.freeze_step=3",
          "optimization.grad_clip=0", "controllers.communication.bucket_size_mb=0.01",
          "optimization.checkpoint.interval=6"]


def _errors(path: Path, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    merge = None
    for rank in range(world):
        prefix = f"rank{rank}/onebit/"
        saved = {k[len(prefix):]: v for k, v in load_tensors(path, prefix).items()}
        merge = merge or ErrorMerge(int(saved["ranges"][:, 2].max()))
        merge.add(saved["worker_error"], saved["server_error"], saved["ranges"],
                  saved["exchange"])
    assert merge is not None
    return merge.result()


@pytest.mark.slow
def test_data4_past_the_freeze_step_resumes_at_data2_with_its_errors(tmp_path: Path) -> None:
    train_metrics(tmp_path / "a", 4, [*TINY, *ONEBIT, "training.steps=6"])
    a = tmp_path / "a" / "checkpoints" / "step-6"
    b_records = train_metrics(tmp_path / "b", 2, [
        *TINY, *ONEBIT, "training.steps=8", "optimization.gradient_accumulation=2",
        f"optimization.checkpoint.load_from={tmp_path / 'a'}"])
    load = [e for e in recovery_events(tmp_path / "b") if e.get("event") == "load"][0]
    assert load["carried"] == ["compression_errors"], load
    assert "compression_errors" not in load["restarted"], load
    old_mean, old_server = _errors(a, 4)
    assert old_mean.abs().max() > 0 and old_server.abs().max() > 0  # past the freeze step
    new_mean, new_server = _errors(tmp_path / "b" / "checkpoints" / "step-6", 2)
    assert torch.allclose(new_mean, old_mean, atol=1e-7, rtol=0)
    assert torch.equal(new_server, old_server)
    assert [r["step"] for r in b_records] == [7, 8]
    # It goes on compressing, as the same state resumed on its own layout does (the step the
    # reshard wrote was once ignored: the warm-up started over, uncompressed).
    own = train_metrics(tmp_path / "own", 2, [
        *TINY, *ONEBIT, "training.steps=8", "optimization.gradient_accumulation=2",
        f"optimization.checkpoint.load_from={tmp_path / 'b' / 'checkpoints' / 'step-6'}"])
    assert [r["loss"] for r in own] == [r["loss"] for r in b_records]
    assert [r["comm_bytes"] for r in own] == [r["comm_bytes"] for r in b_records]
