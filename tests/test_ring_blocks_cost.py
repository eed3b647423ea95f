"""The ring-attention blocks as the local profile times them and the cost model prices them:
the scores each rank computes, the measured cost's formula, and where the price comes from."""

from __future__ import annotations

import math
from dataclasses import fields, replace

import pytest
import torch

from mcpar import ring_blocks
from mcpar.ring_blocks import LocalRing
from mcpar.ring_geometry import score_elements
from mcpar.sim.compute import ring_core_times, roofline
from mcpar.sim.hardware import LocalProfile, RingBlockCost
from mcpar.sim.localprofile import local_cluster, ring_block_cost
from mcpar.sim.microbench import RING_NOTE, ring_block_notes
from mcpar.sim.profilestore import field_problems
from mcpar.sim.workload import Layout, ModelShape

COST = RingBlockCost(fwd_call_s=1e-4, fwd_step_s=5e-5, fwd_per_score_low_s=2e-9,
                     fwd_per_score_high_s=5e-9, bwd_call_s=3e-4, bwd_step_s=8e-5,
                     bwd_per_score_low_s=4e-9, bwd_per_score_high_s=1.2e-8)


def _profile(ring: RingBlockCost | None) -> LocalProfile:
    notes: dict[str, float] = {"flops_all_cores": 140e9}
    if ring is not None:
        notes.update({RING_NOTE + f.name: getattr(ring, f.name) for f in fields(ring)})
    return LocalProfile(
        cores=2, flops_per_thread=80e9, attention_flops_per_thread=25e9,
        mem_bw_per_thread=12e9, mem_bw_total=20e9, op_overhead_s=8e-5, layer_overhead_s=7e-4,
        collectives={"ar": [2.5e-3, 1e-9], "p2p": [1.5e-3, 1e-10]}, notes=notes)


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_score_elements_counts_the_scores_every_rank_computes(
        ranks: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each rank of the zigzag, the first (higher blocks only) and the last (lower blocks only)
    included, computes its own 2c x 2c block and ranks - 1 blocks of 2c^2 scores."""
    computed: list[int] = []
    original = ring_blocks._scores

    def counting(q: torch.Tensor, k: torch.Tensor, scale: float, causal: bool) -> torch.Tensor:
        out = original(q, k, scale, causal)
        computed.append(out.numel())
        return out

    monkeypatch.setattr(ring_blocks, "_scores", counting)
    b, heads, tokens, dh = 2, 3, 8, 4
    for rank in range(ranks):
        computed.clear()
        q, k, v = (torch.randn(b, heads, tokens, dh) for _ in range(3))
        ring_blocks.ring_blocks(q, k, v, LocalRing(rank, ranks))
        assert len(computed) == ranks
        assert sum(computed) == score_elements(b * heads, tokens, ranks), rank


def test_local_ring_hands_the_blocks_of_the_ring_without_other_ranks() -> None:
    """A rank's blocks come from every other rank once, in ring order, each a copy."""
    ring = LocalRing(1, 4)
    assert [ring.source(step) for step in range(4)] == [1, 0, 3, 2]
    block = torch.randn(2, 3)
    send, recv, received = ring.shift(block, ring_blocks.KV_TAG)
    send.wait()
    recv.wait()
    assert torch.equal(received, block) and received.data_ptr() != block.data_ptr()


def test_ring_block_cost_by_hand() -> None:
    """call + (ranks - 1) step + scores x the per-score cost, linear in the head dimension
    between the two timed ones (32 and 128) and beyond, never below 0; over ``threads``."""
    fwd, bwd = COST.seconds(ranks=3, scores=1e6, head_dim=64, threads=2)
    third = (64 - 32) / (128 - 32)
    assert fwd == pytest.approx(1e-4 + 2 * 5e-5 + 1e6 * (2e-9 + third * 3e-9) / 2)
    assert bwd == pytest.approx(3e-4 + 2 * 8e-5 + 1e6 * (4e-9 + third * 8e-9) / 2)
    assert COST.seconds(2, 1e6, 128)[0] == pytest.approx(1e-4 + 5e-5 + 1e6 * 5e-9)
    falling = replace(COST, fwd_per_score_low_s=5e-9, fwd_per_score_high_s=1e-9)
    assert falling.seconds(2, 1e6, 512)[0] == pytest.approx(1e-4 + 5e-5)  # clipped at 0


def test_ring_core_times_prices_the_measured_blocks_and_falls_back_without() -> None:
    """A profile that timed the blocks prices them as timed (one thread a worker here: 4
    workers on 2 cores); one from before the measurement prices the GEMMs and score passes."""
    m = ModelShape(layers=4, hidden=256, heads=4, kv_heads=4, ffn=1024, ffn_kind="gelu",
                   seq_len=128, vocab=512)
    lay = Layout(cp=2, dp=2, global_batch=32, micro_batch=8, context_mode="ring",
                 precision="fp32")
    measured = replace(local_cluster(_profile(COST)), num_gpus=4)
    older = replace(local_cluster(_profile(None)), num_gpus=4)
    assert measured.ring_blocks == COST and older.ring_blocks is None
    eff = measured.efficiency
    assert eff is not None
    got = ring_core_times(m, lay, measured, roofline(measured, lay, eff))
    want = COST.seconds(2, score_elements(8 * 4, 64, 2), 64, threads=1)
    assert got == pytest.approx(want)
    fallback = ring_core_times(m, lay, older, roofline(older, lay, eff))
    assert fallback != pytest.approx(want)


def test_ring_block_cost_needs_every_note() -> None:
    """A profile missing one of the notes (an older version's) has no ring cost."""
    full = _profile(COST)
    assert ring_block_cost(full) == COST
    partial = replace(full, notes={k: v for k, v in full.notes.items()
                                   if k != RING_NOTE + "bwd_step_s"})
    assert ring_block_cost(partial) is None


@pytest.mark.parametrize("bad", [-1e-9, math.nan, math.inf])
def test_a_ring_note_that_no_measurement_gives_is_named(bad: float, tmp_path) -> None:
    profile = _profile(COST)
    profile = replace(profile, notes={**profile.notes, RING_NOTE + "fwd_per_score_low_s": bad})
    problems = field_problems(profile, tmp_path / "p.json", "measure it again")
    assert any(f"notes.{RING_NOTE}fwd_per_score_low_s" in p for p in problems), problems


def test_ring_block_notes_measure_every_field() -> None:
    """The measurement gives every field, finite and >= 0, a fixed cost for a call of two
    blocks in each pass, and score work that costs time. (How that cost splits between the
    call and its second block is a difference of two timings: at 20 ms windows on a loaded
    machine a clean-clone CI run found the backward's call 0 and its step 0.38 ms, so only the
    sum is asserted, and the windows are 0.1 s; the profile times 0.2 s.)"""
    torch.set_num_threads(1)
    notes = ring_block_notes(torch.device("cpu"), 0.1)
    assert set(notes) == {RING_NOTE + f.name for f in fields(RingBlockCost)}
    assert all(math.isfinite(v) and v >= 0 for v in notes.values()), notes
    cost = RingBlockCost(**{f.name: notes[RING_NOTE + f.name] for f in fields(RingBlockCost)})
    assert cost.fwd_call_s + cost.fwd_step_s > 0 and cost.bwd_call_s + cost.bwd_step_s > 0
    empty = cost.seconds(2, 0.0, 64)
    sized = cost.seconds(2, score_elements(16, 128, 2), 64)
    assert sized[0] > empty[0] and sized[1] > empty[1]
