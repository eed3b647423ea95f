"""`mcpar checkpoint verify`: one hash for a checkpoint's state, whatever the layout saved it.

Data 2 with ZeRO 0, 1 and 3 and both save strategies train bit for bit alike (two ranks' sums
do not depend on the order), yet their checkpoints hold the state in different pieces: whole
replicas, ZeRO pieces of the optimizer state, gathered ZeRO-3 parameters. Their hashes must be
equal. A single process with the same global batch differs in the last bits, and ``--against``
must say where and by how much. Experts moved between slots by the balancer come back in expert
order, optimizer moments included.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from conftest import TINY, recovery_events, run_cli_in_process, run_mcpar, sets, train_metrics

from mcpar.checkpoint.files import load_tensors

pytestmark = pytest.mark.slow

STEPS = ["optimization.checkpoint.interval=3", "training.steps=3"]
DENSE: dict[str, tuple[int, list[str]]] = {
    "zero0_full": (2, []),
    "zero1_selective": (2, ["controllers.memory.zero_stage=1",
                            "optimization.checkpoint.strategy=selective"]),
    "zero3": (2, ["controllers.memory.zero_stage=3"]),
    # The same global batch (16 x 2) in one process: the same model to ~1e-7, not to the bit.
    "single": (1, ["optimization.gradient_accumulation=2"]),
}
MOE = [
    "model.kind=moe", "model.num_experts=4", "model.top_k=2", "model.shared_expert=true",
    "model.num_layers=2", "model.hidden_size=32", "model.num_heads=4", "model.seq_len=32",
    "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
    "optimization.warmup_steps=5", "optimization.global_batch_size=8",
    "optimization.checkpoint.interval=4", "training.steps=4",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify")
    out = {}
    for name, (nproc, settings) in DENSE.items():
        train_metrics(root / name, nproc, [*TINY, *STEPS, *settings])
        out[name] = root / name
    return out


Verify = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def verify(capsys: pytest.CaptureFixture[str]) -> Verify:
    """``mcpar checkpoint verify ARGS`` in this process (no Python and torch start-up per call)."""
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return run_cli_in_process(capsys, "checkpoint", "verify", *args)
    return run


def _digest(proc: subprocess.CompletedProcess[str]) -> str:
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.split()[0]


def _groups(proc: subprocess.CompletedProcess[str]) -> dict[str, str]:
    lines = [line.split() for line in proc.stdout.splitlines()[2:4]]
    return {words[0]: words[1] for words in lines}


def test_hash_does_not_depend_on_zero_stage_or_strategy(runs: dict[str, Path], verify: Verify
                                                        ) -> None:
    procs = {name: verify(str(runs[name])) for name in ("zero0_full", "zero1_selective",
                                                           "zero3")}
    digests = {name: _digest(p) for name, p in procs.items()}
    assert len(set(digests.values())) == 1, digests
    assert "saved as data 2 x ZeRO 1;" in procs["zero1_selective"].stdout
    # The hash covers the optimizer state: the single process's moments differ in the last
    # bits, and so does its optimizer group's hash, not only its parameters'.
    single = _groups(verify(str(runs["single"])))
    dense = _groups(procs["zero0_full"])
    assert set(single) == {"optim", "param"}
    assert single["optim"] != dense["optim"] and single["param"] != dense["param"]


def test_against_names_the_differences(runs: dict[str, Path], verify: Verify) -> None:
    same = verify(str(runs["zero3"]), "--against", str(runs["zero0_full"]))
    assert same.returncode == 0 and "mcpar checkpoint verify: identical" in same.stdout
    differ = verify(str(runs["single"]), "--against", str(runs["zero1_selective"]))
    assert differ.returncode == 1, differ.stderr[-2000:]
    listed = [line.strip() for line in differ.stdout.splitlines() if "max |difference|" in line]
    assert listed and all(line.startswith(("param/", "optim/")) for line in listed)
    largest = float(listed[0].rsplit(" ", 1)[1])
    assert 0 < largest < 1e-5  # the same training to float rounding, not another model
    within = verify(str(runs["single"]), "--against", str(runs["zero1_selective"]),
                     "--atol", "1e-5")
    assert within.returncode == 0 and "equal within 1e-05" in within.stdout


def test_a_missing_zero_piece_is_refused_not_hashed(runs: dict[str, Path]) -> None:
    from mcpar.checkpoint.saved_state import join_optimizer_pieces, layout_maps, model_shards
    from mcpar.errors import UserError
    from mcpar.interop.full_state import run_config

    path = runs["zero1_selective"] / "checkpoints" / "step-3"
    optim = load_tensors(path, "optim/")
    shards = model_shards(load_tensors(path, "model/"))
    model_cfg = run_config(runs["zero1_selective"]).model
    layout = {"pipeline": 1, "tensor": 1, "experts": 1, "virtual_stages": 1}
    maps = {c: layout_maps(model_cfg, layout, c) for c in shards}
    joined = join_optimizer_pieces(optim, shards, maps, str(path))
    assert all(set(s) == {"exp_avg", "exp_avg_sq", "step"} for s in joined[(0, 0, 0)].values())
    # A parameter cut between the two replicas: without one replica's piece, a gap.
    owners: dict[str, set[str]] = {}
    for key in optim:
        if key.endswith("/exp_avg"):
            replica, local = key.split("/")[1], key.split("/")[2].rsplit("@", 1)[0]
            owners.setdefault(local, set()).add(replica)
    split = next(local for local, replicas in owners.items() if len(replicas) == 2)
    cut = dict(optim)
    del cut[next(k for k in optim if "-dp1/" in k and f"/{split}@" in k
                 and k.endswith("/exp_avg"))]
    with pytest.raises(UserError, match=f"ZeRO pieces of {split}'s exp_avg leave [1-9]"):
        join_optimizer_pieces(cut, shards, maps, str(path))
    # A parameter one replica owns whole: without its piece, no moment at all.
    whole = next(local for local, replicas in owners.items() if len(replicas) == 1)
    cut = {k: v for k, v in optim.items() if not (f"/{whole}@" in k and k.endswith("/exp_avg"))}
    with pytest.raises(UserError, match=f"optimizer state of {whole} .* has only"):
        join_optimizer_pieces(cut, shards, maps, str(path))

def test_experts_moved_by_the_balancer_come_back_in_order(tmp_path: Path, verify: Verify
                                                         ) -> None:
    train_metrics(tmp_path / "ep2", 2, [*MOE, "parallelism.experts=2",
                                        "optimization.micro_batch_size=4",
                                        "controllers.compute.scheduler=greedy",
                                        "controllers.compute.balance_interval=2"])
    train_metrics(tmp_path / "one", 1, [*MOE, "optimization.micro_batch_size=8"])
    saved = load_tensors(tmp_path / "ep2" / "checkpoints" / "step-4", "model/")
    slots = [v.tolist() for k, v in saved.items() if k.endswith("expert_of_slot")]
    assert any(s != sorted(s) for s in slots), f"the balancer moved no expert: {slots}"
    proc = verify(str(tmp_path / "ep2"), "--against", str(tmp_path / "one"), "--atol", "1e-6")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]


@pytest.mark.parametrize("args, needle", [
    (["/nonexistent/run"], "not an mcpar run directory"),
    (["RUN", "--step", "7"], "--step: "),
    (["RUN", "--atol", "nan"], "--atol: nan"),
    (["RUN", "--against-step", "3"], "--against-step: needs --against"),
])
def test_bad_input_is_one_line_exit_2(runs: dict[str, Path], capsys: pytest.CaptureFixture[str],
                                      args: list[str], needle: str) -> None:
    args = [str(runs["zero0_full"]) if a == "RUN" else a for a in args]
    proc = run_cli_in_process(capsys, "checkpoint", "verify", *args)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1



# --- a reshard keeps the hash: optimization.checkpoint.load_from --------------------------------
# (source run, settings of the run that loads it): data 2 with ZeRO pieces onto one process,
# tensor 2 and pipeline 2 (each with the same global batch), one process onto ZeRO-3, and
# ZeRO-1 onto ZeRO-3 at the same data degree.
RESHARDS: dict[str, tuple[str, int, list[str]]] = {
    "zero1_to_single": ("zero1_selective", 1, ["optimization.gradient_accumulation=2"]),
    "zero1_to_tensor2": ("zero1_selective", 2, ["parallelism.tensor=2",
                                                "optimization.gradient_accumulation=2"]),
    "zero1_to_pipeline2": ("zero1_selective", 2, ["parallelism.pipeline=2",
                                                  "optimization.gradient_accumulation=2"]),
    "single_to_zero3": ("single", 2, ["controllers.memory.zero_stage=3"]),
    # Same keys on both sides (data 2, one bucket), pieces cut otherwise: it must reshard.
    "zero1_to_zero3": ("zero1_selective", 2, ["controllers.memory.zero_stage=3"]),
}


@pytest.mark.parametrize("pair", list(RESHARDS))
def test_a_reshard_keeps_the_hash(runs: dict[str, Path], verify: Verify, tmp_path: Path,
                                  pair: str) -> None:
    source, nproc, settings = RESHARDS[pair]
    train_metrics(tmp_path / "b", nproc, [*TINY, *STEPS, *settings,
                                          f"optimization.checkpoint.load_from={runs[source]}"])
    events = [e for e in recovery_events(tmp_path / "b") if e.get("event") == "load"]
    assert events and "resharded_from" in events[0], events  # it did reshard
    proc = verify(str(runs[source]), "--against", str(tmp_path / "b"))
    assert proc.returncode == 0 and "verify: identical" in proc.stdout, proc.stdout[-3000:]


def test_training_goes_on_from_a_reshard_as_from_its_own_checkpoint(
        runs: dict[str, Path], tmp_path: Path) -> None:
    """Tensor 2 started from data 2's ZeRO pieces trains the next steps exactly as tensor 2
    started from its own copy of that state: the reshard restores all a resume needs (moments,
    step, data position), not only the weights."""
    tensor2 = ["parallelism.tensor=2", "optimization.gradient_accumulation=2",
               "optimization.checkpoint.interval=3", "training.steps=6"]
    resharded = train_metrics(tmp_path / "resharded", 2, [
        *TINY, *tensor2, f"optimization.checkpoint.load_from={runs['zero1_selective']}"])
    own = train_metrics(tmp_path / "own", 2, [
        *TINY, *tensor2,
        f"optimization.checkpoint.load_from={tmp_path / 'resharded' / 'checkpoints' / 'step-3'}"])
    assert [r["step"] for r in resharded] == [4, 5, 6] == [r["step"] for r in own]
    assert [r["loss"] for r in resharded] == [r["loss"] for r in own]
    # ... and close to data 2 going on by itself (other layouts: float rounding apart).
    go_on = train_metrics(tmp_path / "dp2", 2, [
        *TINY, "controllers.memory.zero_stage=1", "optimization.checkpoint.interval=3",
        "training.steps=6", f"optimization.checkpoint.load_from={runs['zero1_selective']}"])
    for a, b in zip(go_on, resharded, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a, b)


@pytest.mark.parametrize("value, needle", [
    ("/nonexistent/run", "is neither a run directory"),
    ("RUN/checkpoints/step-9", "is not a valid checkpoint: it does not exist"),
    ("x" * 300, "cannot be read (File name too long)"),  # a name the file system refuses
])
def test_load_from_refuses_what_it_cannot_load(runs: dict[str, Path], tmp_path: Path,
                                               value: str, needle: str) -> None:
    value = value.replace("RUN", str(runs["zero0_full"]))
    proc = run_mcpar("train", *sets(*TINY, *STEPS, f"optimization.checkpoint.load_from={value}"),
                     "--run-dir", str(tmp_path / "b"))
    assert proc.returncode == 2 and "optimization.checkpoint.load_from: " in proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "b" / "config.yaml").exists()  # refused before anything was written
