"""Context parallelism measured: the zigzag's balance, activation memory per rank, and torch's CP.

What it measures (``--part``, each in worker processes started afresh: ``spawn``, since forked
workers hung in libgomp once the parent had run a multi-threaded kernel)
    balance  Ring attention (forward + backward of ``mcpar.parallel.ring_attention``) of one
             causal sequence at context ``--context`` (default 4), under the zigzag (rank i holds
             chunks i and 2n-1-i of 2n) and under a plain contiguous split (rank i holds the i-th
             of n pieces; ``ring_attention(layout="contiguous")``, a function argument no config
             key reaches), both in the same run. Two ways:
             - ``isolated``: each rank's work timed alone, one rank after the other, in one
               process with 1 thread: the same ``RingAttention`` code with the ring's sends and
               receives replaced by local copies of the block the rank would receive (the
               gradients travelling with the blocks are zeros: same work, no other rank);
             - ``ring``: the real ring, ``--context`` processes on gloo, 1 thread each; per rank
               the wall time of forward + backward, and the part of it not spent waiting for the
               ring's messages ("busy"). With more ranks than cores (2 cores on the machine this
               was written on) the ranks are time-sliced, so "busy" includes being descheduled.
             Also, per rank, the attention scores each layout computes (a causal block computes
             its whole square, then masks) and the ones the causal mask needs.
    memory   ``Trainer`` runs of ``--steps`` 1 at context 1, 2 and 4 (GPT, ``--layers`` 2,
             ``--hidden`` 64, 4 heads, micro-batch 1, ``--seq`` 8192, fp32, ring): per rank the
             MemoryController meter's measured activation bytes (the tensors autograd saves, at
             their peak) against the context-1 measurement / n and against the estimate's
             activation row; a breakdown of what the first layer saves, by shape and dtype, at
             context 1 and n (to name the cause where the estimate is off). Then a budget
             (``controllers.memory.memory_budget_gb``) between the context-n and the context-1
             needs: the plan at context 1 is refused, the run at context n trains.
    torch    ``torch.distributed.tensor.experimental.context_parallel`` on this backend (CPU,
             gloo) at context 2 and 4, on the same attention shapes, for each rotate method
             (``set_rotate_method``) and SDPA backend; each variant's outcome (the error if any),
             and, where it runs, its loss and time against mcpar's ring in the same workers.

Output
    One JSON object per part (``--out`` writes it; ``--part all`` writes one file per part,
    ``bench/data/context_parallel_<part>.json`` by default). Every round is reported, not only
    medians; the machine's core count is recorded (timings on a shared 2-core machine vary).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from mcpar.comm.communicator import Communicator
from mcpar.launch.env import find_free_port
from mcpar.parallel.context import zigzag_positions
from mcpar.parallel.ring_attention import ring_attention
from mcpar.ring_blocks import GRAD_TAG, KV_TAG
from mcpar.topology import ParallelDims

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data"
LAYOUTS = ("zigzag", "contiguous")
HEADS, HEAD_DIM = 4, 16  # hidden 64, 4 heads: the memory part's model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=("balance", "memory", "torch", "all"), default="all")
    p.add_argument("--rounds", type=int, default=3, help="repeats of each timed measurement")
    p.add_argument("--iters", type=int, default=3, help="timed forward+backward per round")
    p.add_argument("--context", type=int, default=4, help="context degree of the balance part")
    p.add_argument("--seq", type=int, default=8192, help="sequence length (every part)")
    p.add_argument("--torch-seq", type=int, default=2048, help="sequence of the torch part")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--out", help="output file (one part); default bench/data/context_parallel_"
                                 "<part>.json")
    return p.parse_args(argv)


def positions(layout: str, seq: int, rank: int, n: int) -> torch.Tensor:
    if layout == "zigzag":
        return zigzag_positions(seq, rank, n)
    return torch.arange(rank * seq // n, (rank + 1) * seq // n)


def score_counts(layout: str, seq: int, n: int) -> list[dict[str, int]]:
    """Per rank: the scores its blocks compute (causal blocks whole) and those the mask keeps."""
    counts = []
    for rank in range(n):
        mine = positions(layout, seq, rank, n)
        needed = int((mine + 1).sum())
        computed = 0
        for source in range(n):
            theirs = positions(layout, seq, source, n)
            seen = (theirs.view(1, -1) <= mine.view(-1, 1))
            rows, cols = seen.any(1).sum(), seen.any(0).sum()  # the rectangle the ring computes
            computed += int(rows * cols)
        counts.append({"computed": computed, "needed": needed})
    return counts


def qkv(seq: int, batch: int = 1) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return [torch.randn(batch, HEADS, seq, HEAD_DIM, generator=gen) for _ in range(4)]


# --- balance: each rank's work alone --------------------------------------------------------

class _Done:
    def wait(self) -> None:
        pass


class LocalRing:
    """What ``RingAttention`` asks of a Communicator, without other ranks: a K/V receive is a
    copy of the block the rank would hold at that step, a gradient receive zeros."""

    def __init__(self, rank: int, n: int, kv_blocks: list[torch.Tensor]):
        self.rank, self.n, self.kv_blocks = rank, n, kv_blocks
        self.kv_received = 0

    def axis_size(self, axis: str) -> int:
        return self.n

    def axis_rank(self, axis: str) -> int:
        return self.rank

    def send(self, tensor: torch.Tensor, dst: int, axis: str = "", tag: int = 0) -> _Done:
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, axis: str = "", tag: int = 0) -> _Done:
        if tag == KV_TAG:  # forward and backward each receive n-1 blocks, steps 1..n-1
            step = self.kv_received % (self.n - 1) + 1
            self.kv_received += 1
            tensor.copy_(self.kv_blocks[(self.rank - step) % self.n])
        else:
            assert tag == GRAD_TAG
            tensor.zero_()
        return _Done()


def fwd_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, comm: Any,
            layout: str) -> tuple[float, torch.Tensor]:
    ql, kl, vl = (t.clone().requires_grad_() for t in (q, k, v))
    start = time.perf_counter()
    out = ring_attention(ql, kl, vl, comm, layout=layout)
    out.backward(dout)
    return time.perf_counter() - start, out.detach()


def isolated_round(seq: int, n: int, iters: int) -> dict[str, dict[str, list[float]]]:
    """Per layout and rank, the median and the minimum seconds of its forward+backward over
    ``iters`` passes; each pass times every (layout, rank) once, one after the other, so a
    neighbour's load on the shared cores falls on all of them alike."""
    torch.set_num_threads(1)
    q, k, v, dout = qkv(seq)
    work = {}
    for layout in LAYOUTS:
        shards = [positions(layout, seq, r, n) for r in range(n)]
        kv_blocks = [torch.stack([k[:, :, p], v[:, :, p]]) for p in shards]
        for rank, pos in enumerate(shards):
            work[layout, rank] = (q[:, :, pos], k[:, :, pos], v[:, :, pos], dout[:, :, pos],
                                  LocalRing(rank, n, kv_blocks), layout)
            fwd_bwd(*work[layout, rank])  # warm-up
    samples: dict[tuple[str, int], list[float]] = {key: [] for key in work}
    for _ in range(iters):
        for key, args in work.items():
            samples[key].append(fwd_bwd(*args)[0])
    return {layout: {stat: [fn(samples[layout, r]) for r in range(n)]
                     for stat, fn in (("median_s", statistics.median), ("min_s", min))}
            for layout in LAYOUTS}


# --- balance: the real ring -----------------------------------------------------------------

class WaitTimed:
    """A Communicator whose handles add their waiting time to ``waited``."""

    def __init__(self, comm: Communicator):
        self.comm, self.waited = comm, 0.0

    def axis_size(self, axis: str) -> int:
        return self.comm.axis_size(axis)

    def axis_rank(self, axis: str) -> int:
        return self.comm.axis_rank(axis)

    def _timed(self, handle: Any) -> Any:
        outer = self

        class Timed:
            def wait(self) -> None:
                start = time.perf_counter()
                handle.wait()
                outer.waited += time.perf_counter() - start
        return Timed()

    def send(self, tensor: torch.Tensor, dst: int, axis: str = "cp", tag: int = 0) -> Any:
        start = time.perf_counter()  # gloo's send may block until posted
        handle = self.comm.send(tensor, dst, axis=axis, tag=tag)
        self.waited += time.perf_counter() - start
        return self._timed(handle)

    def irecv(self, tensor: torch.Tensor, src: int, axis: str = "cp", tag: int = 0) -> Any:
        return self._timed(self.comm.irecv(tensor, src, axis=axis, tag=tag))


def _init(rank: int, world: int, port: int) -> Communicator:
    torch.set_num_threads(1)  # max(1, cores // workers) with 4 workers on 2 cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    dims = ParallelDims(dp=1, tp=1, pp=1, ep=1, cp=world, world_size=world)
    dims.build_mesh("cpu")
    return Communicator(dims)


def _ring_worker(rank: int, world: int, port: int, seq: int, iters: int, rounds: int,
                 out_dir: str) -> None:
    comm = _init(rank, world, port)
    q, k, v, dout = qkv(seq)
    result: dict[str, Any] = {"rounds": []}
    shards = {layout: positions(layout, seq, rank, world) for layout in LAYOUTS}
    for _ in range(rounds):
        walls: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        busy: dict[str, list[float]] = {layout: [] for layout in LAYOUTS}
        for i in range(iters + 1):  # the first is a warm-up; the layouts take turns
            for layout, pos in shards.items():
                timed = WaitTimed(comm)
                dist.barrier()
                wall, _ = fwd_bwd(q[:, :, pos], k[:, :, pos], v[:, :, pos], dout[:, :, pos],
                                  timed, layout)
                if i:
                    walls[layout].append(wall)
                    busy[layout].append(wall - timed.waited)
        result["rounds"].append({layout: {"wall_s": statistics.median(walls[layout]),
                                          "busy_s": statistics.median(busy[layout])}
                                 for layout in LAYOUTS})
    # Both layouts against full causal attention (the plain split is new code).
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*full, is_causal=True)
    want.backward(dout)
    for layout in LAYOUTS:
        pos = positions(layout, seq, rank, world)
        ql = q[:, :, pos].clone().requires_grad_()
        got = ring_attention(ql, k[:, :, pos].clone(), v[:, :, pos].clone(), comm, layout=layout)
        got.backward(dout[:, :, pos])
        assert full[0].grad is not None and ql.grad is not None
        result[f"{layout}_max_abs_err"] = {
            "out": float((got.detach() - want.detach()[:, :, pos]).abs().max()),
            "dq": float((ql.grad - full[0].grad[:, :, pos]).abs().max())}
    torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def spread(times: list[float]) -> float:
    return max(times) / min(times)


def balance(args: argparse.Namespace) -> dict:
    n, seq = args.context, args.seq
    counts = {layout: score_counts(layout, seq, n) for layout in LAYOUTS}
    result: dict[str, Any] = {
        "what": f"ring attention forward+backward, context {n}, seq {seq}, batch 1, {HEADS} "
                f"heads x {HEAD_DIM}, fp32, 1 thread per rank",
        "machine_cores": os.cpu_count(), "rounds": args.rounds, "iters_per_round": args.iters,
        "scores_per_rank": counts,
        "computed_scores_max_over_min": {lay: spread([c["computed"] for c in counts[lay]])
                                         for lay in LAYOUTS},
        "isolated": [], "ring": [],
    }
    for round_index in range(args.rounds):
        times = isolated_round(seq, n, args.iters)
        result["isolated"].append({lay: {**t, "max_over_min_of_medians": spread(t["median_s"]),
                                         "max_over_min_of_mins": spread(t["min_s"])}
                                   for lay, t in times.items()})
        print(f"context_parallel: balance isolated round {round_index + 1}: "
              + ", ".join(f"{lay} {spread(t['median_s']):.2f}" for lay, t in times.items()),
              file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(prefix="mcpar-cp-ring-") as tmp:
        mp.start_processes(_ring_worker, args=(n, find_free_port(), seq, args.iters,
                                               args.rounds, tmp), nprocs=n, join=True,
                           start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(n)]
    for round_index in range(args.rounds):
        row = {}
        for layout in LAYOUTS:
            wall = [r["rounds"][round_index][layout]["wall_s"] for r in ranks]
            busy = [r["rounds"][round_index][layout]["busy_s"] for r in ranks]
            row[layout] = {"wall_s": wall, "busy_s": busy, "busy_max_over_min": spread(busy),
                           "step_s": max(wall)}
        row["step_contiguous_over_zigzag"] = (row["contiguous"]["step_s"]
                                              / row["zigzag"]["step_s"])
        result["ring"].append(row)
    result["max_abs_err_vs_sdpa"] = {
        lay: {name: max(r[f"{lay}_max_abs_err"][name] for r in ranks) for name in ("out", "dq")}
        for lay in LAYOUTS}
    result["target"] = "zigzag per-rank max/min <= 1.10"
    return result


# --- memory ---------------------------------------------------------------------------------

def model_settings(args: argparse.Namespace, cp: int) -> list[str]:
    return [f"model.num_layers={args.layers}", f"model.hidden_size={args.hidden}",
            f"model.num_heads={HEADS}", f"model.seq_len={args.seq}", "model.kind=gpt",
            "training.steps=1", "optimization.micro_batch_size=1",
            "optimization.gradient_accumulation=1", "training.dtype=float32",
            "training.progress=false", "training.eval_interval=0", "training.eval_batches=1",
            f"parallelism.context={cp}"]


class SavedLog:
    """What one block's forward saves for backward: bytes of each new storage, under the
    innermost submodule running when it was first saved, its shape and dtype (parameters are
    left out: the meter counts them as model state)."""

    def __init__(self, block: torch.nn.Module) -> None:
        self.rows: Counter[str] = Counter()
        self.seen = {p.untyped_storage().data_ptr() for p in block.parameters()}
        self.stack: list[str] = []
        for name, module in block.named_modules():
            module.register_forward_pre_hook(lambda *_, n=name: self.stack.append(n or "block"))
            module.register_forward_hook(self._leave)

    def _leave(self, *_: object) -> None:  # a forward hook returning a value replaces the output
        self.stack.pop()

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.seen:
            self.seen.add(storage.data_ptr())
            where = self.stack[-1] if self.stack else "?"
            self.rows[f"{where}: {list(t.shape)} {str(t.dtype).removeprefix('torch.')}"] += \
                storage.nbytes()
        return t


def _memory_worker(rank: int, world: int, port: int, settings: list[str], out_dir: str) -> None:
    from mcpar.config import load_config
    from mcpar.launch.env import DistEnv
    from mcpar.plan import resolve_plan
    from mcpar.trainer import Trainer

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    env = DistEnv(rank, world, rank, world, "127.0.0.1", port, "mcpar")
    run_dir = Path(out_dir) / "run"
    run_dir.mkdir(exist_ok=True)
    trainer = Trainer(resolve_plan(load_config(None, settings), world), run_dir, env)
    summary = trainer.train()
    estimate = dict(trainer.plan.memory.estimate.rows())
    # What the first block saves, one forward (its parameters left out), to name any gap.
    block = trainer.pm.chunks[0].pieces()[1][0]
    log = SavedLog(block)
    hidden = torch.randn(1, trainer.plan.config.model.seq_len // world, block_width(block),
                         requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(log.pack, lambda t: t):
        block(hidden).sum()
    torch.save({"activations": trainer.meter.activations, "estimate": estimate,
                "loss": summary.get("final_loss"), "block_saves": dict(log.rows)},
               Path(out_dir) / f"rank{rank}.pt")
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def block_width(block: torch.nn.Module) -> int:
    return next(p.shape[-1] for p in block.parameters() if p.dim() == 1)


def _spawn(fn: Any, world: int, *args: Any) -> None:
    mp.start_processes(fn, args=(world, find_free_port(), *args), nprocs=world, join=True,
                       start_method="spawn")


def memory(args: argparse.Namespace) -> dict:
    from mcpar.config import load_config
    from mcpar.errors import UserError
    from mcpar.plan import resolve_plan

    contexts = [1, 2, 4]
    per_cp: dict[int, list[dict]] = {}
    for cp in contexts:
        with tempfile.TemporaryDirectory(prefix=f"mcpar-cp-mem{cp}-") as tmp:
            _spawn(_memory_worker, cp, model_settings(args, cp), tmp)
            per_cp[cp] = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(cp)]
        print(f"context_parallel: memory context {cp} done", file=sys.stderr, flush=True)
    base = per_cp[1][0]["activations"]
    result: dict[str, Any] = {
        "what": f"GPT {args.layers} layers, hidden {args.hidden}, {HEADS} heads, seq {args.seq}, "
                "micro-batch 1, fp32, ring; activations: the MemoryController meter's measured "
                "peak of the tensors autograd saves, per rank",
        "machine_cores": os.cpu_count(), "per_context": {}, "target": "ratios within 15%"}
    for cp, ranks in per_cp.items():
        est = ranks[0]["estimate"]["activations"]
        result["per_context"][str(cp)] = {
            "estimate_activations_B": est,
            "loss": ranks[0]["loss"],
            "ranks": [{"measured_B": r["activations"],
                       "measured_over_cp1_div_n": r["activations"] / (base / cp),
                       "measured_over_estimate": r["activations"] / est} for r in ranks],
            "first_block_saves_B": ranks[0]["block_saves"]}
    # The budget: between context 4's estimated peak and context 1's.
    peaks = {}
    for cp in (1, 4):
        plan = resolve_plan(load_config(None, model_settings(args, cp)), cp)
        peaks[cp] = dict(plan.memory.estimate.rows())["total"]
    budget_gb = (peaks[4] + (peaks[1] - peaks[4]) / 4) / 2**30
    budget = [f"controllers.memory.memory_budget_gb={budget_gb:.6f}"]
    try:
        plan1 = resolve_plan(load_config(None, model_settings(args, 1) + budget), 1)
        chosen = plan1.memory.budget
        at_1 = {"refused": False, "chosen": chosen.to_json() if chosen else None}
    except UserError as err:
        at_1 = {"refused": True, "problems": err.problems}
    with tempfile.TemporaryDirectory(prefix="mcpar-cp-budget-") as tmp:
        _spawn(_memory_worker, 4, model_settings(args, 4) + budget, tmp)
        at_4 = torch.load(Path(tmp) / "rank0.pt")
    result["budget"] = {"memory_budget_gb": budget_gb, "estimated_peak_B": peaks,
                        "context_1": at_1,
                        "context_4": {"trained": at_4["loss"] is not None, "loss": at_4["loss"],
                                      "measured_activations_B": at_4["activations"]}}
    return result


# --- torch's context_parallel ---------------------------------------------------------------

def _torch_worker(rank: int, world: int, port: int, seq: int, out_dir: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method
    from torch.nn.attention import SDPBackend, sdpa_kernel

    comm = _init(rank, world, port)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q, k, v, dout = qkv(seq)
    pos = zigzag_positions(seq, rank, world)
    mine_time, mine = fwd_bwd(q[:, :, pos], k[:, :, pos], v[:, :, pos], dout[:, :, pos], comm,
                              "zigzag")
    mcpar_loss = float((mine * dout[:, :, pos]).sum())
    outcomes = []
    for method in ("allgather", "alltoall"):
        for backend in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH"):
            set_rotate_method(method)
            buffers = [t.clone() for t in (q, k, v, dout)]
            row: dict[str, Any] = {"rotate_method": method, "sdpa_backend": backend}
            try:
                with sdpa_kernel([getattr(SDPBackend, backend)]), context_parallel(
                        mesh, buffers=buffers, buffer_seq_dims=[2] * 4,
                        no_restore_buffers=set(buffers)):
                    for t in buffers[:3]:
                        t.requires_grad_()
                    start = time.perf_counter()
                    out = F.scaled_dot_product_attention(*buffers[:3], is_causal=True)
                    out.backward(buffers[3])
                    row["step_s"] = time.perf_counter() - start
                    row["loss"] = float((out.detach() * buffers[3]).sum())
                row["ran"] = True
            except Exception as err:  # noqa: BLE001 - the outcome is the measurement
                row["ran"] = False
                row["error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:300]}"
            outcomes.append(row)
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps({
        "mcpar_ring": {"step_s": mine_time, "loss": mcpar_loss}, "torch": outcomes}))
    dist.barrier()
    dist.destroy_process_group()


def torch_peer(args: argparse.Namespace) -> dict:
    from torch.distributed.tensor.experimental._context_parallel import _attention

    result: dict[str, Any] = {
        # The ops torch's CP replaces by its ring (``_sdpa_handler``); SDPA on CPU dispatches
        # to none of them.
        "torch_cp_ring_ops": sorted(str(op) for op in _attention.custom_ops),
        "what": f"torch {torch.__version__} torch.distributed.tensor.experimental."
                f"context_parallel, CPU gloo, seq {args.torch_seq}, batch 1, {HEADS} heads x "
                f"{HEAD_DIM}, causal, fp32; loss = sum(out * fixed random dout), per rank",
        "machine_cores": os.cpu_count(), "per_context": {}}
    for cp in (2, 4):
        with tempfile.TemporaryDirectory(prefix=f"mcpar-cp-torch{cp}-") as tmp:
            _spawn(_torch_worker, cp, args.torch_seq, tmp)
            result["per_context"][str(cp)] = [
                json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(cp)]
    return result


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    parts = {"balance": balance, "memory": memory, "torch": torch_peer}
    names = list(parts) if args.part == "all" else [args.part]
    if args.out and len(names) > 1:
        raise SystemExit("--out names one file: give one --part")
    for name in names:
        result = parts[name](args)
        text = json.dumps(result, indent=1)
        print(text, flush=True)
        (Path(args.out) if args.out else DATA / f"context_parallel_{name}.json").write_text(
            text + "\n")


if __name__ == "__main__":
    main()
