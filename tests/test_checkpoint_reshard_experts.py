"""Resume on another expert degree: a MoE checkpoint resharded across experts 1, 2 and 4.

One source run (data 2 x experts 2, the greedy balancer moving experts every 2 steps) trains 6
steps and saves at step 4, after the balancer has moved experts. Its step-4 checkpoint is loaded
(``optimization.checkpoint.load_from``) by one process (experts 2 -> 1) and by data 4 x
experts 4 (2 -> 4); the one process's copy then goes to experts 2 (1 -> 2), and experts 4's copy
to experts 2 (4 -> 2); data 4 x experts 2 loads it too (the same expert degree: the experts
stay in their slots and the balancer's state follows). Each of them saves the state it loaded
at once, as its first checkpoint.

- Every first checkpoint holds the source's step-4 state bit for bit: ``mcpar checkpoint
  verify`` gives the same hash (parameters, AdamW moments and step, the routers' expert_bias
  buffers, step and data position), whatever slots the experts were in.
- Training goes on from it: the two experts-2 runs, started from the same state through other
  reshards (1 -> 2 and 4 -> 2), train steps 5 and 6 with the same losses, and every resharded
  run's losses are the source's own steps 5 and 6 to 1e-6 (other layouts: float rounding).
- A layout change no reshard can follow is refused before launch, naming the layout key.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import recovery_events, run_cli_in_process, sets, train_metrics

from mcpar.checkpoint.files import _sha256, load_tensors

pytestmark = pytest.mark.slow

MOE = [
    "model.kind=moe", "model.num_experts=4", "model.top_k=2", "model.shared_expert=true",
    "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5", "optimization.global_batch_size=8",
    "optimization.checkpoint.interval=4", "training.steps=6",
]
GREEDY = ["controllers.compute.scheduler=greedy", "controllers.compute.balance_interval=2"]
# Expert degree -> (workers, settings): data x experts layouts with the same global batch.
LAYOUTS: dict[int, tuple[int, list[str]]] = {
    1: (1, ["optimization.micro_batch_size=8"]),
    2: (2, ["parallelism.experts=2", "optimization.micro_batch_size=4", *GREEDY]),
    4: (4, ["parallelism.experts=4", "optimization.micro_batch_size=2", *GREEDY]),
}
# The same expert degree on another data degree (data 4 x experts 2: two replicas of each).
SAME_EXPERTS = (4, ["parallelism.experts=2", "optimization.micro_batch_size=2", *GREEDY])
SOURCE = "experts2_migrated"
# Run name -> (the run whose step-4 checkpoint it loads, its expert degree), in run order.
RESHARDS: dict[str, tuple[str, int]] = {
    "2_to_1": (SOURCE, 1),
    "2_to_4": (SOURCE, 4),
    "1_to_2": ("2_to_1", 2),
    "4_to_2": ("2_to_4", 2),
    "2_to_2_on_data4": (SOURCE, 2),
}
EXPERTS = {SOURCE: 2, **{name: experts for name, (_, experts) in RESHARDS.items()}}
Runs = dict[str, tuple[Path, list[dict]]]


def _step4(run_dir: Path) -> Path:
    return run_dir / "checkpoints" / "step-4"


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    root = tmp_path_factory.mktemp("reshard_experts")
    nproc, settings = LAYOUTS[2]
    out = {SOURCE: (root / SOURCE, train_metrics(root / SOURCE, nproc, [*MOE, *settings]))}
    for name, (source, experts) in RESHARDS.items():
        nproc, settings = SAME_EXPERTS if name == "2_to_2_on_data4" else LAYOUTS[experts]
        load = f"optimization.checkpoint.load_from={_step4(out[source][0])}"
        out[name] = (root / name, train_metrics(root / name, nproc, [*MOE, *settings, load]))
    return out


def _placements(step_dir: Path) -> list[list[int]]:
    saved = load_tensors(step_dir, "model/")
    return [v.tolist() for k, v in sorted(saved.items()) if k.endswith("expert_of_slot")]


def _verify(capsys: pytest.CaptureFixture[str], run_dir: Path) -> tuple[str, str]:
    """``mcpar checkpoint verify RUN --step 4``: the hash, and the whole output."""
    proc = run_cli_in_process(capsys, "checkpoint", "verify", str(run_dir), "--step", "4")
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()[0], proc.stdout


@pytest.fixture(scope="module")
def source_hash(runs: Runs) -> str:
    from mcpar.interop.canonical_state import canonical_state

    state = canonical_state(runs[SOURCE][0], 4)
    # The hash covers the routers' selection bias, which the balancing has moved off zero.
    biases = [t for n, t in state.tensors.items() if n.endswith("router.expert_bias")]
    assert biases and all(bool(t.abs().sum() > 0) for t in biases), sorted(state.tensors)
    return state.digest()


def test_the_source_saved_experts_the_balancer_had_moved(runs: Runs) -> None:
    slots = _placements(_step4(runs[SOURCE][0]))
    assert any(s != sorted(s) for s in slots), f"the balancer moved no expert: {slots}"


@pytest.mark.parametrize("name", list(RESHARDS))
def test_a_reshard_across_expert_degrees_keeps_the_hash(
        runs: Runs, source_hash: str, capsys: pytest.CaptureFixture[str], name: str) -> None:
    source, experts = RESHARDS[name]
    run_dir = runs[name][0]
    load = next(e for e in recovery_events(run_dir) if e.get("event") == "load")
    assert load["resharded_from"]["experts"] == EXPERTS[source], load
    assert load["resharded_to"]["experts"] == experts, load
    if EXPERTS[source] == experts:
        # The same expert degree: the experts stay where the balancer had moved them, and the
        # balancer's state follows them, the same on every new rank as the source saved it.
        assert "load_balancer" in load["carried"] and "load_balancer" not in load["restarted"]
        def placements(step_dir: Path) -> set[tuple[int, ...]]:  # replicas' copies once
            return {tuple(p) for p in _placements(step_dir)}
        assert placements(_step4(run_dir)) == placements(_step4(runs[source][0]))
        saved = load_tensors(_step4(runs[source][0]), "rank0/")
        balancer = {k[len("rank0/"):]: v for k, v in saved.items() if "balancer/" in k}
        assert balancer
        for rank in range(4):
            got = load_tensors(_step4(run_dir), f"rank{rank}/")
            for key, value in balancer.items():
                assert torch.equal(got[f"rank{rank}/{key}"], value), (rank, key)
    else:
        # The source's balancer state is per slot of its expert layout: it restarts, and
        # says so; the new run places its experts by its own initial placement (expert e in
        # slot e).
        moved_by_balancer = EXPERTS[source] > 1
        assert ("load_balancer" in load["restarted"]) == moved_by_balancer, load
        assert all(s == sorted(s) for s in _placements(_step4(run_dir)))
    digest, output = _verify(capsys, run_dir)
    assert digest == source_hash, output


def test_training_goes_on_from_the_resharded_state(runs: Runs) -> None:
    losses = {name: [(r["step"], r["loss"]) for r in records if r["step"] > 4]
              for name, (_, records) in runs.items()}
    assert all([s for s, _ in steps] == [5, 6] for steps in losses.values()), losses
    # Experts 2 started from the same state by two other reshards: the same steps.
    for (_, a), (_, b) in zip(losses["1_to_2"], losses["4_to_2"], strict=True):
        assert abs(a - b) <= 1e-6, losses
    # ... and every reshard goes on as the source itself did (another layout: rounding).
    for name in RESHARDS:
        for (_, a), (_, b) in zip(losses[SOURCE], losses[name], strict=True):
            assert abs(a - b) <= 1e-6, (name, losses)


def test_a_layout_no_reshard_can_follow_is_refused_before_launch(
        runs: Runs, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpoint whose layout records an axis this version does not reshard (as a later
    version's checkpoint would): exit 2 naming the key, before anything is written."""
    copy = tmp_path / "step-4"
    shutil.copytree(_step4(runs[SOURCE][0]), copy)
    meta = json.loads((copy / "meta.json").read_text())
    meta["layout"]["expert_tensor"] = 2
    (copy / "meta.json").write_text(json.dumps(meta))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["files"]["meta.json"] = {"sha256": _sha256(copy / "meta.json"),
                                      "bytes": (copy / "meta.json").stat().st_size}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    nproc, settings = LAYOUTS[1]
    proc = run_cli_in_process(capsys, "train", *sets(*MOE, *settings,
                                                     f"optimization.checkpoint.load_from={copy}"),
                              "--nproc", str(nproc), "--run-dir", str(tmp_path / "b"))
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "optimization.checkpoint.load_from" in proc.stderr
    assert "layout.expert_tensor: " in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "b" / "config.yaml").exists()
