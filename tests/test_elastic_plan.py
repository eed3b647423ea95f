"""``training.elastic``'s re-plan (``mcpar.elastic`` through ``resolve_plan``), without a cluster.

Why these tests: the shrink must keep every degree but data and the global batch exactly (the
sequences of each step depend on it, so the losses of a shrunken job match), and every world
that cannot hold the layout must be a clear refusal (exit 2 naming the key), never a job that
trains a different batch or a silently different layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mcpar.config import load_config
from mcpar.elastic import resize_record
from mcpar.errors import UserError
from mcpar.plan import resolve_plan
from tests.conftest import run_cli_in_process

ELASTIC = ["training.elastic.min_world=2", "parallelism.data=4",
           "optimization.micro_batch_size=2"]


def test_shrink_halves_data_and_doubles_accumulation() -> None:
    cfg = load_config(None, ELASTIC)
    full, shrunk = resolve_plan(cfg, 4), resolve_plan(cfg, 2)
    assert (full.dp, full.num_microbatches, full.elastic) == (4, 1, None)
    assert (shrunk.dp, shrunk.num_microbatches) == (2, 2)
    assert shrunk.global_batch_size == full.global_batch_size == 8
    assert shrunk.micro_batch_size == full.micro_batch_size == 2
    assert shrunk.elastic is not None
    assert shrunk.elastic.asked["data"] == 4 and shrunk.elastic.planned["data"] == 2
    assert shrunk.elastic.asked["num_microbatches"] == 1
    assert shrunk.elastic.planned["num_microbatches"] == 2
    # The decision is the plan's: its resolved config, plan.json and the timeout follow it.
    assert shrunk.config.parallelism.data == 2
    assert shrunk.config.optimization.gradient_accumulation == 2
    assert shrunk.config.optimization.global_batch_size == 8
    assert json.loads(json.dumps(shrunk.to_json()))["elastic"]["planned"]["world_size"] == 2
    assert shrunk.collective_timeout_s == 30.0  # wait_s, below collective_timeout_s 300
    # Re-resolving the resolved config on the same world changes nothing.
    again = resolve_plan(shrunk.config, 2)
    assert (again.dp, again.num_microbatches, again.global_batch_size) == (2, 2, 8)


def test_shrink_keeps_tensor_and_pipeline_degrees() -> None:
    cfg = load_config(None, [*ELASTIC, "parallelism.tensor=2", "parallelism.pipeline=2",
                             "training.elastic.min_world=8", "model.num_layers=4",
                             "optimization.gradient_accumulation=2"])
    plan = resolve_plan(cfg, 8)  # of 16
    assert (plan.dp, plan.tp, plan.pp, plan.num_microbatches) == (2, 2, 2, 4)
    assert plan.global_batch_size == 2 * 2 * 4 == resolve_plan(cfg, 16).global_batch_size


def test_elastic_off_keeps_the_old_refusal() -> None:
    cfg = load_config(None, ["parallelism.data=4"])
    with pytest.raises(UserError) as err:
        resolve_plan(cfg, 2)
    assert "parallelism:" in err.value.problems[0]


@pytest.mark.parametrize(("settings", "world", "key"), [
    ([], 1, "training.elastic.min_world"),  # fewer workers than min_world
    (["parallelism.tensor=2", "training.elastic.min_world=1"], 3, "parallelism"),
    (["optimization.micro_batch_size=1", "training.elastic.min_world=1"], 3,
     "optimization.micro_batch_size"),  # global batch 4 over data 3
    (["parallelism.experts=4", "model.kind=moe"], 2, "parallelism.experts"),
])
def test_a_world_that_cannot_hold_the_layout_is_refused(settings: list[str], world: int,
                                                        key: str) -> None:
    cfg = load_config(None, [*ELASTIC, *settings])
    with pytest.raises(UserError) as err:
        resolve_plan(cfg, world)
    assert any(p.startswith(key + ":") for p in err.value.problems), err.value.problems


def test_refusal_under_torchrun_exits_2_naming_min_world(
        capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    # One worker of a torchrun job that restarted on a single worker: refused before anything.
    for name, value in {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                        "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                        "MASTER_PORT": "29999", "TORCHELASTIC_RUN_ID": "t"}.items():
        monkeypatch.setenv(name, value)
    result = run_cli_in_process(capsys, "train", *sum((["--set", s] for s in ELASTIC), []))
    assert result.returncode == 2
    assert "training.elastic.min_world" in result.stderr
    assert "Traceback" not in result.stderr


def test_elastic_needs_a_global_batch_to_keep() -> None:
    cfg = load_config(None, ["training.elastic.min_world=1"])
    with pytest.raises(UserError) as err:
        resolve_plan(cfg, 2)
    assert err.value.problems[0].startswith("training.elastic:")
    ok = load_config(None, ["training.elastic.min_world=1",
                            "optimization.global_batch_size=32"])
    assert resolve_plan(ok, 2).num_microbatches == 1  # data 2 x 16 per micro-batch
    assert resolve_plan(ok, 1).num_microbatches == 2


def test_resize_record_names_both_layouts() -> None:
    cfg = load_config(None, ELASTIC)
    full, shrunk = resolve_plan(cfg, 4), resolve_plan(cfg, 2)
    saved = full.config.model_dump(mode="json")
    record = resize_record(saved, 4, shrunk.config, 2)
    assert record is not None and record["direction"] == "shrink"
    assert record["from"]["data"] == 4 and record["to"]["data"] == 2  # type: ignore[index]
    assert record["to"]["num_microbatches"] == 2  # type: ignore[index]
    assert resize_record(saved, 4, full.config, 4) is None
    back = resize_record(shrunk.config.model_dump(mode="json"), 2, full.config, 4)
    assert back is not None and back["direction"] == "grow"
    assert resize_record(saved, 4, load_config(None, ["parallelism.data=2"]), 2) is None


def test_keeping_a_returning_node_out_is_refused_before_launch(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    # The agents, not the job, take a node that comes back: a config cannot promise otherwise.
    config = tmp_path / "job.yaml"
    config.write_text("training: {elastic: {min_world: 1, grow: false}}\n")
    result = run_cli_in_process(capsys, "check", str(config))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "training.elastic.grow" in result.stderr and "--nnodes MIN:" in result.stderr
    config.write_text("training: {elastic: {min_world: 1, grow: true}}\n")
    assert run_cli_in_process(capsys, "check", str(config)).returncode == 0


def test_workers_under_an_agent_store_rendezvous_under_their_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # torchrun's c10d agent keeps one store for its life: a restarted world must not read the
    # keys (gloo addresses) its predecessor wrote there.
    import datetime

    import torch.distributed as dist

    from mcpar.launch.env import DistEnv, find_free_port, rendezvous_args

    port = find_free_port()
    env = DistEnv(0, 2, 0, 2, "127.0.0.1", port, "torchrun")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert rendezvous_args(env, datetime.timedelta(seconds=5)) == {
        "init_method": f"tcp://127.0.0.1:{port}"}
    agent = dist.TCPStore("127.0.0.1", port, 1, is_master=True,
                          timeout=datetime.timedelta(seconds=5))
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    stores = []
    for start in ("0", "1"):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", start)
        stores.append(rendezvous_args(env, datetime.timedelta(seconds=5))["store"])
    stores[0].set("rank_0", "dead address")  # type: ignore[attr-defined]
    assert not stores[1].check(["rank_0"])  # type: ignore[attr-defined]
    assert agent.check(["mcpar/start0/world2/rank_0"])

