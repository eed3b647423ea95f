"""The planner: fast at 1024 GPUs, every pick fits, never worse than a published layout."""

from __future__ import annotations

import time

import pytest

from mcpar.errors import UserError
from mcpar.sim.costmodel import simulate
from mcpar.sim.hardware import cluster_preset, load_accelerators
from mcpar.sim.planner import SearchSpace, best_or_error, plan
from mcpar.sim.runs import packaged_runs, predict_run
from mcpar.sim.workload import MODEL_PRESETS

ACC = load_accelerators()


@pytest.mark.parametrize("model,cluster", [("gpt3-175b", "a100x1024"),
                                           ("mixtral-8x7b", "h100x1024")])
def test_plans_1024_gpus_within_30_seconds(model: str, cluster: str) -> None:
    preset = MODEL_PRESETS[model]
    start = time.process_time()
    result = plan(preset.shape, cluster_preset(cluster, ACC), preset.global_batch,
                  preset.precision)
    assert time.process_time() - start < 30
    assert len(result.candidates) >= 10
    steps = [c.prediction.step_s for c in result.candidates]
    assert steps == sorted(steps)
    for cand in result.candidates:
        assert cand.prediction.fits
        assert cand.layout.num_gpus == 1024


def test_best_layout_beats_or_matches_each_published_layout() -> None:
    for run in packaged_runs(ACC):
        published = predict_run(run)
        result = plan(run.model, run.cluster, run.layout.global_batch, run.layout.precision,
                      extra=[run.layout], keep=5)
        best = result.candidates[0]
        assert best.prediction.fits, run.id
        assert best.prediction.step_s <= published.step_s * (1 + 1e-9), run.id
        # The pick is a real layout: simulating it again gives the same step.
        again = simulate(run.model, best.layout, run.cluster, where=run.id)
        assert again.step_s == pytest.approx(best.prediction.step_s)


def test_restricted_space_is_respected() -> None:
    preset = MODEL_PRESETS["gpt3-13b"]
    space = SearchSpace(recompute=("full",), zero_stages=(0,), compression=("none",),
                        topology=("flat",), tp=(8,), sequence_parallel=False)
    result = plan(preset.shape, cluster_preset("a100x128", ACC), preset.global_batch, "bf16",
                  space)
    for cand in result.candidates:
        lay = cand.layout
        assert (lay.tp, lay.recompute, lay.zero_stage, lay.compression, lay.topology,
                lay.seq_parallel) == (8, "full", 0, "none", "flat", False)


def test_a_model_that_fits_nowhere_is_a_clear_error() -> None:
    preset = MODEL_PRESETS["llama3-405b"]
    cluster = cluster_preset("a100-40gbx8", ACC)
    result = plan(preset.shape, cluster, preset.global_batch, "bf16", where="--model llama3-405b")
    assert not result.candidates
    with pytest.raises(UserError) as err:
        best_or_error(result, cluster, "--model llama3-405b")
    text = str(err.value)
    assert text.startswith("--model llama3-405b: no layout on 8 x A100-40GB fits in 40 GiB")
    assert "smallest footprint" in text
