"""1-bit Adam exchanged bucket by bucket from the backward pass, against the simulation.

With ``set_exchange_buckets`` each gradient bucket is its own compressed exchange (own error
buffers, own scales), started with ``launch_exchange`` as soon as the bucket's gradients are
final and committed by ``step``. Checked here on 2 gloo ranks over 20 steps: losses, parameters
and error buffers equal, bit for bit, a single-process simulation of the same per-bucket
algorithm; a step whose exchanges are discarded (a skipped step) leaves the error feedback as it
was; launching every bucket at once from the ``.grad`` fields (``launch_all_exchanges``, what
the trainer does after clipping) or leaving the exchanges to ``step`` is the same exchange,
pipelined over the buckets (asynchronous all-to-alls in flight together); and the bucketed
exchange sends what the whole-buffer one sends, give or take each bucket's padding and scales.
Helpers (model, data, warm-up average) come from test_onebit_adam.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import data_parallel_comm, spawn_workers
from test_onebit_adam import (
    FREEZE,
    STEPS,
    average_grads,
    build,
    lr_at,
    rank_gradients,
    shard_loss,
    single_comm,
)

from mcpar.comm.compression import OneBitErrorBuffers, simulate_onebit_allreduce
from mcpar.launch.env import find_free_port

WORLD = 2
DISCARDED = FREEZE + 3  # a compressed step whose first exchanges are thrown away
# Compressed steps whose buckets are exchanged together, pipelined (the path after clipping):
# launched by launch_all_exchanges, or run inside step() when nothing was launched.
FROM_GRADS = {FREEZE + 5, FREEZE + 6}
IN_STEP = {FREEZE + 7, FREEZE + 9}


def buckets_of(model: torch.nn.Module) -> list[list[torch.nn.Parameter]]:
    """Three buckets in reverse registration order, as DataParallelGradSync makes them."""
    params = list(reversed(list(model.parameters())))
    third = len(params) // 3
    return [params[:third], params[third:2 * third], params[2 * third:]]


def bucket_grad(bucket: list[torch.nn.Parameter]) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in bucket])


def worker(rank: int, port: int, out_dir: str) -> None:
    with data_parallel_comm(rank, WORLD, port) as comm:
        model, opt = build(comm)
        buckets = buckets_of(model)
        opt.set_exchange_buckets(buckets)
        out: dict = {"loss": {}, "bytes": {}}
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            model.zero_grad()
            loss = shard_loss(model, rank, step)
            loss.backward()
            comm.stats.reset_step()
            if not opt.compressing:
                average_grads(model, comm, WORLD, rank_ordered=False)
            else:
                if step == DISCARDED:
                    before = opt.error_buffers.worker.clone(), opt.error_buffers.server.clone()
                    for index, bucket in enumerate(buckets):
                        opt.launch_exchange(index, bucket_grad(bucket))
                    opt.discard_exchanges()
                    out["discard_kept_errors"] = (
                        torch.equal(before[0], opt.error_buffers.worker)
                        and torch.equal(before[1], opt.error_buffers.server))
                    comm.stats.reset_step()
                if step in FROM_GRADS:
                    opt.launch_all_exchanges()  # the same exchanges, from the .grad fields
                elif step in IN_STEP:
                    pass  # step() runs every bucket's exchange itself, pipelined
                else:
                    for index, bucket in enumerate(buckets):
                        opt.launch_exchange(index, bucket_grad(bucket))
            opt.step()
            out["bytes"][step] = comm.stats.step_bytes()
            out["loss"][step] = loss.item()
        out["params"] = [p.detach().clone() for p in model.parameters()]
        out["worker_error"] = opt.error_buffers.worker.clone()
        out["server_error"] = opt.error_buffers.server.clone()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))


def reference() -> dict:
    """One process: every rank's gradients, each bucket's exchange simulated on its own."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model, opt = build(single_comm())
        buckets = buckets_of(model)
        opt.set_exchange_buckets(buckets)
        params = list(model.parameters())
        position = {id(p): i for i, p in enumerate(params)}
        errors = [[OneBitErrorBuffers.zeros(opt.segment_numel(i), WORLD)
                   for i in range(len(buckets))] for _ in range(WORLD)]
        losses: dict[int, list[float]] = {}
        for step in range(1, STEPS + 1):
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            losses[step], grads = rank_gradients(model, WORLD, step)
            if not opt.compressing:
                for i, p in enumerate(params):
                    p.grad = (grads[0][i] + grads[1][i]) / WORLD
                opt.step()
                continue
            averaged = torch.empty(opt.numel)
            for index, bucket in enumerate(buckets):
                local = [opt.segment_momentum(index, torch.cat(
                    [grads[rank][position[id(p)]].reshape(-1) for p in bucket]))
                    for rank in range(WORLD)]
                result = simulate_onebit_allreduce(
                    local, [errors[r][index].worker for r in range(WORLD)],
                    [errors[r][index].server for r in range(WORLD)])
                opt.scatter_segment(averaged, index, result[0])
            opt.apply_compressed_momentum(averaged)
        return {"loss": losses, "params": [p.detach().clone() for p in params],
                "errors": errors}
    finally:
        torch.set_num_threads(threads)


def test_bucketed_exchange_matches_simulation_bit_for_bit(tmp_path: Path) -> None:
    spawn_workers(worker, args=(find_free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]
    ref = reference()
    for rank, r in enumerate(ranks):
        assert all(r["loss"][s] == ref["loss"][s][rank] for s in range(1, STEPS + 1)), rank
        assert all(torch.equal(p, q) for p, q in zip(r["params"], ref["params"], strict=True))
        # Each bucket's errors lie one after the other in the optimizer's error storage.
        assert torch.equal(r["worker_error"],
                           torch.cat([e.worker for e in ref["errors"][rank]]))
        assert torch.equal(r["server_error"],
                           torch.cat([e.server for e in ref["errors"][rank]]))
        assert r["discard_kept_errors"]
    # Compressed steps send about 1 bit per element: 3 buckets x 2 all-to-alls, each message
    # padded to whole bytes per chunk and carrying a 4-byte scale.
    numel = sum(p.numel() for p in ranks[0]["params"])
    for step in range(FREEZE + 1, STEPS + 1):
        assert ranks[0]["bytes"][step] <= numel / 8 + 3 * 2 * (8 + 4), ranks[0]["bytes"][step]
        assert ranks[0]["bytes"][step] <= 4 * numel / 25


def test_buckets_must_cover_every_parameter_once() -> None:
    model, opt = build(single_comm())
    params = list(model.parameters())
    for bad in ([params[:-1]], [params, params[:1]]):
        with pytest.raises(ValueError, match="exactly once"):
            opt.set_exchange_buckets(bad)
    opt.set_exchange_buckets([params[:2], params[2:]])
    assert opt.num_segments == 2


def test_launch_outside_the_compression_stage_is_refused() -> None:
    model, opt = build(single_comm())
    opt.set_exchange_buckets([list(model.parameters())])
    with pytest.raises(RuntimeError, match="compression-stage"):
        opt.launch_exchange(0, torch.zeros(opt.numel))
