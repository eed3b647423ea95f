"""Config schema: aliases, defaults, and one clear line per problem naming the key path."""

from __future__ import annotations

from pathlib import Path

import pytest

from mcpar.config import JobConfig, apply_overrides, load_config, parse_config
from mcpar.errors import UserError
from mcpar.plan import resolve_plan

REPO = Path(__file__).resolve().parents[1]


def problems_of(raw: dict, overrides: list[str] | None = None) -> list[str]:
    with pytest.raises(UserError) as info:
        parse_config(apply_overrides(raw, overrides or []))
    return info.value.problems


def test_every_field_has_a_description() -> None:
    def walk(model: type) -> list[str]:
        missing = []
        for name, field in model.model_fields.items():
            sub = field.annotation
            if isinstance(sub, type) and hasattr(sub, "model_fields"):
                missing += [f"{name}.{m}" for m in walk(sub)]
            elif not field.description:
                missing.append(name)
        return missing

    assert walk(JobConfig) == []


def test_seed_config_loads_with_french_keys_and_values() -> None:
    cfg = load_config(REPO / "configs" / "seed_mcp.yaml")
    assert (cfg.parallelism.tensor, cfg.parallelism.pipeline, cfg.parallelism.data,
            cfg.parallelism.experts) == (8, 4, 32, 16)
    assert cfg.controllers.compute.scheduler == "reinforcement"
    assert cfg.controllers.compute.batch_splitting == "dynamic"
    assert cfg.controllers.memory.allocation == "topology_aware"
    assert cfg.controllers.memory.offload == "nvme"
    assert cfg.controllers.communication.compression == "1bit"
    assert cfg.controllers.communication.topology == "hybrid"
    assert cfg.optimization.gradient_accumulation == 8
    assert cfg.optimization.checkpoint.interval == 1000
    assert cfg.optimization.checkpoint.strategy == "selective"
    plan = resolve_plan(cfg, None)
    assert (plan.world_size, plan.tp, plan.pp, plan.dp, plan.ep) == (1024, 8, 4, 32, 16)


def test_unknown_key_suggests_nearest() -> None:
    (line,) = problems_of({"model": {"num_layer": 2}})
    assert line.startswith("model.num_layer: unknown key")
    assert "did you mean 'model.num_layers'" in line


def test_unknown_section_suggests_nearest() -> None:
    (line,) = problems_of({"parallelsim": {"data": 2}})
    assert "did you mean 'parallelism'" in line


def test_wrong_type_and_out_of_range_name_the_key() -> None:
    lines = problems_of({"model": {"hidden_size": "big"}, "optimization": {"lr": -1}})
    assert len(lines) == 2
    assert any(x.startswith("model.hidden_size:") and "'big'" in x for x in lines)
    assert any(x.startswith("optimization.lr:") and "greater than 0" in x for x in lines)


def test_bad_enum_value_lists_choices() -> None:
    (line,) = problems_of({"controllers": {"communication": {"compression": "2bit"}}})
    assert line.startswith("controllers.communication.compression:")
    assert "'1bit'" in line and "'2bit'" in line


def test_overrides_are_validated_like_the_file() -> None:
    cfg = parse_config(apply_overrides({}, ["parallelism.tensor=2", "training.dtype=bfloat16"]))
    assert cfg.parallelism.tensor == 2 and cfg.training.dtype == "bfloat16"
    (line,) = problems_of({}, ["training.steps=0"])
    assert line.startswith("training.steps:")
    (line,) = problems_of({}, ["training.stepz=3"])
    assert "did you mean 'training.steps'" in line
    # French key paths are accepted in overrides too.
    cfg = parse_config(apply_overrides({}, ["parallelisation.tensorielle=4"]))
    assert cfg.parallelism.tensor == 4
    with pytest.raises(UserError, match="KEY=VALUE"):
        apply_overrides({}, ["parallelism.tensor"])


def layout_problems(overrides: list[str], world_size: int | None) -> list[str]:
    cfg = parse_config(apply_overrides({}, overrides))
    with pytest.raises(UserError) as info:
        resolve_plan(cfg, world_size)
    return info.value.problems


def test_degrees_must_multiply_to_world_size() -> None:
    (line,) = layout_problems(["parallelism.data=2", "parallelism.tensor=2"], 2)
    assert line.startswith("parallelism:") and "= 4 devices" in line and "has 2" in line


def test_heads_not_divisible_by_tensor() -> None:
    (line,) = layout_problems(["model.num_heads=6", "model.hidden_size=96",
                               "parallelism.tensor=4"], None)
    assert line.startswith("model.num_heads:") and "parallelism.tensor 4" in line


def test_global_batch_not_divisible() -> None:
    (line,) = layout_problems(["optimization.global_batch_size=10",
                               "optimization.micro_batch_size=4"], 2)
    assert line.startswith("optimization.global_batch_size:") and "4 x data 2 = 8" in line


def test_several_layout_problems_are_all_reported() -> None:
    lines = layout_problems(["model.num_heads=3", "parallelism.tensor=2",
                             "model.num_layers=1", "parallelism.pipeline=2"], 4)
    keys = sorted(line.split(":")[0] for line in lines)
    assert keys == ["model.num_heads", "model.num_heads", "model.num_layers"]


def test_data_degree_and_accumulation_are_derived_into_the_plan_not_the_config() -> None:
    cfg = parse_config(apply_overrides({}, ["optimization.global_batch_size=32",
                                            "optimization.micro_batch_size=4"]))
    plan = resolve_plan(cfg, 4)
    assert plan.dp == 4 and plan.num_microbatches == 2 and plan.global_batch_size == 32
    # The plan's config is the resolved one (config.yaml); the user's is left as it was.
    assert plan.config.parallelism.data == 4
    assert plan.config.optimization.gradient_accumulation == 2
    assert cfg.parallelism.data is None and cfg.optimization.gradient_accumulation is None


def test_a_validated_config_cannot_be_assigned_to() -> None:
    cfg = parse_config(apply_overrides({}, ["parallelism.data=2"]))
    for section, key, value in (("parallelism", "data", 4), ("optimization",
                                "gradient_accumulation", 3), ("model", "num_layers", 9)):
        with pytest.raises(Exception, match="frozen"):
            setattr(getattr(cfg, section), key, value)
    with pytest.raises(Exception, match="frozen"):
        cfg.model = cfg.model  # type: ignore[misc]
    assert cfg.parallelism.data == 2 and cfg.model.num_layers == 4
    # Resolving a plan, twice, never writes to it either.
    first, second = resolve_plan(cfg, 2), resolve_plan(cfg, 2)
    assert first == second and cfg.optimization.gradient_accumulation is None


def test_config_reference_is_current() -> None:
    from mcpar.config.reference import render

    assert (REPO / "docs" / "config.md").read_text() == render(), (
        "regenerate with: python -m mcpar.config.reference > docs/config.md"
    )


# --- communication: combinations that cannot work -------------------------------------------

@pytest.mark.parametrize("overrides,world,key,words", [
    (["controllers.communication.compression=powersgd", "optimization.optimizer=onebit_adam"], 2,
     "controllers.communication.compression", "'onebit_adam'"),
    (["controllers.communication.compression=1bit"], 1,
     "controllers.communication.compression", "data 1"),
    (["optimization.optimizer=onebit_adam"], 1, "optimization.optimizer", "data 1"),
    (["controllers.communication.compression=1bit", "optimization.freeze_step=300"], 2,
     "optimization.freeze_step", "never compress"),
    (["controllers.communication.compression=1bit", "controllers.memory.zero_stage=1"], 2,
     "controllers.memory.zero_stage", "zero_stage 0"),
    (["controllers.communication.compression=powersgd",
      "controllers.communication.powersgd_start_step=400"], 2,
     "controllers.communication.powersgd_start_step", "never compress"),
    (["cluster.inter_node_bandwidth_gbps=10"], 2, "cluster", "all four"),
    # PowerSGD runs over the whole data axis in one group: under a hierarchical or hybrid
    # topology it would run flat while the log says otherwise, so it is refused.
    (["controllers.communication.compression=powersgd",
      "controllers.communication.topology=hierarchical"], 2,
     "controllers.communication.topology", "'powersgd'"),
    (["controllers.communication.compression=powersgd",
      "controllers.communication.topology=hybrid"], 2,
     "controllers.communication.topology", "'powersgd'"),
])
def test_impossible_communication_settings_are_refused(overrides: list[str], world: int,
                                                       key: str, words: str) -> None:
    (line,) = layout_problems(overrides, world)
    assert line.startswith(key + ":") and words in line, line


def test_compression_settings_that_work_pass() -> None:
    for overrides in (["controllers.communication.compression=1bit"],
                      ["optimization.optimizer=onebit_adam"],
                      ["controllers.communication.compression=powersgd"],
                      ["controllers.communication.compression=1bit",
                       "controllers.communication.topology=hierarchical"],
                      ["controllers.communication.compression=fp16",
                       "controllers.communication.topology=hybrid"]):
        cfg = parse_config(apply_overrides({}, overrides))
        assert resolve_plan(cfg, 2).dp == 2


@pytest.mark.parametrize("overrides,world,words", [
    (["cluster.ranks_per_node=3"], 4, "do not fill nodes of 3"),
    (["cluster.ranks_per_node=4", "parallelism.tensor=2"], 6, "do not fill nodes"),
    # tensor 2 x data 3 on nodes of 3 ranks: data group (0, 2, 4) has 2 ranks on one node
    # and 1 on the other.
    (["cluster.ranks_per_node=3", "parallelism.tensor=2"], 6, "spread unevenly"),
])
def test_hierarchical_needs_whole_nodes(overrides: list[str], world: int, words: str) -> None:
    lines = layout_problems(["controllers.communication.topology=hierarchical", *overrides],
                            world)
    assert len(lines) == 1 and lines[0].startswith("cluster.ranks_per_node:"), lines
    assert words in lines[0]
