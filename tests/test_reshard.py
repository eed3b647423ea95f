"""Resharding maps: a model sharded under one layout, assembled through its index maps and
sharded again under another (or streamed into the other's tensors piece by piece, as a resume
does), equals the other layout's direct shards exactly."""

from __future__ import annotations

import pytest
import torch

from mcpar.checkpoint.reshard import ELEMENT_BITS, coordinate_codes, reshard, shard_maps
from mcpar.checkpoint.shard_targets import Runs, ShardTargets
from mcpar.config import ModelConfig
from mcpar.controllers.compute.stage_cut import partition_layers
from mcpar.models.spec import get_model_spec
from mcpar.parallel.pipeline import global_stage
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tensor import apply_tensor_parallel

MODEL = ModelConfig(num_layers=4, hidden_size=32, num_heads=4, seq_len=16, vocab_size=64)


def real_shards(pp: int, virtual: int, pp_rank: int, tp: int, tp_rank: int
                ) -> dict[str, torch.Tensor]:
    """What parallelize gives this coordinate: the seeded model, cut and tensor-sharded."""
    spec = get_model_spec("gpt")
    full = spec.build(MODEL, 7)
    ranges = partition_layers(MODEL, pp * virtual)
    chunks = [cut_model(full, ranges, global_stage(c, pp_rank, pp), spec.pieces)
              for c in range(virtual)]
    if tp > 1:
        for chunk in chunks:
            apply_tensor_parallel(chunk, spec.tensor_parallel, None,  # type: ignore[arg-type]
                                  tp_rank, tp, False)
    return {f"{i}.{n}": p.detach().clone() for i, c in enumerate(chunks)
            for n, p in c.named_parameters()}


LAYOUTS = [(1, 1, 1), (1, 2, 1), (2, 1, 1), (2, 2, 1), (2, 1, 2), (1, 4, 1)]  # pp, tp, virtual


@pytest.mark.parametrize("old", LAYOUTS)
@pytest.mark.parametrize("new", [(1, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2)])
def test_reshard_equals_direct_sharding(old: tuple[int, int, int],
                                        new: tuple[int, int, int]) -> None:
    pp, tp, virtual = old
    saved = {(p, t): real_shards(pp, virtual, p, tp, t) for p in range(pp) for t in range(tp)}
    npp, ntp, nvirtual = new
    for p in range(npp):
        for t in range(ntp):
            maps = shard_maps(MODEL, "gpt", npp, nvirtual, p, ntp, t)
            got = reshard(MODEL, "gpt", {"pipeline": pp, "tensor": tp, "virtual_stages": virtual},
                          lambda a, b: saved[(a, b)], maps)
            want = real_shards(npp, nvirtual, p, ntp, t)
            assert got.keys() == want.keys()
            for name in want:
                assert torch.equal(got[name], want[name]), name


def test_maps_cover_every_element() -> None:
    # Sharded tensors split the elements; replicated ones (norms, biases of row-parallel
    # layers, positions) repeat on each tensor rank. Together they cover the model exactly.
    codes = torch.cat([c.reshape(-1) for p in range(2) for t in range(2)
                       for c in shard_maps(MODEL, "gpt", 2, 1, p, 2, t).values()])
    full = get_model_spec("gpt").build(MODEL, 0)
    assert codes.unique().numel() == sum(p.numel() for p in full.parameters())
    assert codes.numel() > codes.unique().numel()


@pytest.mark.parametrize("old", LAYOUTS)
@pytest.mark.parametrize("new", [(1, 1, 1), (2, 2, 1), (1, 4, 1), (2, 1, 2)])
def test_streamed_shards_equal_direct_sharding(old: tuple[int, int, int],
                                               new: tuple[int, int, int]) -> None:
    """What a resume streams (``ShardTargets``: this rank's tensors as runs, each saved piece
    matched as it comes, with the codes a batch of blocks at a time) equals the new layout's
    direct shards, element for element, with every element covered."""
    pp, tp, virtual = old
    npp, ntp, nvirtual = new
    for p in range(npp):
        for t in range(ntp):
            want = real_shards(npp, nvirtual, p, ntp, t)
            live = {name: torch.full_like(value, float("nan")) for name, value in want.items()}
            targets = ShardTargets(coordinate_codes(MODEL, "gpt", npp, nvirtual, p, ntp, t))
            targets.add_kind("param", {n: [(0, v.numel(), v)] for n, v in live.items()})
            for op in range(pp):
                for ot in range(tp):
                    saved = real_shards(pp, virtual, op, tp, ot)
                    for name, codes in coordinate_codes(MODEL, "gpt", pp, virtual, op, tp, ot):
                        targets.scatter("param", codes, saved[name])
            assert targets.missing("param") == 0
            for name in want:
                assert torch.equal(live[name], want[name]), name


def test_runs_find_elements_of_unordered_and_broken_slices() -> None:
    # Elements 10..13 then 0..3 then 20..21 (a slice whose runs are out of element order).
    codes = torch.tensor([10, 11, 12, 13, 0, 1, 2, 3, 20, 21]) + (5 << ELEMENT_BITS)
    runs = Runs.of(codes)
    assert runs.parameter == 5 and runs.starts.tolist() == [0, 10, 20]
    at, inside = runs.positions(torch.tensor([3, 4, 9, 10, 21, 22]))
    assert inside.tolist() == [True, False, False, True, True, False]
    assert at.tolist() == [7, 0, 9]
    with pytest.raises(ValueError, match="several parameters"):
        Runs.of(torch.tensor([0, 1 << ELEMENT_BITS]))
