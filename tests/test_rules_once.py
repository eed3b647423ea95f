"""Rules written once: over a generated grid of layouts x gradient codecs x pipeline schedules x
memory options (ZeRO stages, recompute policies) x topologies, ``mcpar check``, ``mcpar train``
(its checks before launch), ``mcpar simulate`` and ``mcpar plan`` accept or refuse each point
identically, with the same messages. The codec, schedule and recompute rules are their registry
entries'; the ZeRO and store rules are ``capabilities.zero_layout_problems`` (one function)."""

from __future__ import annotations

import itertools

import pytest
from conftest import TINY

from mcpar.commands.train import validate_for_training
from mcpar.config import load_config
from mcpar.errors import UserError
from mcpar.plan import resolve_plan
from mcpar.registry.codec import CODECS
from mcpar.registry.recompute import RECOMPUTE_POLICIES
from mcpar.registry.schedule import SCHEDULES
from mcpar.sim.fromconfig import CONFIG_KEYS, config_layout, config_model
from mcpar.sim.planner import train_problems
from mcpar.sim.workload import layout_problems

WORLD = 4
BASE = [*TINY, "model.num_layers=4", "model.tie_embeddings=false", "training.steps=20",
        "optimization.micro_batch_size=1", "optimization.freeze_step=5",
        "controllers.communication.powersgd_start_step=5", "cluster.ranks_per_node=2"]
# (data, pipeline, virtual stages, micro-batches per step)
LAYOUTS = [(4, 1, 1, 1), (2, 2, 1, 1), (2, 2, 1, 2), (2, 2, 2, 2), (1, 4, 1, 3), (1, 4, 1, 4)]


def _grid() -> list[list[str]]:
    points = []
    for (dp, pp, vp, m), codec, schedule, zero, recompute, topology in itertools.product(
            LAYOUTS, CODECS.names(), SCHEDULES.names(), (0, 1, 3), RECOMPUTE_POLICIES.names(),
            ("flat", "hierarchical")):
        points.append([*BASE, f"parallelism.data={dp}", f"parallelism.pipeline={pp}",
                       f"parallelism.virtual_stages={vp}", f"parallelism.schedule={schedule}",
                       f"optimization.gradient_accumulation={m}",
                       f"controllers.communication.compression={codec}",
                       f"controllers.memory.zero_stage={zero}",
                       f"controllers.memory.activation_checkpointing={recompute}",
                       f"controllers.communication.topology={topology}"])
    return points


def _refusal(fn, *args) -> list[str]:  # type: ignore[no-untyped-def]
    try:
        fn(*args)
    except UserError as err:
        return sorted(set(err.problems))
    return []


def _check(settings: list[str]) -> list[str]:
    return _refusal(resolve_plan, load_config(None, settings), WORLD)


def _train(settings: list[str]) -> list[str]:
    return _refusal(validate_for_training, load_config(None, settings), WORLD)


def _simulated_problems(settings: list[str]) -> list[str]:
    """What the cost model refuses in the config's layout (``mcpar simulate CONFIG`` first
    resolves it as check does, then prices it: both sets of rules)."""
    cfg = load_config(None, settings)
    return layout_problems(config_model(cfg), config_layout(cfg, WORLD), WORLD, 2, "config",
                           CONFIG_KEYS)


def _simulate(settings: list[str]) -> list[str]:
    return sorted(set(_check(settings)) | set(_simulated_problems(settings)))


def _plan(settings: list[str]) -> list[str]:
    """What the planner refuses in the same layout: the cost model's rules and train's."""
    lay = config_layout(load_config(None, settings), WORLD)
    return sorted(set(_simulated_problems(settings)) | set(train_problems(lay)))


GRID = _grid()


def test_the_grid_is_large_and_has_both_verdicts() -> None:
    verdicts = [bool(_check(p)) for p in GRID]
    assert len(GRID) >= 6 * 6 * 3 * 3 * 3 * 2
    assert 0.1 < sum(verdicts) / len(verdicts) < 0.95


@pytest.mark.parametrize("chunk", range(6))
def test_check_train_simulate_and_plan_agree(chunk: int) -> None:
    mismatches = []
    for settings in GRID[chunk::6]:
        check = _check(settings)
        answers = {"train": _train(settings), "simulate": _simulate(settings),
                   "plan": _plan(settings)}
        for name, got in answers.items():
            if got != check:
                mismatches.append((settings[len(BASE):], name, check, got))
    assert not mismatches, mismatches[:3]
