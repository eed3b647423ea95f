"""Tensor (and sequence) parallelism: the sharded model computes the single-process math.

Real worker processes on gloo (DESIGN.md §5). Each worker builds the full reference GPT and an
identical copy that it shards, runs one forward and backward of both on the same batch, and saves
its loss, gradients, parameter shapes and communication counts; the parent reassembles the shards
of every rank and compares them with the reference.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import spawn_workers

from mcpar.config import ModelConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.launch.env import find_free_port
from mcpar.models.spec import get_model_spec
from mcpar.parallel.stage import cut_model, whole_model
from mcpar.parallel.tensor import (
    apply_tensor_parallel,
    is_tp_sharded,
    sync_sequence_parallel_grads,
    vocab_parallel_cross_entropy,
)
from mcpar.topology import ParallelDims

LAYERS, HIDDEN, HEADS, SEQ, VOCAB, BATCH = 2, 32, 4, 16, 64, 2
FFN = 4 * HIDDEN
SEED = 7
SPEC = get_model_spec("gpt")

# (sequence_parallel, tie_embeddings, as two pipeline stages) run by each world size, all in one
# spawn per size. The staged case shards two StageModules (one without head, one without
# embedding) and runs them one after the other.
CASES = {
    2: [(False, False, False), (True, False, False), (False, True, False), (True, True, False),
        (True, False, True)],
    4: [(False, False, False), (True, False, False), (True, True, False)],
}


def model_config(tie: bool, **overrides: int) -> ModelConfig:
    fields = dict(num_layers=LAYERS, hidden_size=HIDDEN, num_heads=HEADS, seq_len=SEQ,
                  vocab_size=VOCAB, tie_embeddings=tie)
    return ModelConfig(**{**fields, **overrides})


def run_case(comm: CommunicationController, rank: int, world: int, sp: bool, tie: bool,
             staged: bool) -> dict:
    cfg = model_config(tie)
    reference = SPEC.build(cfg, SEED)
    full = SPEC.build(cfg, SEED)
    if staged:
        ranges = [(0, LAYERS // 2), (LAYERS // 2, LAYERS)]
        pieces = [cut_model(full, ranges, stage, SPEC.pieces) for stage in range(2)]
    else:
        pieces = [whole_model(full, SPEC.pieces)]
    for piece in pieces:
        apply_tensor_parallel(piece, SPEC.tensor_parallel, comm, rank, world, sequence_parallel=sp)
    sharded = torch.nn.Sequential(*pieces)
    params = {full_name(name, pieces): p for name, p in sharded.named_parameters()}

    gen = torch.Generator().manual_seed(SEED + 1)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)

    ref_loss = F.cross_entropy(reference(tokens).view(-1, VOCAB), targets.view(-1))
    ref_loss.backward()

    comm.stats.total.clear()
    local_logits = sharded(tokens)
    loss = vocab_parallel_cross_entropy(local_logits, targets, comm, rank, world)
    loss.backward()
    sync_sequence_parallel_grads(params.values(), comm)

    return {
        "ref_loss": ref_loss.item(),
        "loss": loss.item(),
        "logits_shape": tuple(local_logits.shape),
        "ref_grads": {n: p.grad.clone() for n, p in reference.named_parameters()},
        "grads": {n: p.grad.clone() for n, p in params.items()},
        "sharded": {n for n, p in params.items() if is_tp_sharded(p)},
        "numel": {n: p.numel() for n, p in params.items()},
        "tied_is_same": pieces[-1].head.out.weight is pieces[0].embed.tok.weight,
        "comm": comm.stats.breakdown("total"),
    }


def run_dropout(comm: CommunicationController, rank: int, world: int, sp: bool) -> dict:
    """Training mode with dropout: no parity promise, but the replicas must stay consistent."""
    torch.manual_seed(SEED)  # the same RNG stream on every tp rank, as the trainer gives them
    model = whole_model(SPEC.build(model_config(False, dropout=0.1), SEED), SPEC.pieces)
    apply_tensor_parallel(model, SPEC.tensor_parallel, comm, rank, world, sequence_parallel=sp)
    model.train()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    loss = vocab_parallel_cross_entropy(model(tokens), tokens, comm, rank, world)
    loss.backward()
    sync_sequence_parallel_grads(model.parameters(), comm)
    return {"loss": loss.item(),
            "replicated": {n: p.grad.clone() for n, p in model.named_parameters()
                           if not is_tp_sharded(p)}}


def full_name(name: str, pieces: list[torch.nn.Module]) -> str:
    """'1.blocks.0.x' of Sequential(stage0, stage1) -> 'blocks.<layer>.x' of the full GPT."""
    index, rest = name.split(".", 1)
    first_layer = getattr(pieces[int(index)], "first_layer", 0)
    if rest.startswith("blocks."):
        _, layer, tail = rest.split(".", 2)
        return f"blocks.{first_layer + int(layer)}.{tail}"
    return rest


def worker(rank: int, world: int, port: int, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    try:
        dims = ParallelDims(dp=1, tp=world, pp=1, ep=1, world_size=world)
        dims.build_mesh("cpu")
        comm = CommunicationController(dims)
        results = {case: run_case(comm, rank, world, *case) for case in CASES[world]}
        if world == 2:
            results["dropout"] = {sp: run_dropout(comm, rank, world, sp) for sp in (False, True)}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[dict]]:
    """world size -> per-rank results of every case."""
    out: dict[int, list[dict]] = {}
    for world in CASES:
        out_dir = tmp_path_factory.mktemp(f"tp{world}")
        spawn_workers(worker, args=(world, find_free_port(), str(out_dir)), nprocs=world, join=True)
        out[world] = [torch.load(out_dir / f"rank{r}.pt") for r in range(world)]
    return out


def assemble(name: str, shards: list[torch.Tensor]) -> torch.Tensor:
    """The full tensor from every rank's slice, by the layout the algorithm prescribes."""
    if name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
        # Each rank holds q|k|v of its own heads: regroup per projection, then concatenate.
        per_proj = [s.view(3, s.shape[0] // 3, *s.shape[1:]) for s in shards]
        full = torch.cat(per_proj, dim=1)
        return full.reshape(-1, *full.shape[2:])
    if name.endswith("attn.proj.weight") or name.endswith("mlp.proj.weight"):
        return torch.cat(shards, dim=1)  # row-parallel: input columns
    return torch.cat(shards, dim=0)  # column-parallel outputs, vocabulary rows


ALL_CASES = [(world, case) for world, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("world,case", ALL_CASES)
def test_loss_matches_single_process(results: dict[int, list[dict]], world: int,
                                     case: tuple[bool, bool, bool]) -> None:
    for rank_results in results[world]:
        r = rank_results[case]
        assert abs(r["loss"] - r["ref_loss"]) <= 1e-5, (r["loss"], r["ref_loss"])
        assert r["logits_shape"] == (BATCH, SEQ, VOCAB // world)  # never gathered
    assert results[world][0][case]["ref_loss"] > 3.0  # ~ln(64): a real, untrained loss


@pytest.mark.parametrize("world,case", ALL_CASES)
def test_gradients_match_single_process(results: dict[int, list[dict]], world: int,
                                        case: tuple[bool, bool, bool]) -> None:
    ranks = [rank_results[case] for rank_results in results[world]]
    ref_grads = ranks[0]["ref_grads"]
    assert set(ranks[0]["grads"]) == set(ref_grads)  # same names, tied weight listed once
    expected_sharded = {n for n in ref_grads if n.endswith(("qkv.weight", "qkv.bias", "fc.weight",
                                                            "fc.bias", "proj.weight"))}
    expected_sharded |= {"embed.tok.weight"} | ({"head.out.weight"} if not case[1] else set())
    assert ranks[0]["sharded"] == expected_sharded
    for name, ref in ref_grads.items():
        assert ref.abs().max() > 0, name  # every gradient is exercised
        if name in expected_sharded:
            full = assemble(name, [r["grads"][name] for r in ranks])
            torch.testing.assert_close(full, ref, atol=1e-5, rtol=0, msg=name)
        else:
            for r in ranks:
                torch.testing.assert_close(r["grads"][name], ref, atol=1e-5, rtol=0, msg=name)
    if case[1]:
        assert all(r["tied_is_same"] for r in ranks)


def test_per_rank_parameter_count_under_tp2(results: dict[int, list[dict]]) -> None:
    r = results[2][0][(False, False, False)]
    full_numel = {n: g.numel() for n, g in r["ref_grads"].items()}
    for name, numel in r["numel"].items():
        if name in r["sharded"]:
            assert 2 * numel == full_numel[name], name
        else:
            assert numel == full_numel[name], name
    h, f, s = HIDDEN, FFN, SEQ
    # Replicated: position embedding, 2 LayerNorms and 2 row-parallel biases per block, ln_final.
    replicated = s * h + LAYERS * (2 * 2 * h + 2 * h) + 2 * h
    sharded = VOCAB * h + LAYERS * (3 * h * h + 3 * h + h * h + h * f + f + f * h) + VOCAB * h
    assert sharded + replicated == SPEC.num_params(model_config(tie=False))
    assert sum(r["numel"].values()) == sharded // 2 + replicated == 15_520


def test_comm_bytes_are_the_algorithms_count(results: dict[int, list[dict]]) -> None:
    n, f32 = 2, 4
    activation = BATCH * SEQ * HIDDEN * f32
    # Loss: the max over [batch, seq], then the sum of exp and the target logit in one buffer.
    loss_bytes = BATCH * SEQ * f32 + 2 * BATCH * SEQ * f32
    ring = 2 * (n - 1) / n

    # Without SP: the embedding's forward all-reduce, per block the two g's (forward) and two f's
    # (backward), the head's f (backward), and the loss's two all-reduces.
    rows = results[2][0][(False, False, False)]["comm"]
    assert {(row["op"], row["axis"]) for row in rows} == {("all_reduce", "tp")}
    num_activation = 1 + 4 * LAYERS + 1
    assert rows[0]["calls"] == num_activation + 2
    assert rows[0]["bytes"] == ring * (num_activation * activation + loss_bytes)

    # With SP each of those all-reduces becomes a reduce-scatter plus an all-gather, each sending
    # (n-1)/n of the activation; then one all-reduce of the partial replicated gradients.
    rows = {row["op"]: row for row in results[2][0][(True, False, False)]["comm"]}
    sp_params = SEQ * HIDDEN + LAYERS * (2 * 2 * HIDDEN + 2 * HIDDEN) + 2 * HIDDEN
    half = (n - 1) / n * activation
    assert rows["reduce_scatter"]["calls"] == rows["all_gather"]["calls"] == num_activation
    assert rows["reduce_scatter"]["bytes"] == rows["all_gather"]["bytes"] == num_activation * half
    assert rows["all_reduce"]["calls"] == 3
    assert rows["all_reduce"]["bytes"] == ring * (loss_bytes + sp_params * f32)


@pytest.mark.parametrize("sp", [False, True])
def test_dropout_keeps_replicas_consistent(results: dict[int, list[dict]], sp: bool) -> None:
    ranks = [rank_results["dropout"][sp] for rank_results in results[2]]
    assert all(abs(r["loss"] - ranks[0]["loss"]) == 0 and 3.0 < r["loss"] < 6.0 for r in ranks)
    for name, grad in ranks[0]["replicated"].items():
        assert torch.isfinite(grad).all() and grad.abs().max() > 0, name
        torch.testing.assert_close(ranks[1]["replicated"][name], grad, atol=1e-6, rtol=0,
                                   msg=name)


def test_tp1_is_plain_cross_entropy() -> None:
    # Without a process group every axis has size 1: the sharded model is the model itself.
    cfg = model_config(tie=False)
    comm = CommunicationController(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    reference = SPEC.build(cfg, SEED)
    model = whole_model(SPEC.build(cfg, SEED), SPEC.pieces)
    apply_tensor_parallel(model, SPEC.tensor_parallel, comm, 0, 1, sequence_parallel=True)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    targets = tokens.roll(-1, dims=1)
    loss = vocab_parallel_cross_entropy(model(tokens), targets, comm, 0, 1)
    ref = F.cross_entropy(reference(tokens).view(-1, VOCAB), targets.view(-1))
    loss.backward()
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=1e-6, rtol=0)
    ref_grads = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[name].grad, atol=1e-6, rtol=0, msg=name)


@pytest.mark.parametrize("overrides,tp,sp,message", [
    ({}, 3, False, r"4 attention heads \(attn.num_heads\) are not divisible"),
    ({"ffn_hidden_size": 66}, 4, False, "mlp.fc width 66"),
    ({"vocab_size": 66}, 4, False, "vocabulary size 66"),
    ({"seq_len": 18}, 4, True, "seq_len 18"),
])
def test_indivisible_shapes_are_rejected(overrides: dict[str, int], tp: int, sp: bool,
                                         message: str) -> None:
    model = whole_model(SPEC.build(model_config(tie=False, **overrides), SEED), SPEC.pieces)
    comm = CommunicationController(ParallelDims(dp=1, tp=tp, pp=1, ep=1, world_size=tp))
    with pytest.raises(ValueError, match=message):
        apply_tensor_parallel(model, SPEC.tensor_parallel, comm, 0, tp, sequence_parallel=sp)
