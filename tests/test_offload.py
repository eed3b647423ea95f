"""Optimizer-state offload (``controllers/memory/offload.py``): the same losses as without it
(alone and under ZeRO-3), bitwise resume, checkpoints either side of it resume on the other,
a stream that really is double-buffered, and the settings it refuses."""

from __future__ import annotations

import shutil
import threading
from pathlib import Path

import pytest
import torch
from conftest import (
    TINY,
    launch_in_process,
    read_metrics,
    recovery_events,
    run_cli_in_process,
    sets,
)

from mcpar.controllers.memory.offload import OffloadedState, OffloadEngine, adamw_update

BASE = [*TINY, "training.steps=20", "optimization.micro_batch_size=2",
        "optimization.global_batch_size=8", "optimization.checkpoint.interval=10",
        "parallelism.data=2"]
# About 1300 elements of state per group: the test model's 40k parameters make ~30 groups.
NVME = ["controllers.memory.offload=nvme", "controllers.memory.offload_buffer_mb=0.01"]
Z3 = ["controllers.memory.zero_stage=3"]


def _train(run_dir: Path, *settings: str, resume: bool = False) -> list[dict]:
    args = ["train", *sets(*BASE, *settings), "--nproc", "2", "--run-dir", str(run_dir)]
    assert launch_in_process(*args, *(["--resume"] if resume else [])) == 0
    return read_metrics(run_dir)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("offload")
    for name, settings in [("none", []), ("nvme", NVME), ("z3", Z3), ("z3_nvme", [*Z3, *NVME])]:
        _train(root / name, *settings)
    return {"root": root, **{n: root / n for n in ("none", "nvme", "z3", "z3_nvme")}}


def _losses(run_dir: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir)]


@pytest.mark.parametrize("offloaded,reference", [("nvme", "none"), ("z3_nvme", "z3")])
def test_offload_matches_the_run_without_it(runs: dict[str, Path], offloaded: str,
                                            reference: str) -> None:
    """fp32, 20 steps at data 2: |dloss| <= 1e-6 at every step, alone and under ZeRO-3; the
    offloaded run's log says where the state was."""
    ref, got = _losses(runs[reference]), _losses(runs[offloaded])
    assert len(got) == len(ref) == 20
    assert max(abs(a - b) for a, b in zip(ref, got, strict=True)) <= 1e-6
    assert got[-1] < got[0] - 0.5  # it trained


def test_nvme_resume_is_bitwise(runs: dict[str, Path], tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(runs["nvme"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-20")
    records = _train(run_dir, *NVME, resume=True)
    (load,) = [e for e in recovery_events(run_dir) if e["event"] == "load"]
    assert load["step"] == 10
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(runs["nvme"])]


@pytest.mark.parametrize("saved,resumed_with", [("nvme", []), ("none", NVME)],
                         ids=["offloaded_to_none", "none_to_offloaded"])
def test_checkpoints_cross_the_offload(runs: dict[str, Path], tmp_path: Path, saved: str,
                                       resumed_with: list[str]) -> None:
    """A checkpoint holds the same logical state with or without offload: resumed on the
    other side, every later step has the straight run's loss."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs[saved], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-20")
    records = _train(run_dir, *resumed_with, resume=True)
    straight = _losses(runs["none"])
    assert [r["step"] for r in records][10:] == list(range(11, 21))
    assert max(abs(r["loss"] - straight[r["step"] - 1]) for r in records[10:]) <= 1e-6


def test_bf16_copies_checkpoint_the_fp32_master_and_resume_bitwise(tmp_path: Path) -> None:
    """bf16: the model trains on bf16 copies, the offloaded state holds the fp32 masters;
    a checkpoint saves the masters (float32 model tensors) and resumes bit for bit. Run at
    pipeline 2: the stages exchange the bf16 residual stream (training and validation)."""
    from torch.distributed.checkpoint import FileSystemReader

    bf16 = [*NVME, "training.dtype=bfloat16", "training.steps=4",
            "optimization.checkpoint.interval=2", "parallelism.data=1", "parallelism.pipeline=2"]
    straight = _train(tmp_path / "straight", *bf16)
    saved = FileSystemReader(str(tmp_path / "straight" / "checkpoints" / "step-2"))
    model = {k: v for k, v in saved.read_metadata().state_dict_metadata.items()
             if k.startswith("model/") and not k.endswith("/index")}
    assert model and all(v.properties.dtype == torch.float32 for v in model.values()), model
    run_dir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "straight", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-4")
    records = _train(run_dir, *bf16, resume=True)
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in straight]


def _model_params() -> list[torch.nn.Parameter]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Linear(64, 16))
    return list(model.parameters())


def test_the_stream_is_double_buffered_and_equals_adamw(tmp_path: Path) -> None:
    """More than two groups; two buffers of at most the budget are all the host holds; the
    I/O thread reads group i + 1 (and writes group i - 1) while group i is updated; and the
    update is torch's AdamW's to the bit."""
    params, reference = _model_params(), _model_params()
    budget = 2000  # bytes: 250 elements of the two moments per group
    engine = OffloadEngine(params, "nvme", budget, 2, torch.device("cpu"), tmp_path / "r0")
    total = sum(p.numel() for p in params)
    assert len(engine.groups) == -(-total // 250) > 2
    assert len(engine.buffers) == 2 and engine.buffer_bytes() <= 2 * budget
    assert not list(tmp_path.iterdir())  # the state file is unlinked once open
    events: list[tuple[str, int]] = []
    lock = threading.Lock()
    index = {id(g): i for i, g in enumerate(engine.groups)}
    for name in ("_read", "_write", "_update"):
        original = getattr(engine, name)

        def logged(group, *rest, _name=name, _original=original):  # type: ignore[no-untyped-def]
            with lock:
                events.append((_name + " start", index[id(group)]))
            out = _original(group, *rest)
            with lock:
                events.append((_name + " end", index[id(group)]))
            return out
        logged.__name__ = name
        setattr(engine, name, logged)
    submit = engine.pool.submit

    def queued(fn, group, *rest):  # type: ignore[no-untyped-def]
        with lock:
            events.append((fn.__name__ + " queued", index[id(group)]))
        return submit(fn, group, *rest)
    engine.pool.submit = queued  # type: ignore[method-assign]
    torch_adamw = torch.optim.AdamW(reference, lr=1e-2, weight_decay=0.1)
    for step in range(3):
        events.clear()
        for p, q in zip(params, reference, strict=True):
            q.grad = torch.randn_like(q)
            p.grad = q.grad.clone()
        torch_adamw.step()
        engine.step(lambda p: (1e-2, 0.1, 0.9, 0.999, 1e-8))
        for p, q in zip(params, reference, strict=True):
            assert torch.equal(p, q), step
        reads = [i for kind, i in events if kind == "_read start"]
        assert reads == list(range(len(engine.groups)))  # every group streamed, in order
        for i in range(1, len(engine.groups) - 1):
            # Group i + 1's read was handed to the I/O thread before group i's update began,
            # after group i - 1's write (into the same buffer), which was done before it.
            assert events.index(("_write queued", i - 1)) < events.index(("_read queued", i + 1))
            assert events.index(("_read queued", i + 1)) < events.index(("_update start", i))
            assert events.index(("_write end", i - 1)) < events.index(("_read start", i + 1))
    assert engine.times.bytes_read == 3 * total * 8
    state = OffloadedState(engine)
    for p, q in zip(params, reference, strict=True):
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[p][key], torch_adamw.state[q][key])
        assert float(state[p]["step"]) == float(torch_adamw.state[q]["step"]) == 3.0
    engine.close()


def test_adamw_update_is_torchs_elementwise() -> None:
    """A piece of a tensor updated alone equals that piece of the whole tensor's update."""
    torch.manual_seed(1)
    w, g = torch.randn(1000), torch.randn(1000)
    m, v = torch.zeros(1000), torch.zeros(1000)
    whole = [t.clone() for t in (w, g, m, v)]
    adamw_update(*whole, 1.0, 1e-3, 0.1, 0.9, 0.95, 1e-8)
    parts = [t.clone() for t in (w, g, m, v)]
    for lo, hi in ((0, 333), (333, 1000)):
        adamw_update(*(t[lo:hi] for t in parts), 1.0, 1e-3, 0.1, 0.9, 0.95, 1e-8)
    assert all(torch.equal(a, b) for a, b in zip(whole, parts, strict=True))


@pytest.mark.parametrize("settings,key", [
    (["controllers.memory.offload=cpu", "training.device=cpu"], "controllers.memory.offload"),
    ([*NVME, "optimization.optimizer=onebit_adam", "optimization.freeze_step=4"],
     "controllers.memory.offload"),
    (["controllers.memory.offload_dir=/tmp"], "controllers.memory.offload_dir"),
    ([*NVME, "controllers.compute.scheduler=greedy", "model.kind=moe", "model.num_experts=2",
      "parallelism.experts=2"], "controllers.memory.offload"),
], ids=["cpu_on_cpu", "onebit", "dir_without_nvme", "expert_migration"])
def test_what_offload_cannot_do_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                           settings: list[str], key: str) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*BASE, *settings), "--nproc", "2",
                              "--run-dir", str(tmp_path / "never"))
    assert proc.returncode == 2 and f"mcpar: error: {key}: " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "never").exists()


@pytest.mark.parametrize("where", ["a_file", "under_a_file"])
def test_an_unusable_offload_dir_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                            where: str) -> None:
    (tmp_path / "f").write_text("not a directory")
    target = tmp_path / "f" if where == "a_file" else tmp_path / "f" / "sub"
    proc = run_cli_in_process(capsys, "train", *sets(*BASE, *NVME,
                                                     f"controllers.memory.offload_dir={target}"),
                              "--nproc", "2", "--run-dir", str(tmp_path / "never"))
    assert proc.returncode == 2, proc.stderr
    assert "mcpar: error: controllers.memory.offload_dir: " in proc.stderr
    assert "Traceback" not in proc.stderr
