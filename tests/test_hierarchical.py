"""Hierarchical all-reduce (reduce-scatter in the node, all-reduce across nodes, all-gather in
the node) gives the flat ring's result, for uneven sizes and several node x rank shapes; its
bytes are counted per stage; 'hybrid' picks per size from the link model."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import data_parallel_comm, spawn_workers

from mcpar.comm.collectives import LinkModel, choose_all_reduce, fit_link
from mcpar.launch.env import find_free_port
from mcpar.topology import detect_node_of_rank

SIZES = [1, 3, 7, 1000, 12345]


def worker(rank: int, world: int, ranks_per_node: int, port: int, out_dir: str) -> None:
    with data_parallel_comm(rank, world, port) as comm:
        dims = comm.dims
        comm.set_dp_topology("hierarchical", detect_node_of_rank(ranks_per_node))
        out: dict[str, object] = {"intra": dims.dp_intra, "inter": dims.dp_inter}
        for size in SIZES:
            gen = torch.Generator().manual_seed(1000 * size + rank)
            data = torch.randn(size, generator=gen)
            flat = data.clone()
            comm.all_reduce(flat, axis="dp")
            comm.stats.reset_step()
            hier = data.clone()
            comm.dp_all_reduce(hier).wait()
            out[f"bytes{size}"] = comm.stats.breakdown("step")
            hier_async = data.clone()
            comm.dp_all_reduce(hier_async, async_op=True).wait()
            half = data.clone()
            comm.dp_all_reduce(half, codec="bf16").wait()
            out[f"flat{size}"] = flat
            out[f"hier{size}"] = hier
            out[f"async{size}"] = hier_async
            out[f"bf16{size}"] = half
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


SHAPES = [(2, 2), (2, 1), (4, 1), (1, 2)]  # (nodes, ranks per node)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[int, int], list[dict]]:
    out = {}
    for nodes, per_node in SHAPES:
        d = tmp_path_factory.mktemp(f"hier{nodes}x{per_node}")
        world = nodes * per_node
        spawn_workers(worker, args=(world, per_node, find_free_port(), str(d)), nprocs=world,
                 join=True)
        out[(nodes, per_node)] = [torch.load(d / f"rank{r}.pt") for r in range(world)]
    return out


@pytest.mark.parametrize("shape", SHAPES)
def test_hierarchical_equals_flat(results: dict, shape: tuple[int, int]) -> None:
    nodes, per_node = shape
    for rank_out in results[shape]:
        assert (rank_out["inter"], rank_out["intra"]) == (nodes, per_node)
        for size in SIZES:
            flat = rank_out[f"flat{size}"]
            assert torch.allclose(rank_out[f"hier{size}"], flat, rtol=1e-6, atol=1e-6)
            assert torch.allclose(rank_out[f"async{size}"], flat, rtol=1e-6, atol=1e-6)
            # bf16 on the inter-node wire (whole wire when one rank per node).
            assert torch.allclose(rank_out[f"bf16{size}"], flat, rtol=2e-2, atol=5e-2)
    # Every rank ends with the same numbers.
    for size in SIZES:
        first = results[shape][0][f"hier{size}"]
        for rank_out in results[shape][1:]:
            assert torch.equal(rank_out[f"hier{size}"], first)


def test_hierarchical_bytes_are_counted_per_stage(results: dict) -> None:
    size = 12345  # padded to 12346 for 2 ranks per node
    rows = {(r["op"], r["axis"]): r["bytes"] for r in results[(2, 2)][0][f"bytes{size}"]}
    padded_bytes = 12346 * 4
    assert rows[("reduce_scatter", "dp_intra")] == pytest.approx(padded_bytes / 2)
    assert rows[("all_reduce", "dp_inter")] == pytest.approx(2 * 1 / 2 * padded_bytes / 2)
    assert rows[("all_gather", "dp_intra")] == pytest.approx(padded_bytes / 2)
    assert ("all_reduce", "dp") not in rows


def test_hybrid_choice_follows_the_link_model() -> None:
    slow_inter = LinkModel(5e-6, 100e9 / 8, 200e-6, 100e6 / 8)
    assert choose_all_reduce(4 << 20, 2, 2, slow_inter) == "hierarchical"
    # Inside a node, or one rank per node, the two algorithms are the same: flat.
    assert choose_all_reduce(4 << 20, 4, 1, slow_inter) == "flat"
    assert choose_all_reduce(4 << 20, 1, 4, slow_inter) == "flat"
    # A node whose internal links are slower than the network (e.g. PCIe through the host
    # against one NIC per GPU) makes the extra intra-node stages a loss.
    slow_intra = LinkModel(500e-6, 1e9 / 8, 5e-6, 100e9 / 8)
    assert choose_all_reduce(1 << 20, 2, 2, slow_intra) == "flat"


def test_fit_link_recovers_alpha_beta() -> None:
    alpha, beta, n = 50e-6, 1e9, 4

    def ring(nbytes: float) -> float:
        return 2 * (n - 1) * (alpha + nbytes / n / beta)

    lat, bw = fit_link(ring(8), 8, ring(1 << 20), 1 << 20, n)
    assert lat == pytest.approx(alpha, rel=1e-6)
    assert bw == pytest.approx(beta, rel=1e-6)
