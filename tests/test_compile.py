"""``training.compile``: torch.compile per transformer block, applied last, composes with data,
tensor and pipeline parallelism: the compiled runs' losses equal the eager runs' of the same
layout (|delta loss| <= 1e-4 over 20 fp32 steps), and the first step's compile time is logged apart
from the step times.

Equal losses do not show that compiled code ran: a block that fell back to eager trains the
same. So each run's ``summary.json`` ``compile`` (``parallel/compiled_graphs.py``) is read per
rank: every rank's blocks ran compiled graphs, no frame failed, and no frame held more graphs
than the layout needs; torch's recompile limit is not raised, and a frame past it raises.

Cost: inductor's C++ backend compiles on CPU, tens of seconds per new graph on a loaded 2-core
machine. The layouts share one inductor cache (TORCHINDUCTOR_CACHE_DIR, module-scoped), so the
block graph the data-parallel run compiles is reused by the pipeline run (one block per stage,
the same graph); tensor parallelism's sharded block compiles its own. A shared cache could hide
nothing the per-rank counts would not show: a cached graph still runs as compiled code, counted
by each rank. Evaluation runs eagerly (compile.py), so no forward-only graph is compiled."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from conftest import TINY, train_metrics

from mcpar.config import ModelConfig
from mcpar.models.spec import get_model_spec
from mcpar.parallel.compile import compile_blocks
from mcpar.parallel.stage import whole_model

STEPS = 20
# One global batch for every layout (2 micro-batches of 4, or one per data rank).
SETTINGS = [*TINY, f"training.steps={STEPS}", "training.dtype=float32",
            "optimization.global_batch_size=8", "optimization.micro_batch_size=4"]


@pytest.fixture(scope="module")
def inductor_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One inductor cache for every compiled run of this module and their ranks."""
    path = tmp_path_factory.mktemp("inductor")
    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(path)
    yield path
    if before is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)
    else:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = before


def test_compile_sets_a_compiled_forward_on_every_block_and_keeps_the_names() -> None:
    cfg = ModelConfig(num_layers=3, hidden_size=32, num_heads=2, seq_len=16)
    spec = get_model_spec("gpt")
    model = whole_model(spec.build(cfg, 0), spec.pieces)
    names = list(model.state_dict())
    assert compile_blocks([model]) == 3
    blocks = model.pieces()[1]
    assert all(hasattr(block.forward, "compiled") for block in blocks)
    assert list(model.state_dict()) == names  # checkpoints see the same parameters


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["data", "pipeline", "tensor"])  # data first: it fills the cache
def test_compiled_losses_equal_eager(layout: str, inductor_cache: Path, tmp_path: Path) -> None:
    settings = [*SETTINGS, f"parallelism.{layout}=2"]
    eager = train_metrics(tmp_path / "eager", 2, settings)
    records = train_metrics(tmp_path / "compiled", 2, [*settings, "training.compile=true"])
    assert len(records) == len(eager) == STEPS
    for ref, rec in zip(eager, records, strict=True):
        assert abs(ref["loss"] - rec["loss"]) <= 1e-4, (layout, rec["step"], ref, rec)
    # The compile happened in the first step only (no recompiles: the collectives run eagerly,
    # compile.py) and is logged apart from its step time.
    assert records[0]["compile_s"] > 0
    assert all("compile_s" not in r for r in records[1:])
    assert any(inductor_cache.iterdir())
    assert torch.isfinite(torch.tensor([r["loss"] for r in records])).all()
    # Compiled code ran on every rank, every step: no eager fallback in any layout.
    compiled = json.loads((tmp_path / "compiled" / "summary.json").read_text())["compile"]
    assert len(compiled["ranks"]) == 2 and compiled["ranks_without_compiled_calls"] == []
    for rank, c in enumerate(compiled["ranks"]):
        assert c["modules"] >= 1 and c["graphs"] >= 1, (layout, rank, c)
        assert c["graph_calls"] >= STEPS, (layout, rank, c)  # a graph per micro-batch at least
        assert c["frames_failed"] == 0, (layout, rank, c)
        assert c["most_per_frame"] <= 2, (layout, rank, c)
    eager_summary = json.loads((tmp_path / "eager" / "summary.json").read_text())
    assert "compile" not in eager_summary


def test_the_counts_tell_compiled_code_from_an_eager_fallback() -> None:
    """The same blocks run compiled count a call of compiled code per block; run eagerly (what
    a silent fallback does) they leave graph_calls still."""
    from mcpar.parallel import compiled_graphs

    cfg = ModelConfig(num_layers=2, hidden_size=32, num_heads=2, seq_len=16)
    spec = get_model_spec("gpt")
    model = whole_model(spec.build(cfg, 0), spec.pieces)
    compile_blocks([model])
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len))
    before = compiled_graphs.counts()
    model(tokens).float().sum().backward()
    ran = compiled_graphs.counts()
    assert ran.graph_calls > before.graph_calls and ran.graphs > before.graphs
    assert ran.modules >= 2 and ran.frames_failed == 0  # counted when compiled
    with torch.compiler.set_stance("force_eager"):  # an eager fallback, forced
        model(tokens).float().sum().backward()
    assert compiled_graphs.counts().graph_calls == ran.graph_calls
