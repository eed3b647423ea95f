"""`mcpar plan` and `mcpar train` agree (issue 18, must-show 6): every ZeRO layout the planner
ranks, written into a job config, is one that train's checks (``resolve_plan``, which applies
``capabilities.zero_layout_problems``, and ``unsupported_settings``) accept; and the planner's
filter is what makes it so."""

from __future__ import annotations

from dataclasses import replace

import pytest

from mcpar.capabilities import unsupported_settings, zero_layout_problems
from mcpar.config import JobConfig, load_config
from mcpar.plan import resolve_plan
from mcpar.sim.fromconfig import config_model
from mcpar.sim.hardware import Cluster, cluster_preset, load_accelerators
from mcpar.sim.planner import (
    SearchSpace,
    _variants,
    all_variants,
    plan,
    train_problems,
)
from mcpar.sim.workload import Layout

ACC = load_accelerators()
TOPOLOGY = {"flat": "flat", "hierarchical": "hierarchical", "auto": "hybrid"}
# mcpar has no context axis; every other setting the planner chooses is searched.
SPACE = SearchSpace(cp=(1,))


def model_overrides(layers: int, hidden: int, heads: int, seq: int, vocab: int) -> list[str]:
    return [f"model.num_layers={layers}", f"model.hidden_size={hidden}",
            f"model.num_heads={heads}", f"model.seq_len={seq}", f"model.vocab_size={vocab}",
            "model.tie_embeddings=false", "training.dtype=bfloat16"]


def layout_config(base: list[str], lay: Layout) -> JobConfig:
    """`lay` written into the config keys train reads."""
    schedule = ("gpipe" if lay.schedule == "gpipe" else
                "interleaved_1f1b" if lay.vp > 1 else "1f1b")
    return load_config(None, base + [
        f"parallelism.data={lay.dp}", f"parallelism.tensor={lay.tp}",
        f"parallelism.pipeline={lay.pp}", f"parallelism.virtual_stages={lay.vp}",
        f"parallelism.sequence_parallel={str(lay.seq_parallel).lower()}",
        f"parallelism.schedule={schedule}",
        f"optimization.global_batch_size={lay.global_batch}",
        f"optimization.micro_batch_size={lay.micro_batch}",
        f"controllers.memory.zero_stage={lay.zero_stage}",
        f"controllers.memory.allocation={lay.allocation}",
        f"controllers.memory.activation_checkpointing={lay.recompute}",
        f"controllers.communication.compression={lay.compression}",
        f"controllers.communication.weight_gather={lay.weight_gather}",
        f"controllers.communication.topology={TOPOLOGY[lay.topology]}",
    ])


def ranked_zero_layouts(base: list[str], cluster: Cluster, global_batch: int) -> list[Layout]:
    m = config_model(load_config(None, base))
    result = plan(m, cluster, global_batch, "bf16", SPACE, keep=100)
    assert result.candidates
    return [c.layout for c in result.candidates if c.layout.zero_stage > 0]


CASES = {
    # A small GPT on 4 nodes of 8 GPUs whose fabric makes the store worth ranking.
    "small": (model_overrides(8, 1024, 16, 1024, 32768),
              replace(cluster_preset("a100-40gbx32", ACC), inter_bw=100e9 / 8 / 8), 256),
    # GPT-3 175B on 1024 A100s (a 200 Gb/s NIC per GPU), where ZeRO layouts rank high.
    "gpt3-1024": (model_overrides(96, 12288, 96, 2048, 51200),
                  cluster_preset("a100x1024", ACC), 1536),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_ranked_zero_layout_is_accepted_by_train(case: str) -> None:
    base, cluster, global_batch = CASES[case]
    layouts = ranked_zero_layouts(base, cluster, global_batch)
    assert layouts, "the planner ranked no ZeRO layout: nothing was checked"
    for lay in layouts:
        cfg = layout_config(base, lay)
        job = resolve_plan(cfg, lay.num_gpus)  # raises UserError naming what train refuses
        assert job.dp == lay.dp and job.config.controllers.memory.zero_stage == lay.zero_stage
        # Nothing is refused, activation recompute included (the planner's recompute modes
        # are train's).
        assert unsupported_settings(cfg) == [], lay


def test_the_store_and_its_codecs_are_ranked_where_nodes_are_slow() -> None:
    base, cluster, global_batch = CASES["small"]
    layouts = ranked_zero_layouts(base, cluster, global_batch)
    assert any(lay.allocation == "topology_aware" for lay in layouts)
    assert any(lay.weight_gather == "int8" for lay in layouts)
    assert any(lay.compression == "int8" for lay in layouts)


def test_without_the_filter_the_planner_would_rank_what_train_refuses() -> None:
    core = Layout(tp=2, pp=1, dp=16, global_batch=256, micro_batch=2, precision="bf16")
    every = list(all_variants(core, SPACE, multi_node_dp=True))
    kept = list(_variants(core, SPACE, multi_node_dp=True))
    refused = [lay for lay in every if lay not in kept]
    # e.g. ZeRO with hierarchical collectives (a ZeRO rule). The codecs' own rules (16-bit
    # compression under ZeRO without the store) are their registry entries', applied before a
    # variant is priced at all: no variant breaks one.
    assert any(lay.zero_stage > 0 and lay.topology == "hierarchical" for lay in refused)
    assert not any(lay.zero_stage > 0 and lay.compression == "bf16"
                   and lay.allocation == "default" for lay in every)
    assert any(lay.zero_stage == 3 and lay.compression == "bf16" for lay in kept)
    for lay in refused:
        assert train_problems(lay)
    for lay in kept:
        assert not zero_layout_problems(
            lay.zero_stage, lay.dp, pp=lay.pp, vp=lay.vp, topology=TOPOLOGY[lay.topology],
            allocation=lay.allocation, weight_gather=lay.weight_gather)
    # The store, both its codecs and the int8 gathers survive the filter.
    assert {(lay.allocation, lay.compression, lay.weight_gather) for lay in kept
            if lay.zero_stage == 3} >= {("topology_aware", c, g) for c in ("none", "bf16", "int8")
                                       for g in ("none", "int8")}
