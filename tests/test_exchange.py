"""``Communicator.exchange_async``: reduce-scatters and all-gathers carried by one all-to-all
give what the separate collectives give, and are counted as they are."""

from __future__ import annotations

import os

import torch
from conftest import data_parallel_comm, spawn_workers

from mcpar.launch.env import find_free_port

WORLD = 3  # odd: no layout that only works for 2 ranks
RS_SIZES = (5, 1)  # elements per rank of each reduce-scatter's output
AG_SIZE = 4  # elements of this rank's shard


def _inputs(rank: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    scatter = [torch.randn(WORLD * size, generator=gen) for size in RS_SIZES]
    return scatter, torch.randn(AG_SIZE, generator=gen)


def worker(rank: int, port: int, out_dir: str) -> None:
    with data_parallel_comm(rank, WORLD, port) as comm:
        scatter, shard = _inputs(rank)
        separate_rs = [torch.empty(size) for size in RS_SIZES]
        comm.stats.reset_step()
        for out, src in zip(separate_rs, scatter, strict=True):
            comm.reduce_scatter_into(out, src)
        separate_ag = comm.all_gather_into(torch.empty(WORLD * AG_SIZE), shard)
        separate_bytes = comm.stats.step_bytes_by_axis()
        comm.stats.reset_step()
        fused_rs = [torch.empty(size) for size in RS_SIZES]
        fused_ag = torch.empty(WORLD * AG_SIZE)
        comm.exchange_async(list(zip(fused_rs, scatter, strict=True)),
                            [(fused_ag, shard)]).wait()
        fused_bytes = comm.stats.step_bytes_by_axis()
        only_rs = torch.empty(RS_SIZES[0])
        comm.exchange_async([(only_rs, scatter[0])], []).wait()
        torch.save({"separate_rs": separate_rs, "separate_ag": separate_ag,
                    "fused_rs": fused_rs, "fused_ag": fused_ag, "only_rs": only_rs,
                    "separate_bytes": separate_bytes, "fused_bytes": fused_bytes},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def test_one_all_to_all_carries_reduce_scatters_and_all_gathers(tmp_path) -> None:
    spawn_workers(worker, args=(find_free_port(), str(tmp_path)), nprocs=WORLD)
    inputs = [_inputs(r) for r in range(WORLD)]
    gathered = torch.cat([shard for _, shard in inputs])
    for rank in range(WORLD):
        out = torch.load(tmp_path / f"rank{rank}.pt")
        for i, size in enumerate(RS_SIZES):
            want = sum(scatter[i].view(WORLD, size)[rank] for scatter, _ in inputs)
            assert torch.allclose(out["fused_rs"][i], want, atol=1e-6)
            assert torch.allclose(out["separate_rs"][i], want, atol=1e-6)
        assert torch.equal(out["fused_ag"], gathered)
        assert torch.equal(out["separate_ag"], gathered)
        assert torch.equal(out["only_rs"], out["fused_rs"][0])
        # The same bytes in the books as the collectives it stands for.
        assert out["fused_bytes"] == out["separate_bytes"]
        assert out["fused_bytes"]["dp"] > 0
