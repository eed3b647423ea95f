"""PowerSGD gradient compression through the CommunicationController.

In-process tests check the orthogonalization and the single-rank math; one spawn of 2 gloo
ranks checks the properties that need real communication: identical results on every rank, the
plain average before ``start_iter``, exactness when the rank covers the matrix, the error
feedback's bookkeeping, the bytes on the wire and a state_dict round trip.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from conftest import data_parallel_comm, spawn_workers

from mcpar.comm.powersgd import PowerSGDCompressor, _orthogonalize
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.launch.env import find_free_port
from mcpar.topology import ParallelDims

WORLD = 2
# (32, 16) and (8, 4, 3) -> 8 x 12 are compressed at rank 2; (16,) is a vector and (3, 3) does
# not gain ((3 + 3) * 2 * 2 >= 9): both go uncompressed.
SHAPES = [(32, 16), (16,), (8, 4, 3), (3, 3)]
COMPRESSED = {0: (32, 16), 2: (8, 12)}
RANK, START, STEPS, SNAPSHOT = 2, 2, 8, 4
# Rank >= min(n, m): the approximation is exact.
EXACT_SHAPES = [(32, 3), (4, 20)]


def single_comm() -> CommunicationController:
    return CommunicationController(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))


def local_grads(shapes: list[tuple[int, ...]], step: int, rank: int) -> list[torch.Tensor]:
    """Rank ``rank``'s gradients at ``step``: a rank-1 part shared by all ranks plus per-rank
    noise, like real gradients (dominated by a few directions that persist across steps)."""
    gen = torch.Generator().manual_seed(100 * step + rank)
    common = torch.Generator().manual_seed(7)  # the same directions every step
    out = []
    for shape in shapes:
        rows, cols = shape[0], math.prod(shape[1:])
        base = torch.outer(torch.randn(rows, generator=common), torch.randn(cols, generator=common))
        out.append(base.reshape(shape) + 0.3 * torch.randn(shape, generator=gen))
    return out


# --- in-process ---------------------------------------------------------------------------

def test_orthogonalize_gives_orthonormal_columns_and_keeps_zero_columns() -> None:
    p = torch.randn(20, 4, generator=torch.Generator().manual_seed(0))
    _orthogonalize(p)
    torch.testing.assert_close(p.t() @ p, torch.eye(4), atol=1e-5, rtol=0)
    z = torch.zeros(5, 2)
    _orthogonalize(z)
    assert torch.equal(z, torch.zeros(5, 2))  # no NaN from an all-zero gradient


def test_rejects_bad_settings() -> None:
    for kwargs in ({"rank": 0, "start_iter": 0}, {"start_iter": -1},
                   {"start_iter": 0, "min_compression_rate": -1.0}):
        with pytest.raises(ValueError):
            PowerSGDCompressor(**kwargs)
    compressor = PowerSGDCompressor(start_iter=0, min_compression_rate=0.0)
    compressor.reduce([torch.ones(4, 4)], single_comm())
    with pytest.raises(ValueError, match="different list"):
        compressor.reduce([torch.ones(4, 5)], single_comm())


def test_single_rank_low_rank_matrix_is_reproduced() -> None:
    """One rank: G = c A Bᵀ of rank 2 is recovered exactly at rank 2, also warm-started."""
    gen = torch.Generator().manual_seed(1)
    compressor = PowerSGDCompressor(2, start_iter=0, min_compression_rate=1.0)
    low_rank = torch.randn(40, 2, generator=gen) @ torch.randn(2, 30, generator=gen)
    for step in range(3):
        truth = (1.0 - 0.4 * step) * low_rank
        grad = truth.clone()
        compressor.reduce([grad], single_comm())
        torch.testing.assert_close(grad, truth, atol=1e-4, rtol=1e-4)
    assert compressor.error_buffer(0).abs().max() < 1e-4


def test_keys_keep_separate_state_and_step_counts() -> None:
    """Bucket by bucket: each key has its own gradient list, state and step count."""
    compressor = PowerSGDCompressor(1, start_iter=1, min_compression_rate=0.0)
    bucket_a = [torch.ones(6, 5)]
    bucket_b = [torch.ones(4, 4), torch.ones(3)]
    for step in range(3):
        compressor.reduce(bucket_a, single_comm(), key=0)
        compressor.reduce(bucket_b, single_comm(), key=1)
        assert compressor.iteration(0) == compressor.iteration(1) == step + 1
    assert compressor.compressed_indices(0) == [0] and compressor.compressed_indices(1) == [0]
    torch.testing.assert_close(bucket_a[0], torch.ones(6, 5))  # rank 1 is exact for ones
    state = compressor.state_dict()
    assert set(state) == {0, 1} and state[1]["iteration"] == 3
    restored = PowerSGDCompressor(1, start_iter=1, min_compression_rate=0.0)
    restored.load_state_dict(state)
    with pytest.raises(ValueError, match="different set"):
        restored.reduce([torch.ones(3), torch.ones(4, 4)], single_comm(), key=1)


# --- 2 gloo ranks ---------------------------------------------------------------------------

def run_schedule(compressor: PowerSGDCompressor, comm: CommunicationController, rank: int,
                 shapes: list[tuple[int, ...]], first: int, last: int) -> dict:
    out: dict = {"inputs": {}, "outputs": {}, "bytes": {}}
    for step in range(first, last):
        grads = local_grads(shapes, step, rank)
        out["inputs"][step] = [g.clone() for g in grads]
        comm.stats.reset_step()
        compressor.reduce(grads, comm, axis="dp")
        out["bytes"][step] = comm.stats.breakdown("step")
        out["outputs"][step] = grads
    return out


def worker(rank: int, port: int, out_dir: str) -> None:
    with data_parallel_comm(rank, WORLD, port) as comm:
        result: dict = {}

        compressor = PowerSGDCompressor(RANK, start_iter=START, seed=3)
        result["main"] = run_schedule(compressor, comm, rank, SHAPES, 0, SNAPSHOT)
        saved = {key: {"iteration": group["iteration"],
                       "matrices": {i: {k: t.clone() for k, t in m.items()}
                                    for i, m in group["matrices"].items()}}
                 for key, group in compressor.state_dict().items()}
        rest = run_schedule(compressor, comm, rank, SHAPES, SNAPSHOT, STEPS)
        for key in rest:
            result["main"][key].update(rest[key])
        result["compressed_indices"] = compressor.compressed_indices()
        result["errors"] = {i: compressor.error_buffer(i).clone() for i in COMPRESSED}
        result["q"] = {i: m["q"].clone()
                       for i, m in compressor.state_dict()[0]["matrices"].items()}

        resumed = PowerSGDCompressor(RANK, start_iter=START, seed=3)
        resumed.load_state_dict(saved)
        result["resumed"] = run_schedule(resumed, comm, rank, SHAPES, SNAPSHOT, STEPS)

        exact = PowerSGDCompressor(4, start_iter=0, min_compression_rate=0.0, seed=5)
        result["exact"] = run_schedule(exact, comm, rank, EXACT_SHAPES, 0, 3)
        result["exact_errors"] = [exact.error_buffer(i).clone() for i in range(2)]
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("powersgd")
    spawn_workers(worker, args=(find_free_port(), str(out_dir)), nprocs=WORLD, join=True)
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def plain_average(ranks: list[dict], run: str, step: int) -> list[torch.Tensor]:
    inputs = [r[run]["inputs"][step] for r in ranks]
    return [(a + b) / 2 for a, b in zip(*inputs, strict=True)]


@pytest.mark.slow
def test_result_identical_on_every_rank(ranks: list[dict]) -> None:
    for run in ("main", "exact"):
        for step, outputs in ranks[0][run]["outputs"].items():
            for a, b in zip(outputs, ranks[1][run]["outputs"][step], strict=True):
                assert torch.equal(a, b), (run, step)
    for i in COMPRESSED:  # the warm-started Q is shared, the error feedback is not
        assert torch.equal(ranks[0]["q"][i], ranks[1]["q"][i])
        assert not torch.equal(ranks[0]["errors"][i], ranks[1]["errors"][i])


@pytest.mark.slow
def test_before_start_iter_is_the_plain_average(ranks: list[dict]) -> None:
    ring = 2 * (WORLD - 1) / WORLD
    all_numel = sum(math.prod(s) for s in SHAPES)
    for step in range(STEPS):
        outputs = ranks[0]["main"]["outputs"][step]
        expected = plain_average(ranks, "main", step)
        for index, (out, exp) in enumerate(zip(outputs, expected, strict=True)):
            if step < START or index not in COMPRESSED:
                assert torch.equal(out, exp), (step, index)  # a + b then / 2, as gloo does
        if step < START:
            rows = ranks[0]["main"]["bytes"][step]
            assert [(r["op"], r["codec"], r["calls"]) for r in rows] == [("all_reduce", "none", 1)]
            assert rows[0]["bytes"] == ring * 4 * all_numel


@pytest.mark.slow
def test_compressed_bytes_are_r_times_n_plus_m(ranks: list[dict]) -> None:
    assert ranks[0]["compressed_indices"] == sorted(COMPRESSED)
    ring = 2 * (WORLD - 1) / WORLD
    factors = sum(RANK * (n + m) for n, m in COMPRESSED.values())  # P and Q elements
    full = sum(n * m for n, m in COMPRESSED.values())
    uncompressed = sum(math.prod(s) for i, s in enumerate(SHAPES) if i not in COMPRESSED)
    for step in range(START, STEPS):
        rows = {(r["op"], r["codec"]): r for r in ranks[0]["main"]["bytes"][step]}
        assert set(rows) == {("all_reduce", "powersgd"), ("all_reduce", "none")}
        assert rows[("all_reduce", "powersgd")]["calls"] == 2  # all P's, then all Q's
        assert rows[("all_reduce", "powersgd")]["bytes"] == ring * 4 * factors
        assert rows[("all_reduce", "none")]["bytes"] == ring * 4 * uncompressed
    assert (factors, full) == (136, 608)  # the matrices travel 4.5x smaller


@pytest.mark.slow
def test_compressed_output_is_low_rank_and_close(ranks: list[dict]) -> None:
    for step in range(START, STEPS):
        outputs = ranks[0]["main"]["outputs"][step]
        expected = plain_average(ranks, "main", step)
        for index, (n, m) in COMPRESSED.items():
            approx = outputs[index].reshape(n, m)
            assert torch.linalg.matrix_rank(approx) <= RANK
            truth = expected[index].reshape(n, m)
            # Rank 2 of a rank-1-plus-noise matrix: the shared part (measured 0.20-0.30 off).
            assert (approx - truth).norm() < 0.4 * truth.norm()


@pytest.mark.slow
def test_error_feedback_accounts_for_every_difference(ranks: list[dict]) -> None:
    """e_{t+1} = G_t + e_t - approx_t per rank, so averaging over ranks and summing over the
    compressed steps telescopes: Σ_t (plain average_t - approx_t) = mean over ranks of e_T."""
    for index, (n, m) in COMPRESSED.items():
        total = torch.zeros(n, m)
        for step in range(START, STEPS):
            truth = plain_average(ranks, "main", step)[index].reshape(n, m)
            total += truth - ranks[0]["main"]["outputs"][step][index].reshape(n, m)
        mean_error = (ranks[0]["errors"][index] + ranks[1]["errors"][index]) / 2
        torch.testing.assert_close(total, mean_error, atol=1e-5, rtol=0)
        assert mean_error.abs().max() > 0.01  # a real residual, not a trivial zero


@pytest.mark.slow
def test_rank_covering_the_matrix_is_exact(ranks: list[dict]) -> None:
    for step in range(3):
        outputs = ranks[0]["exact"]["outputs"][step]
        for out, exp in zip(outputs, plain_average(ranks, "exact", step), strict=True):
            torch.testing.assert_close(out, exp, atol=1e-5, rtol=1e-5)
    # Each rank's error holds only its own deviation from the average (local M minus the
    # global approximation, as torch's hook and the paper's code keep it): zero on average.
    for e0, e1 in zip(ranks[0]["exact_errors"], ranks[1]["exact_errors"], strict=True):
        assert (e0 + e1).abs().max() < 1e-5
        assert e0.abs().max() > 0.1


@pytest.mark.slow
def test_state_dict_resume_is_bitwise(ranks: list[dict]) -> None:
    for r in ranks:
        for step in range(SNAPSHOT, STEPS):
            for a, b in zip(r["resumed"]["outputs"][step], r["main"]["outputs"][step],
                            strict=True):
                assert torch.equal(a, b)
