"""TensorBoard's view of a run: grouped scalar tags, the resolved config once at start; and a
1-process run with checkpoints whose stderr carries none of DCP's one-process notes."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import TINY, run_mcpar, sets

from mcpar.config import load_config, to_yaml
from mcpar.metrics import REQUIRED_FIELDS, TB_TAGS, RunLogger, flatten_scalars, tensorboard_tag

# Every key the trainer writes into a metrics record (trainer.py's ``record``, the profiler's
# "mfu", and the optional ones).
TRAINER_KEYS = (*REQUIRED_FIELDS, "comm_bytes_by_axis", "exposed_comm_s", "skipped", "compile_s",
                "moe", "mfu", "consistency_check_s", "val_loss", "slowest_rank",
                "grad_sync_spread_s")
GROUPS = {"train", "val", "perf", "memory", "comm", "moe"}


def _events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return events


def _config_text(events) -> str:
    return events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()


def test_every_metric_of_the_trainer_has_a_grouped_tag() -> None:
    assert set(TRAINER_KEYS) - {"step", "moe"} == set(TB_TAGS)
    for key in TB_TAGS:
        group, _, name = tensorboard_tag(key).partition("/")
        assert group in GROUPS and name, key
    assert tensorboard_tag("comm_bytes_by_axis/dp") == "comm/bytes_by_axis/dp"
    assert tensorboard_tag("moe/layers/0/max") == "moe/layers/0/max"  # its own section
    assert tensorboard_tag("something_new") == "misc/something_new"


def test_scalars_are_grouped_and_the_config_is_logged_once(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.plugins.hparams import plugin_data_pb2

    cfg = load_config(None, ["model.hidden_size=48"])
    record = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": 0.7, "tokens": 64,
              "step_time_s": 0.1, "tokens_per_s": 640.0, "mfu": 0.1, "comm_bytes": 10,
              "comm_time_s": 0.01, "peak_mem_bytes": 123, "exposed_comm_s": 0.0,
              "skipped": False, "val_loss": 2.6, "comm_bytes_by_axis": {"dp": 10.0},
              "moe": {"imbalance": 1.2, "layers": [{"tokens_per_expert": [1, 2]}]}}
    logger = RunLogger(tmp_path, enabled=True, tensorboard=True, config=cfg)
    logger.log(record)
    logger.log({**record, "step": 4, "loss": 2.25})
    logger.close()
    events = _events(tmp_path)
    tags = set(events.Tags()["scalars"])
    assert tags == {tensorboard_tag(k) for k in flatten_scalars(record)}
    assert {"train/loss", "train/grad_norm", "val/loss", "perf/step_time_s", "perf/tokens_per_s",
            "perf/mfu", "memory/peak_mem_bytes", "comm/bytes", "comm/bytes_by_axis/dp",
            "moe/imbalance", "moe/layers/0/tokens_per_expert/1"} <= tags
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [(3, 2.5), (4, 2.25)]
    # The resolved config, as config.yaml holds it, in a Markdown code block; once.
    assert events.Tags()["tensors"] == ["config/text_summary"]
    assert len(events.Tensors("config/text_summary")) == 1
    assert _config_text(events) == f"```yaml\n{to_yaml(cfg)}```"
    # ... and as the HParams plugin's hyperparameters.
    start = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"])
    hparams = start.session_start_info.hparams
    assert hparams["model.hidden_size"].number_value == 48
    assert hparams["model.kind"].string_value == "gpt"
    # metrics.jsonl keeps the records' own keys.
    assert (tmp_path / "metrics.jsonl").read_text().splitlines()[0].startswith('{"step": 3, "loss"')


def test_one_process_run_with_checkpoints_is_quiet_and_logs_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    run_dir = tmp_path / "run"
    settings = [*TINY, "optimization.checkpoint.interval=2", "training.tensorboard=true"]
    first = run_mcpar("train", "--nproc", "1", "--steps", "4", "--run-dir", str(run_dir),
                      *sets(*settings))
    assert first.returncode == 0, first.stderr
    # The save of a synchronous checkpoint, then the loads of a resume.
    again = run_mcpar("train", "--nproc", "1", "--steps", "6", "--resume", "--run-dir",
                      str(run_dir), *sets(*settings, "optimization.checkpoint.async_save=false"))
    assert again.returncode == 0, again.stderr
    assert (run_dir / "checkpoints" / "step-6").is_dir()
    for proc in (first, again):
        assert "single process" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    events = _events(run_dir)
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "val/loss", "perf/mfu", "memory/peak_mem_bytes", "comm/bytes"} <= tags
    assert not any(t.startswith("misc/") or "/" not in t for t in tags), tags
    assert "kind: gpt" in _config_text(events)
