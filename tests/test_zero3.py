"""ZeRO stage 3 and the hierarchical parameter store (``controllers/memory/param_store.py``):
per-layer gathers in the ComputeController's order with prefetch, the single-process run's
losses on every layout it composes with, the bytes it saves, bitwise resume and resharding."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import TINY, read_metrics, recovery_events, run_cli_in_process, run_mcpar, sets

from mcpar.config import JobConfig, load_config
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.exchanges import ReduceScatterExchange
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.controllers.memory.estimate import estimate_memory
from mcpar.controllers.memory.param_store import ParameterStore, unit_groups
from mcpar.models.spec import get_model_spec
from mcpar.parallel.stage import cut_model
from mcpar.plan import resolve_plan
from mcpar.topology import ParallelDims

BASE = [*TINY, "model.num_layers=4", "training.steps=8", "optimization.micro_batch_size=4",
        "optimization.global_batch_size=16", "optimization.checkpoint.interval=4"]
# One block per gather: the tiny model's blocks would otherwise be one group of 4, which stays
# gathered from its forward into its backward (no backward gathers for the store to move).
Z3 = ["parallelism.data=4", "controllers.memory.zero_stage=3", "controllers.memory.gather_mb=0"]
STORE = [*Z3, "controllers.memory.allocation=topology_aware", "cluster.ranks_per_node=2"]
STAGE_STATE = ("parameters", "gradients", "optimizer state")


def _train(run_dir: Path, nproc: int, *settings: str, resume: bool = False) -> list[dict]:
    proc = run_mcpar("train", *sets(*BASE, *settings), "--nproc", str(nproc), "--run-dir",
                     str(run_dir), *(["--resume"] if resume else []), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_metrics(run_dir)


def _assert_parity(reference: list[dict], records: list[dict], label: str,
                   tolerance: float = 1e-5) -> None:
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for ref, rec in zip(reference, records, strict=True):
        assert abs(ref["loss"] - rec["loss"]) <= tolerance, (label, rec["step"], ref["loss"],
                                                            rec["loss"])


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The single-process reference, stage 3 at data 4 (with checkpoints) and the store at
    2 ranks per node, shared by the tests below."""
    root = tmp_path_factory.mktemp("zero3")
    _train(root / "single", 1)
    _train(root / "zero3", 4, *Z3)
    _train(root / "store", 4, *STORE)
    return {"root": root, "single": root / "single", "zero3": root / "zero3",
            "store": root / "store"}


def _summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


def _one_process_step(fuse: bool = False, span: int = 1
                      ) -> tuple[ParameterStore, DataParallelGradSync, list[str], float, float]:
    """One forward and backward of a 4-block GPT under the store's hooks (one process), ``span``
    blocks per gather: the store, its gradient sync (shards = full gradients), the unit names,
    the loss and the unsharded model's loss. The reference's gradients are checked here."""
    cfg = JobConfig.model_validate({"model": {"num_layers": 4, "hidden_size": 32,
                                              "num_heads": 2, "seq_len": 16}})
    spec = get_model_spec("gpt")
    reference = cut_model(spec.build(cfg.model, 0), [(0, 4)], 0, spec.pieces)
    chunk = cut_model(spec.build(cfg.model, 0), [(0, 4)], 0, spec.pieces)
    comm = CommunicationController(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    names, groups, unit_of_group = unit_groups([chunk])
    sync = DataParallelGradSync([p for g in groups for p in g],
                                shards=(("dp", 1, 0), ("edp", 1, 0)),
                                release_grads=True, groups=groups)
    store = ParameterStore(comm, [chunk], sync.buckets, names, unit_of_group, span=span)
    store.fuse = fuse
    exchange = ReduceScatterExchange(comm)
    exchange.reducer = store.aggregate_gradients
    sync.set_exchange(exchange)
    store.trace = []
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16),
                           generator=torch.Generator().manual_seed(1))

    def loss_of(model: torch.nn.Module) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    expected = loss_of(reference)
    expected.backward()
    sync.zero_grad()
    sync.arm(list(chunk.parameters()))
    loss = loss_of(chunk)
    loss.backward()
    sync.finish()
    by_name = dict(reference.named_parameters())
    for bucket in sync.buckets:
        assert bucket.shard is not None
        for p, offset in zip(bucket.params, bucket.offsets, strict=True):
            name = next(n for n, q in chunk.named_parameters() if q is p)
            want = by_name[name].grad.reshape(-1)
            assert torch.allclose(bucket.shard[offset:offset + p.numel()], want, atol=1e-6), name
    store.after_step()
    return store, sync, names, loss.item(), expected.item()


def _most_gathered(trace: list[tuple[str, str]], root: str) -> int:
    """The most blocks gathered (or on their way) at once along a pass's trace."""
    gathered: set[str] = set()
    most = 0
    for event, unit in trace:
        if event.startswith("fetch"):
            gathered.add(unit)
        elif event == "free":
            gathered.discard(unit)
        most = max(most, len(gathered - {root}))
    assert not gathered
    return most


def test_gathers_follow_the_layer_order_with_prefetch_and_free_after_use() -> None:
    """One process, the store's hooks on a 4-block GPT: the same loss and gradients as the
    unsharded model; each block's gather starts before the previous block's compute (forward:
    the next block, backward: the one before), at most two blocks are gathered at once, and
    nothing stays gathered after the backward pass."""
    store, sync, names, loss, expected = _one_process_step()
    assert loss == pytest.approx(expected, abs=1e-6)
    trace = store.trace
    blocks = [n for n in names if "block" in n]

    def at(event: str, unit: str, nth: int = 0) -> int:
        return [i for i, e in enumerate(trace) if e == (event, unit)][nth]

    for i in range(len(blocks) - 1):  # forward prefetch: block i+1 starts before block i runs
        assert at("fetch", blocks[i + 1]) < at("use", blocks[i])
    for i in range(1, len(blocks)):  # backward prefetch: block i-1 starts before block i runs
        assert at("fetch", blocks[i - 1], 1) < at("use", blocks[i], 1)
    assert _most_gathered(trace, names[-1]) <= 2
    assert all(store.flat[b.index].untyped_storage().nbytes() == 0 for b in sync.buckets)


def test_reductions_ride_with_the_next_gather_when_fused() -> None:
    """Where the CommunicationController fuses exchanges (gloo), each block's gradient
    reduce-scatter waits for the store's next gather and travels in its all-to-all, and the
    root and first block are gathered together: a pass costs one collective per gather, less
    one, plus one for the reductions left at its end (instead of one per gather and one per
    unit's reduction), with the same gradients, bit for bit."""
    plain, plain_sync, names, _, _ = _one_process_step(fuse=False)
    fused, fused_sync, _, _, _ = _one_process_step(fuse=True)
    fetches = sum(1 for event, _ in fused.trace or [] if event.startswith("fetch"))
    # Forward: every unit; backward: the blocks but the last (gathered since its forward).
    assert fetches == len(names) + len(names) - 2
    assert plain.wire_collectives == fetches + len(plain_sync.buckets)
    # The first block rides with the root; the reductions left at the end go together.
    assert fused.wire_collectives == fetches
    assert not fused.queued
    for a, b in zip(plain_sync.buckets, fused_sync.buckets, strict=True):
        assert a.shard is not None and b.shard is not None
        assert torch.equal(a.shard, b.shard)


@pytest.mark.parametrize("span", [2, 4])
def test_small_blocks_are_gathered_in_groups(span: int) -> None:
    """``span`` blocks per gather (``controllers.memory.gather_mb``): a group's blocks start
    together, before the block ahead of them runs; the last group stays gathered from its
    forward into its backward; at most ``span`` + 1 blocks are gathered at once (the whole
    chunk at 4); and where exchanges are fused a pass of the 4 blocks costs one collective per
    group forward, one per group but the last backward, plus one for the last reductions (4 at
    2, 2 at 4; 8 one block at a time), with the gradients of one block per gather, bit for
    bit."""
    single, single_sync, names, _, _ = _one_process_step(fuse=True)
    grouped, grouped_sync, _, loss, expected = _one_process_step(fuse=True, span=span)
    assert loss == pytest.approx(expected, abs=1e-6)
    blocks = [n for n in names if "block" in n]
    trace = grouped.trace or []
    fetched = [i for i, (event, _) in enumerate(trace) if event.startswith("fetch")]
    # Forward: groups from the first block; backward: from the one before the last group.
    groups = [blocks[i:i + span] for i in range(0, 4, span)]
    last_group = groups[-1][0]
    groups += [blocks[max(0, i - span):i][::-1]
               for i in range(blocks.index(last_group), 0, -span)]
    starts = [trace[i][1] for i in fetched]
    assert starts == [names[-1], *[unit for group in groups for unit in group]]
    assert _most_gathered(trace, names[-1]) == min(span + 1, 4)
    assert _most_gathered(single.trace or [], names[-1]) == 2
    assert single.wire_collectives == 8
    assert grouped.wire_collectives == {2: 4, 4: 2}[span]
    for a, b in zip(single_sync.buckets, grouped_sync.buckets, strict=True):
        assert a.shard is not None and b.shard is not None
        assert torch.equal(a.shard, b.shard)


@pytest.mark.parametrize("layout", [
    ["parallelism.data=2", "parallelism.tensor=2", "controllers.memory.zero_stage=3"],
    ["model.kind=moe", "model.num_experts=4", "parallelism.experts=2", *Z3],
    ["parallelism.data=4", "controllers.memory.zero_stage=3"],
], ids=["data2_tensor2", "experts2", "data4_grouped"])
def test_stage3_matches_the_single_process_run(runs: dict[str, Path], tmp_path: Path,
                                               layout: list[str]) -> None:
    """Stage 3 at data 4, the store at 2 ranks per node (fixtures, one block per gather),
    data 2 x tensor 2, experts 2 (expert weights sharded over their replicas), and at data 4
    with the default grouping (the tiny model's 4 blocks are one group, kept gathered from
    the forward into the backward): |dloss| <= 1e-5 at every step."""
    reference = read_metrics(runs["single"])
    _assert_parity(reference, read_metrics(runs["zero3"]), "data4")
    _assert_parity(reference, read_metrics(runs["store"]), "store_2x2")
    if "model.kind=moe" in layout:
        reference = _train(tmp_path / "single", 1, *layout[:2])
    _assert_parity(reference, _train(tmp_path / "run", 4, *layout), str(layout))


def test_the_store_keeps_backward_gathers_inside_the_node(runs: dict[str, Path]) -> None:
    """What crossed which axis: plain stage 3 gathers everything over 'dp'; the store gathers
    the forward over 'dp' and the backward inside the node ('dp_intra'), and its gradients
    cross nodes ('dp_inter') on 1/2 of each layer."""
    plain = {(c["op"], c["axis"]): c["bytes"] for c in _summary(runs["zero3"])["comm"]}
    store = {(c["op"], c["axis"]): c["bytes"] for c in _summary(runs["store"])["comm"]}
    assert ("all_gather", "dp_intra") not in plain
    assert store[("all_gather", "dp_intra")] > 0
    # The same gathers, moved: plain stage 3's backward gathers (3/4 of a block from each
    # rank over 4 ranks) are the store's gathers inside the node (1/2 over 2 ranks), and its
    # forward gathers (evaluation's included) are the store's over 'dp'.
    plain_backward = plain[("all_gather", "dp")] - store[("all_gather", "dp")]
    assert plain_backward == pytest.approx(1.5 * store[("all_gather", "dp_intra")], rel=1e-9)
    assert store[("all_gather", "dp")] < 0.75 * plain[("all_gather", "dp")]
    assert store[("reduce_scatter", "dp_inter")] < 0.5 * plain[("reduce_scatter", "dp")]


def test_compressed_store_stays_close_and_sends_a_quarter(runs: dict[str, Path],
                                                          tmp_path: Path) -> None:
    """int8 weight gathers and int8 inter-node gradients (error feedback): quantization moves
    the losses (block scales: at most 1/254 of a block's largest weight per element) but by
    less than 0.05 over 8 steps, while the gathers and the inter-node reduction carry about a
    quarter of the fp32 bytes."""
    records = _train(tmp_path / "int8", 4, *STORE, "controllers.communication.weight_gather=int8",
                     "controllers.communication.compression=int8")
    reference = read_metrics(runs["single"])
    assert max(abs(a["loss"] - b["loss"]) for a, b in zip(reference, records, strict=True)) > 0
    _assert_parity(reference, records, "int8", tolerance=0.05)
    plain = {(c["op"], c["axis"], c["codec"]): c["bytes"] for c in _summary(runs["store"])["comm"]}
    int8 = {(c["op"], c["axis"], c["codec"]): c["bytes"]
            for c in _summary(tmp_path / "int8")["comm"]}
    assert int8[("all_gather", "dp", "int8")] <= 0.27 * plain[("all_gather", "dp", "none")]
    assert int8[("all_to_all", "dp_inter", "int8")] <= \
        0.27 * plain[("reduce_scatter", "dp_inter", "none")]


def test_stage3_holds_a_quarter_at_data4_as_estimated(runs: dict[str, Path]) -> None:
    """Counted from the tensors at the end of the run: stage 3 at data 4 holds <= 0.30x of a
    replica without ZeRO (parameters, gradients and AdamW state all 1/4, plus padding), within
    2% of the MemoryController's estimate; the store adds its node-local copy (1/2 of the
    parameters at 2 ranks per node)."""
    single = sum(_summary(runs["single"])["model_state_bytes"].values())
    for name in ("zero3", "store"):
        held = _summary(runs[name])["model_state_bytes"]
        plan = resolve_plan(load_config(runs[name] / "config.yaml"), 4)
        rows = dict(estimate_memory(plan.config, plan.parallel_dims()).rows())
        for key in STAGE_STATE:
            assert abs(held[key] - rows[key]) <= 0.02 * rows[key], (name, key, held, rows)
    zero3 = _summary(runs["zero3"])["model_state_bytes"]
    assert sum(zero3.values()) <= 0.30 * single
    store = _summary(runs["store"])["model_state_bytes"]
    assert store["parameters"] == pytest.approx(3 * zero3["parameters"], rel=0.02)


def test_stage3_resume_is_bitwise(runs: dict[str, Path], tmp_path: Path) -> None:
    """Resumed from its step-4 checkpoint, stage 3 at data 4 repeats steps 5-8 bit for bit."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["zero3"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-8")
    records = _train(run_dir, 4, *Z3, resume=True)
    (load,) = [e for e in recovery_events(run_dir) if e["event"] == "load"]
    assert load["step"] == 4 and "resharded_from" not in load
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in records] == \
        [(r["step"], r["loss"], r["grad_norm"]) for r in read_metrics(runs["zero3"])]


@pytest.mark.parametrize("target", [
    ["parallelism.data=2", "controllers.memory.zero_stage=1"],
    ["parallelism.data=1", "parallelism.tensor=2", "parallelism.pipeline=2"],
], ids=["to_stage1_data2", "to_tensor2_pipeline2"])
def test_stage3_checkpoints_reshard(runs: dict[str, Path], tmp_path: Path,
                                    target: list[str]) -> None:
    """A stage-3 data-4 checkpoint (unsharded model keys, optimizer pieces per shard) resumed
    under another stage and layout: the first step after it has the straight run's loss."""
    run_dir = tmp_path / "run"
    shutil.copytree(runs["zero3"], run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step-8")
    records = _train(run_dir, 4 if "parallelism.tensor=2" in target else 2, *target,
                     resume=True)
    (load,) = [e for e in recovery_events(run_dir) if e["event"] == "load"]
    assert load["step"] == 4 and "resharded_from" in load
    straight = {r["step"]: r["loss"] for r in read_metrics(runs["zero3"])}
    assert abs(records[4]["loss"] - straight[5]) <= 1e-5


@pytest.mark.parametrize("schedule", ["gpipe", "interleaved_1f1b"])
def test_stage3_under_a_pipeline_trains_the_single_process_losses(
        runs: dict[str, Path], tmp_path: Path, schedule: str) -> None:
    """Data 2 x pipeline 2, each stage's blocks sharded over its data ranks. GPipe runs every
    forward before the backwards, so the last stage's second backward needs the head gathered
    again after the first one's reduction freed it; the interleaved schedule (two chunks per
    rank) reduces once per step, the gradients kept whole until each chunk's last backward."""
    extra = ["parallelism.virtual_stages=2"] if schedule == "interleaved_1f1b" else []
    records = _train(tmp_path / schedule, 4, "parallelism.data=2", "parallelism.pipeline=2",
                     "controllers.memory.zero_stage=3", "controllers.memory.gather_mb=0",
                     f"parallelism.schedule={schedule}", *extra)
    _assert_parity(read_metrics(runs["single"]), records, schedule)
    placement = json.loads((tmp_path / schedule / "plan.json").read_text())["memory_placement"]
    per_step = "once per step" in placement["groups"][0]["gradients"]
    assert per_step == (schedule == "interleaved_1f1b"), placement


@pytest.mark.parametrize("settings,key", [
    (["parallelism.data=2", "controllers.memory.allocation=topology_aware"],
     "controllers.memory.allocation"),
    (["parallelism.data=2", "controllers.communication.compression=int8"],
     "controllers.communication.compression"),
], ids=["store_without_stage3", "int8_without_store"])
def test_what_stage3_cannot_do_is_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                          settings: list[str], key: str) -> None:
    proc = run_cli_in_process(capsys, "train", *sets(*BASE, *settings), "--nproc", "2",
                              "--run-dir", str(tmp_path / "never"))
    assert proc.returncode == 2 and f"mcpar: error: {key}: " in proc.stderr, proc.stderr
    assert not (tmp_path / "never").exists()
