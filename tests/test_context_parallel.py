"""Context parallelism: zigzag shards, ring and Ulysses attention against full attention, the
bytes on the 'cp' axis, loss parity of whole runs, and the combinations refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from conftest import TINY, run_cli_in_process

from mcpar.comm.communicator import Communicator
from mcpar.config import load_config
from mcpar.errors import UserError
from mcpar.launch.env import DistEnv, find_free_port
from mcpar.parallel.context import shard_sequence, zigzag_positions
from mcpar.parallel.ring_attention import ring_attention
from mcpar.parallel.ulysses import ulysses_attention
from mcpar.plan import resolve_plan
from mcpar.ring_blocks import KV_TAG
from mcpar.ring_geometry import visible
from mcpar.topology import ParallelDims
from mcpar.trainer import Trainer


def spawn_workers(fn: object, args: tuple, nprocs: int) -> None:
    """Real worker processes started afresh: forked ones (conftest's ``spawn_workers``) hang in
    libgomp when the test process has run a multi-threaded kernel before the fork (seen here:
    a worker stuck in ``gomp_team_barrier_wait_end`` from ``torch.zeros``)."""
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="spawn")


# --- the zigzag ----------------------------------------------------------------------------


def test_zigzag_rank_i_holds_chunks_i_and_2n_minus_1_minus_i() -> None:
    # 16 tokens, 4 ranks: 8 chunks of 2.
    assert zigzag_positions(16, 0, 4).tolist() == [0, 1, 14, 15]
    assert zigzag_positions(16, 1, 4).tolist() == [2, 3, 12, 13]
    assert zigzag_positions(16, 3, 4).tolist() == [6, 7, 8, 9]
    held = torch.cat([zigzag_positions(16, r, 4) for r in range(4)])
    assert sorted(held.tolist()) == list(range(16))  # every token once
    tokens = torch.arange(100, 116).view(1, 16)
    assert shard_sequence(tokens, 2, 4).tolist() == [[104, 105, 110, 111]]


def test_zigzag_balances_the_causal_work() -> None:
    """Keys each rank's queries see under the causal mask: equal under the zigzag, while a
    plain split gives the last rank 2n-1 times the first one's (the reason for the zigzag)."""
    seq, n = 64, 4
    zig = [int((zigzag_positions(seq, r, n) + 1).sum()) for r in range(n)]
    plain = [int((torch.arange(r * seq // n, (r + 1) * seq // n) + 1).sum()) for r in range(n)]
    assert len(set(zig)) == 1
    assert plain[-1] / plain[0] > 5


def _causal_scores(layout: str, rank: int, n: int, half: int) -> int:
    """Scores the causal mask keeps among the blocks ``visible`` gives ``rank`` (the ring's
    own rule for what each block computes)."""
    total = 0
    for source in range(n):
        seen = visible(layout, rank, source, half)
        if seen is not None:
            rows, cols, causal = seen
            r, c = len(range(2 * half)[rows]), len(range(2 * half)[cols])
            total += r * (r + 1) // 2 if causal else r * c
    return total


def test_the_ring_gives_every_zigzag_rank_the_same_causal_work() -> None:
    """Per rank, the causal scores of its blocks: equal under the zigzag; under a plain split
    they grow with the rank (4 ranks of 16 tokens: rank 3's are 904 against rank 0's 136)."""
    n, half = 4, 8
    zig = [_causal_scores("zigzag", r, n, half) for r in range(n)]
    plain = [_causal_scores("contiguous", r, n, half) for r in range(n)]
    assert len(set(zig)) == 1
    assert sum(zig) == sum(plain) == (2 * n * half) * (2 * n * half + 1) // 2  # the whole mask
    assert plain == [136, 392, 648, 904]


class _Done:
    def wait(self) -> None:
        pass


class _LocalRing:
    """The ring's messages without other ranks: each K/V receive is a copy of the block this
    rank holds at that step (forward only: no gradient ring)."""

    def __init__(self, rank: int, blocks: list[torch.Tensor]):
        self.rank, self.blocks, self.step = rank, blocks, 0

    def axis_size(self, axis: str) -> int:
        return len(self.blocks)

    def axis_rank(self, axis: str) -> int:
        return self.rank

    def send(self, *args: object, **kwargs: object) -> _Done:
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, axis: str, tag: int) -> _Done:
        assert tag == KV_TAG
        self.step += 1
        tensor.copy_(self.blocks[(self.rank - self.step) % len(self.blocks)])
        return _Done()


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_each_ring_layout_masks_its_blocks_like_full_causal_attention(layout: str) -> None:
    """Every rank's forward, its blocks arriving as the ring would send them: the zigzag and
    the plain split (the bench's baseline) both equal full causal attention on their rows."""
    seq, n = 32, 4
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, seq, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    shards = [zigzag_positions(seq, r, n) if layout == "zigzag"
              else torch.arange(r * seq // n, (r + 1) * seq // n) for r in range(n)]
    blocks = [torch.stack([k[:, :, p], v[:, :, p]]) for p in shards]
    for rank, pos in enumerate(shards):
        got = ring_attention(q[:, :, pos], k[:, :, pos], v[:, :, pos],
                             _LocalRing(rank, blocks), layout=layout)  # type: ignore[arg-type]
        torch.testing.assert_close(got, want[:, :, pos], rtol=0, atol=1e-12)


# --- attention over the ring, against full attention --------------------------------------

B, H, D = 2, 4, 8


def _attention_check(rank: int, world: int, seq: int, out_dir: Path) -> None:
    """On a worker of a ``parity_runs`` group: ring and Ulysses attention of one random
    sequence over a context axis of every rank, and full attention on the whole of it."""
    dims = ParallelDims(dp=1, tp=1, pp=1, ep=1, cp=world, world_size=world)
    dims.build_mesh("cpu")
    comm = Communicator(dims)
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (torch.randn(B, H, seq, D, generator=gen, dtype=torch.float64)
                     for _ in range(4))
    pos = zigzag_positions(seq, rank, world)
    # The reference on the worker, for the same numbers in the same thread setting.
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = F.scaled_dot_product_attention(*full, is_causal=True)
    ref.backward(dout)
    results: dict[str, object] = {"want": {
        name: t.detach()[:, :, pos]
        for name, t in (("out", ref), ("dq", full[0].grad), ("dk", full[1].grad),
                        ("dv", full[2].grad))}}
    for name, attend in (("ring", ring_attention), ("ulysses", ulysses_attention)):
        ql, kl, vl = (t[:, :, pos].clone().requires_grad_() for t in (q, k, v))
        comm.stats.reset_step()
        out = attend(ql, kl, vl, comm)
        forward_bytes = comm.stats.step_bytes_by_axis()
        out.backward(dout[:, :, pos])
        results[name] = {
            "out": out.detach(), "dq": ql.grad, "dk": kl.grad, "dv": vl.grad,
            "forward_bytes": forward_bytes, "bytes": comm.stats.step_bytes_by_axis(),
        }
    out_dir.mkdir(exist_ok=True)
    torch.save(results, out_dir / f"rank{rank}.pt")


ATTENTION_SEQ = 32


@pytest.fixture(scope="module", params=[2, 4])
def attention_runs(request: pytest.FixtureRequest,
                   parity_runs: Path) -> tuple[int, int, list[dict]]:
    world, out = request.param, parity_runs / f"attention{request.param}"
    return world, ATTENTION_SEQ, [torch.load(out / f"rank{r}.pt") for r in range(world)]


@pytest.mark.parametrize("mode", ["ring", "ulysses"])
def test_context_attention_matches_full_causal_attention(
        attention_runs: tuple[int, int, list[dict]], mode: str) -> None:
    world, seq, ranks = attention_runs
    for rank, result in enumerate(ranks):
        got = result[mode]
        for name, want in result["want"].items():
            assert want.shape == (B, H, seq // world, D)
            torch.testing.assert_close(got[name], want, rtol=0, atol=1e-9,
                                       msg=f"{mode} {name} rank {rank}")


def test_ring_bytes_are_the_kv_blocks_on_the_cp_axis(
        attention_runs: tuple[int, int, list[dict]]) -> None:
    """Forward: n-1 K/V blocks sent per rank; backward: n-1 more K/V blocks and n dK/dV blocks
    (accumulated in the inputs' float64), all counted on 'cp'."""
    world, seq, ranks = attention_runs
    block = 2 * B * H * (seq // world) * D * 8  # k and v, float64
    grads = block  # dk and dv
    for result in ranks:
        ring = result["ring"]
        assert ring["forward_bytes"] == {"cp": (world - 1) * block}
        assert ring["bytes"] == {"cp": 2 * (world - 1) * block + world * grads}
        # Ulysses: q, k, v out and the output back, (n-1)/n of each; the same in backward.
        per = B * H * (seq // world) * D * 8 * (world - 1) / world
        assert result["ulysses"]["bytes"] == {"cp": 8 * per}


# --- whole runs: loss parity with the single process ---------------------------------------

STEPS = 10
# fp32, no dropout; 4 sequences per step so that data 2 splits them too.
BASE = [*TINY, "model.seq_len=64", f"training.steps={STEPS}", "optimization.micro_batch_size=2",
        "optimization.gradient_accumulation=2", "training.dtype=float32"]
LLAMA = ["model.kind=llama", "model.num_heads=4", "model.num_kv_heads=2"]
# The auxiliary loss on: its per-sequence statistics must be summed over the context ranks.
MOE = ["model.kind=moe", "model.num_experts=4", "model.top_k=2", "model.aux_loss_coef=0.01"]
RUNS_2 = {
    "cp2_ring": ["parallelism.context=2"],
    "cp2_ulysses": ["parallelism.context=2", "parallelism.context_mode=ulysses"],
    "llama_cp2": [*LLAMA, "parallelism.context=2"],
    # ZeRO shards over data x context: 2 shards at data 1. Stage 3 saves at steps 5 and 10.
    "cp2_zero1": ["parallelism.context=2", "controllers.memory.zero_stage=1"],
    "cp2_zero2": ["parallelism.context=2", "controllers.memory.zero_stage=2"],
    "cp2_zero3": ["parallelism.context=2", "controllers.memory.zero_stage=3",
                  "optimization.checkpoint.interval=5"],
}
CP2_DP2_ZERO1 = ["parallelism.context=2", "parallelism.data=2",
                 "optimization.gradient_accumulation=1", "controllers.memory.zero_stage=1"]
RUNS_4 = {
    "cp4_ring": ["parallelism.context=4"],
    "cp2_dp2": ["parallelism.context=2", "parallelism.data=2",
                "optimization.gradient_accumulation=1"],
    "cp2_tp2": ["parallelism.context=2", "parallelism.tensor=2"],
    "cp2_tp2_sp": ["parallelism.context=2", "parallelism.tensor=2",
                   "parallelism.sequence_parallel=true"],
    # Two expert ranks within data 2; the experts are replicas over the context axis.
    "moe_cp2_ep2": [*MOE, "parallelism.context=2", "parallelism.data=2",
                    "parallelism.experts=2", "optimization.gradient_accumulation=1"],
    "cp2_pp2": ["parallelism.context=2", "parallelism.pipeline=2"],
    "cp2_dp2_zero1": CP2_DP2_ZERO1,  # 4 shards
    # ZeRO-3 with experts: dense shards over data x context (4), expert ones over 'edp' (2).
    "moe_cp2_ep2_zero3": [*MOE, "parallelism.context=2", "parallelism.data=2",
                          "parallelism.experts=2", "optimization.gradient_accumulation=1",
                          "controllers.memory.zero_stage=3"],
}
REFERENCE = {"gpt": [], "llama": LLAMA, "moe": MOE}


# Saved at context 2 (steps 5 and 10), resumed from step 5 at context 1 and 4.
SAVE = ["parallelism.context=2", "optimization.checkpoint.interval=5"]
RESUMED = {1: "resume_cp1", 4: "resume_cp4"}
# ZeRO-3's step-5 checkpoint at context 2 (2 shards), resumed at context 1 without ZeRO and at
# context 2 x data 2 with ZeRO-1 (4 shards).
ZERO_RESUMED = {1: ("zero3_resume_cp1", []), 4: ("zero3_resume_cp2_dp2_zero1", CP2_DP2_ZERO1)}


def _train_runs(rank: int, port: int, root: str, runs: dict[str, list[str]], world: int,
                resume: tuple[str, ...]) -> None:
    """``train_in_turn``, the runs named in ``resume`` continuing from their checkpoints."""
    torch.set_num_threads(1)
    env = DistEnv(rank, world, rank, world, "127.0.0.1", port, "mcpar")
    for name, settings in runs.items():
        run_dir = Path(root) / name
        run_dir.mkdir(exist_ok=True)
        Trainer(resolve_plan(load_config(None, [*BASE, *settings]), world), run_dir, env,
                resume=name in resume).train()
    if world > 1:  # the attention checks on the same workers (a process start costs seconds)
        _attention_check(rank, world, ATTENTION_SEQ, Path(root) / f"attention{world}")
    dist.barrier()
    dist.destroy_process_group()


def _runs(root: Path, runs: dict[str, list[str]], world: int, resume: tuple[str, ...] = ()
          ) -> None:
    spawn_workers(_train_runs, args=(find_free_port(), str(root), runs, world, resume),
                  nprocs=world)


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("cp_parity")
    _runs(root, {**RUNS_2, "saved_cp2": SAVE}, 2)
    for saved, targets in (("saved_cp2", RESUMED.values()),
                           ("cp2_zero3", [name for name, _ in ZERO_RESUMED.values()])):
        for target in targets:  # the step-5 checkpoint alone, in a run of its own
            shutil.copytree(root / saved / "checkpoints" / "step-5",
                            root / target / "checkpoints" / "step-5")
    zero1, zero4 = ZERO_RESUMED[1], ZERO_RESUMED[4]
    _runs(root, {**REFERENCE, RESUMED[1]: [], zero1[0]: zero1[1]}, 1,
          resume=(RESUMED[1], zero1[0]))
    _runs(root, {**RUNS_4, RESUMED[4]: ["parallelism.context=4"], zero4[0]: zero4[1]}, 4,
          resume=(RESUMED[4], zero4[0]))
    return root


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _losses(run: Path) -> list[float]:
    return [record["loss"] for record in _records(run)]


@pytest.mark.slow
@pytest.mark.parametrize("name", [*RUNS_2, *RUNS_4])
def test_loss_parity_with_the_single_process(parity_runs: Path, name: str) -> None:
    family = name.split("_")[0]
    reference = _losses(parity_runs / (family if family in REFERENCE else "gpt"))
    losses = _losses(parity_runs / name)
    assert len(losses) == len(reference) == STEPS
    for step, (ref, got) in enumerate(zip(reference, losses, strict=True), 1):
        assert abs(ref - got) <= 1e-5, f"{name} step {step}: {got} vs {ref}"
    assert losses[-1] < losses[0] - 0.3  # it learned


@pytest.mark.slow
def test_experts_see_the_tokens_of_the_single_process(parity_runs: Path) -> None:
    """Each token is routed alone, and the counts are summed over data and context: the same
    tokens per expert at every step; expert gradients cross the data x context replicas."""
    reference, records = _records(parity_runs / "moe"), _records(parity_runs / "moe_cp2_ep2")
    for ref, rec in zip(reference, records, strict=True):
        assert ([layer["tokens_per_expert"] for layer in rec["moe"]["layers"]]
                == [layer["tokens_per_expert"] for layer in ref["moe"]["layers"]])
        assert rec["comm_bytes_by_axis"]["ep"] > 0 and rec["comm_bytes_by_axis"]["edp"] > 0


@pytest.mark.slow
def test_a_run_sends_its_ring_on_the_cp_axis_and_plans_it(parity_runs: Path) -> None:
    plan = json.loads((parity_runs / "cp2_dp2" / "plan.json").read_text())
    assert plan["degrees"]["context"] == 2 and plan["degrees"]["data"] == 2
    assert plan["mesh"]["order"] == ["pp", "dp", "cp", "tp"]
    # The gradients are one all-reduce over data x context: the exchange averages 4 replicas.
    assert plan["grad_exchange"]["strategy"] == "allreduce"
    # The ring's bytes per rank and step, counted on 'cp': per layer and micro-batch, n-1 K/V
    # blocks forward, n-1 again and n dK/dV blocks backward; a block is 2 x micro 2 x heads 2 x
    # (64 / n) tokens x head_dim 16 x 4 bytes.
    for name, n, micro in (("cp2_ring", 2, 2), ("cp4_ring", 4, 2), ("cp2_dp2", 2, 1)):
        block = 2 * 2 * 2 * (64 // n) * 16 * 4
        want = 2 * micro * (3 * n - 2) * block
        for record in _records(parity_runs / name):
            assert record["comm_bytes_by_axis"]["cp"] == want, name
    # Ulysses: q, k, v and the output, (n-1)/n of each, forward and backward.
    ulysses = 2 * 2 * 8 * (2 * 2 * 32 * 16 * 4) / 2
    assert _records(parity_runs / "cp2_ulysses")[0]["comm_bytes_by_axis"]["cp"] == ulysses
    # The gradients: one ring all-reduce over the data x context group (2(n-1)/n of them).
    num_params = json.loads((parity_runs / "cp2_dp2" / "summary.json").read_text())["num_params"]
    assert _records(parity_runs / "cp2_dp2")[0]["comm_bytes_by_axis"]["dp_cp"] == \
        2 * 3 / 4 * num_params * 4
    assert _records(parity_runs / "gpt")[0]["comm_bytes"] == 0


# --- what is refused, with the key and the fix ---------------------------------------------

CP2 = [*TINY, "parallelism.context=2"]


@pytest.mark.parametrize(("settings", "needle"), [
    (["model.seq_len=30"], "model.seq_len: 30 is not divisible by 2 x parallelism.context 2"),
    (["parallelism.context_mode=ulysses", "parallelism.context=4", "model.seq_len=64"],
     "parallelism.context_mode: ulysses splits the 2 attention heads"),
    (["model.kind=moe", "model.num_experts=2", "parallelism.tensor=2",
      "parallelism.sequence_parallel=true"], "parallelism.sequence_parallel: is not supported "
     "with model.kind 'moe'"),
    (["controllers.memory.zero_stage=3", "controllers.memory.allocation=topology_aware"],
     "(controllers.memory.allocation)"),
    (["controllers.memory.activation_checkpointing=full"], "activation recompute"),
    (["controllers.communication.compression=fp16", "parallelism.data=2"],
     "(controllers.communication.compression)"),
    (["controllers.communication.topology=hierarchical"], "(controllers.communication.topology)"),
    (["model.dropout=0.1"], "(model.dropout)"),
    (["training.compile=true"], "(training.compile)"),
])
def test_unbuilt_combinations_are_refused_naming_the_key(settings: list[str], needle: str) -> None:
    with pytest.raises(UserError) as err:
        resolve_plan(load_config(None, [*CP2, *settings]), None)
    assert any(needle in line for line in err.value.problems), err.value.problems


def test_the_world_must_fill_the_context_groups() -> None:
    plan = resolve_plan(load_config(None, CP2), 4)
    assert (plan.dp, plan.cp) == (2, 2)
    assert plan.parallel_dims().describe().endswith("x context 2")
    with pytest.raises(UserError, match="context 2 groups"):
        resolve_plan(load_config(None, CP2), 3)


def test_check_exits_2_with_one_line_naming_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = tmp_path / "cp.yaml"
    config.write_text("parallelism: {context: 2, data: 2}\n"
                      "controllers: {memory: {zero_stage: 3, allocation: topology_aware}}\n")
    proc = run_cli_in_process(capsys, "check", str(config))
    code, err = proc.returncode, proc.stderr
    assert code == 2
    lines = [line for line in err.splitlines() if "parallelism.context" in line]
    assert len(lines) == 1 and "use 'default'" in lines[0], err
    assert "Traceback" not in err


@pytest.mark.slow
def test_a_checkpoint_saved_at_context_2_resumes_at_context_1_and_4(parity_runs: Path) -> None:
    """The parameters are replicated over the context axis: what context 2 saved at step 5 goes
    on at context 1 and 4 with the single process's losses."""
    reference = {r["step"]: r["loss"] for r in _records(parity_runs / "gpt")}
    saved = json.loads((parity_runs / "saved_cp2" / "checkpoints" / "step-5" / "meta.json")
                       .read_text())
    assert saved["config"]["parallelism"]["context"] == 2
    for target in RESUMED.values():
        records = _records(parity_runs / target)
        assert [r["step"] for r in records] == list(range(6, STEPS + 1)), target
        for record in records:
            assert abs(record["loss"] - reference[record["step"]]) <= 1e-5, (target, record)


# --- ZeRO over data x context ------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(("name", "shards"), [("cp2_zero1", 2), ("cp2_zero2", 2),
                                               ("cp2_zero3", 2), ("cp2_dp2_zero1", 4)])
def test_zero_shards_over_the_data_and_context_ranks(parity_runs: Path, name: str,
                                                     shards: int) -> None:
    """The context ranks are replicas: ZeRO's shards are cut over data x context ('dp_cp'), so
    at data 1 context 2 each rank holds half the AdamW state (stage 2: and of the gradients;
    stage 3: and of the parameters), as measured from the tensors and as the plan estimated;
    clipping sums the shards' norms over the same group (the gradient norm of one process)."""
    plan = json.loads((parity_runs / name / "plan.json").read_text())
    dense = plan["memory_placement"]["groups"][0]
    assert (dense["axis"], dense["degree"]) == ("dp_cp", shards)
    full = json.loads((parity_runs / "gpt" / "summary.json").read_text())["model_state_bytes"]
    held = json.loads((parity_runs / name / "summary.json").read_text())["model_state_bytes"]
    stage = plan["memory_placement"]["zero_stage"]
    for row, sharded in (("optimizer state", True), ("gradients", stage >= 2),
                         ("parameters", stage == 3)):
        want = full[row] / shards if sharded else full[row]
        # Within the padding to a multiple of the shards and AdamW's per-piece step counters.
        assert abs(held[row] - want) <= 0.01 * want, (row, held, full)
        assert abs(held[row] - plan["memory"][row]) <= 0.01 * want, (row, held, plan["memory"])
    reference = _records(parity_runs / "gpt")
    for ref, rec in zip(reference, _records(parity_runs / name), strict=True):
        assert abs(rec["grad_norm"] - ref["grad_norm"]) <= 1e-5 * ref["grad_norm"], rec["step"]


@pytest.mark.slow
def test_a_zero3_checkpoint_at_context_2_resumes_at_context_1_and_data_2(
        parity_runs: Path) -> None:
    """ZeRO-3's shards at context 2 (2 per bucket, over data x context) go on at context 1
    without ZeRO and at context 2 x data 2 with ZeRO-1 (4 shards): the single process's
    losses."""
    reference = {r["step"]: r["loss"] for r in _records(parity_runs / "gpt")}
    for target, _ in ZERO_RESUMED.values():
        records = _records(parity_runs / target)
        assert [r["step"] for r in records] == list(range(6, STEPS + 1)), target
        for record in records:
            assert abs(record["loss"] - reference[record["step"]]) <= 1e-5, (target, record)
