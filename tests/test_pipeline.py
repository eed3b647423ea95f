"""Pipeline parallelism: schedules, and the executor's parity with the single-process model.

The schedule tests run every rank's action list together in a simulated clock (forward 1, backward
2): each list must complete (no deadlock) and reach its schedule's theoretical idle fraction. The
executor tests run real gloo processes on GPT stages cut with ``cut_model`` and compare losses and
every parameter's gradient with the whole model run on the same micro-batches in one process, and
check the bytes the CommunicationController counted.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from conftest import spawn_workers

from mcpar.comm.communicator import CommHandle
from mcpar.config import ModelConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.compute.plan import ComputePlan
from mcpar.controllers.compute.schedules import (
    Action,
    build_schedule,
    message_orders,
    schedule_problem,
    step_tasks,
)
from mcpar.launch.env import find_free_port
from mcpar.models.spec import get_model_spec
from mcpar.parallel.pipeline import PipelineExecutor, global_stage
from mcpar.parallel.stage import cut_model
from mcpar.parallel.tasks import STAGE_TASKS, TaskKind
from mcpar.registry.schedule import SCHEDULES
from mcpar.topology import ParallelDims

# (schedule, virtual stages) pairs that build_schedule accepts
KINDS = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3),
         ("zb_h1", 1), ("zb_h2", 1), ("zbv", 2)]


def stage_of(schedule: str, chunk: int, rank: int, pp: int, v: int) -> int:
    return SCHEDULES.get(schedule).stage_of(chunk, rank, pp, v)


def rank_of(schedule: str, stage: int, pp: int, v: int) -> int:
    return next(r for r in range(pp) for c in range(v)
                if stage_of(schedule, c, r, pp, v) == stage)


def runnable(pp: int, max_micro: int = 8) -> list[tuple[str, int, int]]:
    return [(s, v, m) for s, v in KINDS for m in range(1, max_micro + 1)
            if schedule_problem(s, pp, m, v) is None]


def simulate(schedule: str, pp: int, m: int, v: int, fwd: float = 1.0,
             bwd: float = 2.0) -> tuple[bool, list[float]]:
    """Run all ranks' lists on a simulated clock; (all completed, idle fraction per rank).

    A task starts when its rank is free and its dependency has finished: the forward of the
    previous global stage (same micro-batch), or the backward of the next one (the last stage's
    backward waits for its own forward); a W waits for its own B. A chunk costs 1/v of a rank's
    work, as in the bench; a split schedule's B and W cost half a backward each.
    """
    split = SCHEDULES.get(schedule).splits_backward
    lists = [build_schedule(schedule, r, pp, m, v) for r in range(pp)]
    last = pp * v - 1
    finished: dict[tuple[str, int, int], float] = {}
    pos, free, busy = [0] * pp, [0.0] * pp, [0.0] * pp
    progress = True
    while progress:
        progress = False
        for r in range(pp):
            while pos[r] < len(lists[r]):
                a = lists[r][pos[r]]
                s = stage_of(schedule, a.chunk, r, pp, v)
                if a.kind == "F":
                    dep = ("F", s - 1, a.micro) if s > 0 else None
                elif a.kind == "W":
                    dep = ("B", s, a.micro)
                else:
                    dep = ("B", s + 1, a.micro) if s < last else ("F", s, a.micro)
                if dep is not None and dep not in finished:
                    break  # blocked on a receive; another rank must move first
                start = max(free[r], finished[dep] if dep else 0.0)
                cost = (fwd if a.kind == "F" else bwd / 2 if split else bwd) / v
                free[r] = start + cost
                busy[r] += cost
                finished[(a.kind, s, a.micro)] = free[r]
                pos[r] += 1
                progress = True
    complete = all(pos[r] == len(lists[r]) for r in range(pp))
    step = max(free)
    return complete, [1 - b / step for b in busy]


# -- schedules ----------------------------------------------------------------------------------


@pytest.mark.parametrize("pp", [1, 2, 4])
def test_every_task_once_and_forward_before_backward(pp: int) -> None:
    for schedule, v, m in runnable(pp):
        for rank in range(pp):
            actions = build_schedule(schedule, rank, pp, m, v)
            kinds = "FBW" if SCHEDULES.get(schedule).splits_backward else "FB"
            expected = {(k, c, i) for k in kinds for c in range(v) for i in range(m)}
            assert sorted((a.kind, a.chunk, a.micro) for a in actions) == sorted(expected)
            position = {(a.kind, a.chunk, a.micro): n for n, a in enumerate(actions)}
            for c in range(v):
                for i in range(m):
                    assert position[("F", c, i)] < position[("B", c, i)]


def test_gpipe_runs_every_forward_then_every_backward() -> None:
    assert build_schedule("gpipe", 1, 4, 3) == (
        [Action("F", 0, i) for i in range(3)] + [Action("B", 0, i) for i in range(3)])


@pytest.mark.parametrize("pp", [2, 4])
def test_1f1b_keeps_at_most_pp_minus_rank_micro_batches_in_flight(pp: int) -> None:
    for m in range(1, 9):
        for rank in range(pp):
            in_flight, peak = 0, 0
            for a in build_schedule("1f1b", rank, pp, m):
                in_flight += 1 if a.kind == "F" else -1
                peak = max(peak, in_flight)
            assert peak == min(pp - rank, m)


def test_1f1b_order_on_the_first_rank() -> None:
    f, b = (lambda i: Action("F", 0, i)), (lambda i: Action("B", 0, i))
    assert build_schedule("1f1b", 0, 4, 5) == [
        f(0), f(1), f(2), f(3), b(0), f(4), b(1), b(2), b(3), b(4)]


def test_interleaved_follows_megatron_order() -> None:
    # pp 2, v 2, m 4 on rank 0: warm-up 2 + 2 = 4 forwards sweeping chunk 0 then chunk 1 in
    # groups of pp micro-batches; backwards start on the last chunk.
    got = [(a.kind, a.chunk, a.micro) for a in build_schedule("interleaved_1f1b", 0, 2, 4, 2)]
    assert got == [
        ("F", 0, 0), ("F", 0, 1), ("F", 1, 0), ("F", 1, 1),
        ("F", 0, 2), ("B", 1, 0), ("F", 0, 3), ("B", 1, 1),
        ("F", 1, 2), ("B", 0, 0), ("F", 1, 3), ("B", 0, 1),
        ("B", 1, 2), ("B", 1, 3), ("B", 0, 2), ("B", 0, 3),
    ]


@pytest.mark.parametrize("pp", [2, 4])
def test_all_ranks_complete_and_reach_the_theoretical_bubble(pp: int) -> None:
    cases = runnable(pp)
    assert {s for s, _, _ in cases} == set(SCHEDULES.names())
    for schedule, v, m in cases:
        complete, idle = simulate(schedule, pp, m, v)
        assert complete, f"{schedule} pp {pp} m {m} v {v} deadlocks"
        if SCHEDULES.get(schedule).splits_backward:
            # Less idle than 1F1B's; their own theory: tests/test_zero_bubble.py.
            assert max(idle) < (pp - 1) / (m + pp - 1), (schedule, pp, m)
            continue
        theory = (pp - 1) / (v * m + pp - 1)
        for r, fraction in enumerate(idle):
            assert fraction == pytest.approx(theory, abs=1e-9), (schedule, pp, m, v, r)


@pytest.mark.parametrize("pp", [2, 4])
def test_messages_between_two_ranks_arrive_in_the_order_sent(pp: int) -> None:
    # NCCL ignores tags and matches sends to receives by order: the schedules must agree on it.
    for schedule, v, m in runnable(pp):
        last = pp * v - 1
        sent: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        received: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
        for r in range(pp):
            for a in build_schedule(schedule, r, pp, m, v):
                if a.kind == "W":
                    continue  # a weight-gradient task sends nothing
                s = stage_of(schedule, a.chunk, r, pp, v)
                step = 1 if a.kind == "F" else -1
                if (a.kind == "F" and s > 0) or (a.kind == "B" and s < last):
                    src = s - step  # the message this task waits for, from that stage
                    if rank_of(schedule, src, pp, v) != r:  # a V's turn stays on the rank
                        received.setdefault((rank_of(schedule, src, pp, v), r), []).append(
                            (a.kind, src, a.micro))
                if (a.kind == "F" and s < last) or (a.kind == "B" and s > 0):
                    to = rank_of(schedule, s + step, pp, v)
                    if to != r:
                        sent.setdefault((r, to), []).append((a.kind, s, a.micro))
        assert (sent, received) == message_orders(schedule, pp, m, v)
        # Only zbv reads a peer's messages in another order than sent (not at every m).
        assert sent == received or schedule == "zbv", (schedule, pp, m, v)
        # Every rank posts its receives in the sender's order, which the plan hands the executor
        # (it also lets a rank post them ahead of their tasks).
        plan = ComputePlan(pp=pp, virtual_stages=v, schedule=schedule, sequence_parallel=False,
                           micro_batch_size=1, num_microbatches=m, global_batch_size=m,
                           stage_cut=(), batch_splitting="fixed", balance=None)  # type: ignore
        for r in range(pp):
            order = plan.send_order(r)
            assert order is not None
            assert {src: msgs for (src, dst), msgs in sent.items() if dst == r} == order
            for src, msgs in order.items():
                assert sorted(msgs) == sorted(received[(src, r)])


def test_1f1b_and_gpipe_accept_fewer_micro_batches_than_stages() -> None:
    assert schedule_problem("1f1b", 4, 1, 1) is None
    assert schedule_problem("gpipe", 4, 2, 1) is None


@pytest.mark.parametrize("args,words", [
    (("interleaved_1f1b", 4, 2, 2), ["multiple of the pipeline degree 4", "(2)"]),
    (("interleaved_1f1b", 4, 6, 2), ["multiple of the pipeline degree 4", "(6)"]),
    (("interleaved_1f1b", 4, 8, 1), ["virtual_stages >= 2"]),
    (("interleaved_1f1b", 1, 4, 2), ["at least 2 ranks"]),
    (("1f1b", 4, 8, 2), ["virtual_stages is 2", "interleaved_1f1b"]),
    (("gpipe", 2, 4, 3), ["virtual_stages is 3"]),
    (("zero_bubble", 2, 4, 1), ["unknown pipeline schedule", "1f1b"]),
    (("1f1b", 2, 0, 1), ["at least 1 micro-batch"]),
])
def test_schedule_problems_are_named(args: tuple[str, int, int, int], words: list[str]) -> None:
    reason = schedule_problem(*args)
    assert reason is not None and "\n" not in reason
    for word in words:
        assert word in reason
    schedule, pp, m, v = args
    with pytest.raises(ValueError, match="schedule|micro-batch"):
        build_schedule(schedule, 0, pp, m, v)


# -- executor, one process ----------------------------------------------------------------------


def tiny_config(num_layers: int) -> ModelConfig:
    return ModelConfig(num_layers=num_layers, hidden_size=32, num_heads=2, seq_len=16,
                       vocab_size=64)


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def stages_of_rank(model: torch.nn.Module, pp: int, v: int, rank: int) -> list[torch.nn.Module]:
    ranges = [(s, s + 1) for s in range(pp * v)]  # one block per stage
    return [cut_model(model, ranges, global_stage(c, rank, pp)) for c in range(v)]


def lone_executor(m: int = 2, v: int = 1) -> PipelineExecutor:
    # Rank 0 of a 2-stage pipeline, without peers: enough for errors raised before any receive.
    model = get_model_spec("gpt").build(tiny_config(2 * v), 0)
    comm = CommunicationController(ParallelDims(dp=1, tp=1, pp=1, ep=1, world_size=1))
    return PipelineExecutor(stages_of_rank(model, 2, v, 0), 0, 2, comm, m, (2, 16, 32),
                            lm_loss, torch.device("cpu"))


class PeersAlreadySent:
    """A Communicator stand-in for one pipeline rank whose peers have sent everything: a
    receive completes at once. It records each receive as (peer, tag, tasks the rank had run
    when it was posted)."""

    def __init__(self) -> None:
        self.posted: list[tuple[int, int, int]] = []
        self.tasks_run = 0

    def irecv(self, tensor: torch.Tensor, src: int, axis: str = "pp", tag: int = 0) -> CommHandle:
        self.posted.append((src, tag, self.tasks_run))
        tensor.normal_()
        return CommHandle(None)

    def send(self, tensor: torch.Tensor, dst: int, axis: str = "pp", tag: int = 0) -> CommHandle:
        return CommHandle(None)


@pytest.mark.parametrize("ahead", [0, 1, 2])
def test_a_rank_keeps_receives_posted_ahead_in_each_peers_send_order(ahead: int) -> None:
    # The middle rank of three under 1F1B: activations come from rank 0, gradients from rank 2.
    pp, m, rank, shape = 3, 4, 1, (2, 16, 32)
    model = get_model_spec("gpt").build(tiny_config(pp), 0)
    plan = ComputePlan(pp=pp, virtual_stages=1, schedule="1f1b", sequence_parallel=False,
                       micro_batch_size=2, num_microbatches=m, global_batch_size=2 * m,
                       stage_cut=(), batch_splitting="fixed", balance=None)  # type: ignore
    wiring = {**plan.executor_wiring(rank, "cpu"), "receives_ahead": ahead}
    comm = PeersAlreadySent()
    executor = PipelineExecutor(stages_of_rank(model, pp, 1, rank), rank, pp, comm,  # type: ignore
                                m, shape, lm_loss, torch.device("cpu"), **wiring)
    tasks = step_tasks("1f1b", rank, pp, m)
    executor.begin(None, None)
    read_at: dict[tuple[int, int], int] = {}  # (peer, tag) -> index of the task that reads it
    for index, task in enumerate(tasks):
        comm.tasks_run = index
        if task.kind in (TaskKind.RECV_ACTIVATION, TaskKind.RECV_GRAD):
            src = rank - 1 if task.kind is TaskKind.RECV_ACTIVATION else rank + 1
            kind = "F" if task.kind is TaskKind.RECV_ACTIVATION else "B"
            read_at[(src, executor._tag(kind, src, task.micro))] = index
        if task.kind in STAGE_TASKS:
            executor.run_task(task)
    executor.end()

    order = wiring["send_order"]
    assert set(order) == {0, 2}
    for src, messages in order.items():
        tags = [executor._tag(*message) for message in messages]
        posted = [(tag, at) for peer, tag, at in comm.posted if peer == src]
        assert [tag for tag, _ in posted] == tags  # every message once, in the sender's order
        for k, (tag, at) in enumerate(posted):
            # Posted by the read of the message `ahead` before it (at the step's start for the
            # first `ahead`), and never later than its own read.
            due = 0 if k < ahead else read_at[(src, tags[k - ahead])] if ahead else \
                read_at[(src, tag)]
            assert at == due, (src, k, ahead)
    # At most `ahead` posted and unread per peer, of one micro-batch's activations each (one,
    # its own read's, without posting ahead).
    assert executor.last_stats.posted_peak_bytes == (2 * ahead or 1) * 2 * 16 * 32 * 4


def test_step_tasks_reject_too_few_micro_batches_for_interleaving() -> None:
    with pytest.raises(ValueError, match="multiple of the pipeline degree 2"):
        step_tasks("interleaved_1f1b", 0, 2, 1, 2)


def test_executor_needs_inputs_on_the_first_stage() -> None:
    tasks = step_tasks("1f1b", 0, 2, 2)
    with pytest.raises(ValueError, match="needs 2 micro-batches of inputs, got none"):
        lone_executor().run(None, None, tasks)
    with pytest.raises(ValueError, match="got 1"):
        lone_executor().run([torch.zeros(2, 16, dtype=torch.long)], None, tasks)


def test_executor_names_an_activation_shape_mismatch() -> None:
    tokens = [torch.zeros(3, 16, dtype=torch.long)] * 2  # 3 sequences, set up for 2
    with pytest.raises(ValueError, match=r"shape \(3, 16, 32\).*\(2, 16, 32\)"):
        lone_executor().run(tokens, None, step_tasks("1f1b", 0, 2, 2))


def test_step_tasks_arm_each_chunk_before_its_last_backward() -> None:
    # Interleaved, rank 0 of 2, 2 chunks, 4 micro-batches.
    tasks = step_tasks("interleaved_1f1b", 0, 2, 4, 2)
    kinds = [t.kind for t in tasks]
    assert kinds[-3:] == [TaskKind.WAIT_SENDS, TaskKind.WAIT_GRADS, TaskKind.OPTIMIZER_STEP]
    for chunk in range(2):
        backwards = [i for i, t in enumerate(tasks)
                     if t.kind is TaskKind.BACKWARD and t.chunk == chunk]
        (arm,) = [i for i, t in enumerate(tasks)
                  if t.kind is TaskKind.SYNC_GRADS and t.chunk == chunk]
        assert arm == backwards[-1] - 1  # right before the chunk's last backward
    # Every forward of a stage after the first is preceded by its receive, and every backward
    # of a stage before the last by the receive of its gradient.
    for i, t in enumerate(tasks):
        if t.kind is TaskKind.FORWARD and global_stage(t.chunk, 0, 2) > 0:
            assert tasks[i - 1].kind is TaskKind.RECV_ACTIVATION and tasks[i - 1].micro == t.micro
    # Without a pipeline: forward, backward of each micro-batch in turn, the arming before
    # the last backward only.
    plain = [t.kind.value for t in step_tasks("1f1b", 0, 1, 3)]
    assert plain == ["forward", "backward", "forward", "backward", "forward", "sync_grads",
                     "backward", "wait_sends", "wait_grads", "optimizer_step"]


# -- executor, real processes -------------------------------------------------------------------

MICRO_BATCH = 2


def reference(cfg: ModelConfig, seed: int, inputs: list[torch.Tensor],
              targets: list[torch.Tensor]) -> tuple[torch.nn.Module, list[float]]:
    """The whole model on every micro-batch in one process, loss averaged over micro-batches."""
    model = get_model_spec("gpt").build(cfg, seed)
    losses = []
    for x, y in zip(inputs, targets, strict=True):
        loss = lm_loss(model(x), y)
        (loss / len(inputs)).backward()
        losses.append(loss.item())
    return model, losses


def run_case(rank: int, pp: int, schedule: str, v: int, m: int, bf16: bool) -> dict:
    cfg = tiny_config(pp * v)
    seed = 1234 + m + v
    gen = torch.Generator().manual_seed(seed)
    inputs = [torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=gen)
              for _ in range(m)]
    targets = [torch.randint(0, cfg.vocab_size, (MICRO_BATCH, cfg.seq_len), generator=gen)
               for _ in range(m)]
    model = get_model_spec("gpt").build(cfg, seed)
    chunks = stages_of_rank(model, pp, v, rank)
    dims = ParallelDims(dp=1, tp=1, pp=pp, ep=1, world_size=pp)
    dims.build_mesh("cpu")
    comm = CommunicationController(dims)
    shape = (MICRO_BATCH, cfg.seq_len, cfg.hidden_size)
    executor = PipelineExecutor(
        chunks, rank, pp, comm, m, shape, lm_loss, torch.device("cpu"),
        activation_dtype=torch.bfloat16 if bf16 else torch.float32,
        forward_context=(lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if bf16
        else contextlib.nullcontext,
    )
    tasks = step_tasks(schedule, rank, pp, m, v)
    hooked = [t.chunk for t in tasks if t.kind is TaskKind.SYNC_GRADS]
    losses = executor.run(inputs if rank == 0 else None, targets if rank == pp - 1 else None,
                          tasks)

    ref_model, ref_losses = reference(cfg, seed, inputs, targets)
    held = {id(p) for c in chunks for p in c.parameters()}
    ref_params = dict(ref_model.named_parameters())
    grad_diff, num_held, stray_grads = 0.0, 0, 0
    for name, p in model.named_parameters():
        if id(p) not in held:
            stray_grads += p.grad is not None
            continue
        num_held += 1
        grad_diff = max(grad_diff, (p.grad - ref_params[name].grad).abs().max().item())
    sent_tensors = sum(
        (global_stage(c, rank, pp) != pp * v - 1) + (global_stage(c, rank, pp) != 0)
        for c in range(v)) * m
    element = 2 if bf16 else 4
    send = comm.stats.total.get(("send", "pp", "none"))
    stats = executor.last_stats
    return {
        "losses": losses, "ref_losses": ref_losses if rank == pp - 1 else [],
        "grad_diff": grad_diff, "num_held": num_held, "stray_grads": stray_grads,
        "sent_bytes": send.bytes if send else 0.0, "sent_calls": send.calls if send else 0,
        "expected_bytes": sent_tensors * MICRO_BATCH * cfg.seq_len * cfg.hidden_size * element,
        "expected_calls": sent_tensors, "hooked": hooked,
        "busy_s": stats.busy_s, "total_s": stats.total_s, "num_timed": len(stats.actions),
    }


def worker(rank: int, pp: int, port: int, cases: list[tuple[str, int, int, bool]],
           out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=pp)
    try:
        results = [run_case(rank, pp, *case) for case in cases]
        dist.barrier()
    finally:
        dist.destroy_process_group()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


def spawn(pp: int, cases: list[tuple[str, int, int, bool]], tmp: Path) -> list[list[dict]]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    spawn_workers(worker, args=(pp, find_free_port(), cases, str(tmp)), nprocs=pp, join=True)
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(pp)]


# (schedule, virtual stages, micro-batches, bf16)
CASES = {
    2: [("gpipe", 1, 4, False), ("1f1b", 1, 4, False), ("1f1b", 1, 1, False),
        ("interleaved_1f1b", 2, 4, False), ("1f1b", 1, 4, True)],
    4: [("gpipe", 1, 8, False), ("1f1b", 1, 8, False), ("interleaved_1f1b", 2, 4, False)],
}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[list[dict]]]:
    return {pp: spawn(pp, cases, tmp_path_factory.mktemp(f"pp{pp}"))
            for pp, cases in CASES.items()}


ALL_CASES = [(pp, n) for pp, cases in CASES.items() for n in range(len(cases))]


def case_id(pp_n: tuple[int, int]) -> str:
    pp, n = pp_n
    schedule, v, m, bf16 = CASES[pp][n]
    return f"pp{pp}-{schedule}-v{v}-m{m}" + ("-bf16" if bf16 else "")


@pytest.mark.slow
@pytest.mark.parametrize("pp_n", ALL_CASES, ids=case_id)
def test_pipeline_matches_the_single_process_model(results: dict, pp_n: tuple[int, int]) -> None:
    pp, n = pp_n
    _, v, m, bf16 = CASES[pp][n]
    per_rank = [results[pp][r][n] for r in range(pp)]
    last = per_rank[-1]
    assert len(last["losses"]) == m
    tol = 1e-2 if bf16 else 1e-5  # bf16 activations on the wire and bf16 autocast compute
    for got, want in zip(last["losses"], last["ref_losses"], strict=True):
        assert abs(got - want) <= tol
    for r, rec in enumerate(per_rank):
        if r != pp - 1:
            assert rec["losses"] == []
        # Each rank holds its v blocks (12 tensors each) plus embed (2) or head (3) at the ends.
        assert rec["num_held"] == 12 * v + 2 * (r == 0) + 3 * (r == pp - 1)
        assert rec["stray_grads"] == 0
        if not bf16:
            assert rec["grad_diff"] <= 1e-5, (r, rec["grad_diff"])
        assert rec["hooked"] == sorted(rec["hooked"], reverse=True) or v == 1
        assert sorted(rec["hooked"]) == list(range(v))
        assert rec["num_timed"] == 2 * v * m
        assert 0 < rec["busy_s"] <= rec["total_s"]


@pytest.mark.slow
@pytest.mark.parametrize("pp_n", ALL_CASES, ids=case_id)
def test_pipeline_send_bytes_are_counted(results: dict, pp_n: tuple[int, int]) -> None:
    pp, n = pp_n
    for rec in (results[pp][r][n] for r in range(pp)):
        assert rec["sent_calls"] == rec["expected_calls"]
        assert rec["sent_bytes"] == rec["expected_bytes"] > 0
