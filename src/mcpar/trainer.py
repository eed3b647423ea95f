"""The training loop of one worker: wires the plan, mesh, controllers, model, data and metrics.

Order of construction (fixed, so every rank builds the same thing):
1. device and process group (explicit device; gloo on CPU, NCCL on CUDA);
2. ParallelDims of the plan's degrees, and its DeviceMesh;
3. CommunicationController over the mesh's groups, with the plan's data-axis topology;
4. data: corpus, training and validation streams (layout-independent sample order);
5. the model, parallelized in a fixed order on the plan's stage cut (``parallel/parallelize.py``),
   then the MemoryController's activation recompute policy;
6. the gradient sync (under ZeRO-3, with the MemoryController's parameter store); dynamic batch
   splitting, if planned (a new plan); ``plan.json``;
7. the optimizer and the planned gradient exchange (the CommunicationController's);
8. the ComputeController, with the step's task list from its schedule generator;
9. fault recovery: when resuming, the newest valid checkpoint is restored (parameters,
   optimizer, RNG, data position) before the run logger opens metrics.jsonl;
10. the loop: the ComputeController runs each step's tasks, the last of which is the update
    (gradients clipped over the whole mesh, the optimizer step, each rank's own checksums of
    what it holds verified before it and recorded after it); every ``consistency_interval``
    steps the MemoryController compares the replicas and gathers those findings; checkpoints
    between steps.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from mcpar.auto_layout import predicted_against_measured, resolve_job
from mcpar.checkpoint.manager import FaultRecoveryManager
from mcpar.comm.collectives import LinkModel
from mcpar.comm.compression_state import MODEL_AXES, CompressionState, RankStateGroup
from mcpar.config import JobConfig
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.grad_exchange import build_grad_exchange
from mcpar.controllers.compute.batch_split import choose_split
from mcpar.controllers.compute.controller import StepBatch
from mcpar.controllers.memory.consistency import ReplicaConsistency, ReplicaMismatch
from mcpar.controllers.memory.held import model_state_bytes
from mcpar.controllers.memory.measure import MemoryMeter, trainer_memory
from mcpar.controllers.memory.recompute import apply_layer_recompute
from mcpar.data.corpus import load_corpus
from mcpar.data.stream import BatchStream
from mcpar.device import (
    autocast,
    rng_state,
    select_device,
    set_rng_state,
    setup_worker,
    synchronize,
)
from mcpar.faults import FaultInjector
from mcpar.interop.hf_import import init_shards
from mcpar.launch.env import DistEnv, join_process_group
from mcpar.metrics import RunLogger, truncate_metrics, write_json_atomic
from mcpar.models.moe import describe_expert_kernel
from mcpar.models.spec import get_model_spec
from mcpar.parallel.compile import compile_seconds, finish_blocks
from mcpar.parallel.compiled_graphs import per_rank as compiled_per_rank
from mcpar.parallel.context import shard_sequence
from mcpar.parallel.parallelize import parallelize
from mcpar.plan import JobPlan
from mcpar.post_validation import PostValidatedUpdate, Verdict
from mcpar.profiler.session import RunProfiler
from mcpar.step_agreement import StepResult, Straggling
from mcpar.step_update import RUN_AGAIN, StepUpdates
from mcpar.topology import detect_node_of_rank

# Tags of the forward-only pipeline used for validation, far from the executor's tags.
EVAL_TAG_BASE = 1 << 24


def lr_at(step: int, cfg: JobConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    opt, total = cfg.optimization, cfg.training.steps
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    progress = (step - opt.warmup_steps) / max(1, total - opt.warmup_steps)
    floor = opt.lr * opt.min_lr_ratio
    return floor + (opt.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


# Post-validation pays off only where its guess (no clip, nothing non-finite) rarely fails:
# past this share of redone steps the run says so.
REDONE_WARNING_SHARE = 0.1


class Trainer(StepUpdates):
    def __init__(self, plan: JobPlan, run_dir: Path, env: DistEnv | None,
                 resume: bool = False, stop_after: int | None = None,
                 faults: FaultInjector | None = None):
        """``resume``: continue from the newest valid checkpoint (step 0 if there is none).
        ``stop_after``: stop after that step, saving a checkpoint, without changing the
        schedule (the LR decay still targets ``training.steps``). ``faults``: what a test
        injects (None in production). The builds run in the module docstring's order."""
        self.cfg, self.plan, self.run_dir = plan.config, plan, run_dir
        self.stop_after, self.faults = stop_after, faults
        self.skipped_steps = self.nonfinite_in_a_row = 0
        mesh_device = self._start_process(env)  # 1
        self.dims = plan.parallel_dims()  # 2
        self.dims.build_mesh(mesh_device)
        self.comm = CommunicationController(self.dims)  # 3
        self._setup_topology(plan.communication.topology)
        self.dp_rank = self.dims.axis_rank("dp")
        self._build_data()  # 4
        self._build_model()  # 5
        self.memory = plan.memory.build(self.comm, self.pm.chunks, self.pm.params,  # 6
                                        plan.communication, run_dir, self.rank, self.device)
        self.grad_sync, self.store = self.memory.grad_sync, self.memory.store
        self._log(*self.memory.notes)
        if plan.compute.batch_splitting == "dynamic":
            self.plan = self._split_batch(env)
        if self.rank == 0 and not resume:
            write_json_atomic(run_dir / "plan.json", self.plan.to_json())
        self._build_update()  # 7
        self._build_compute()  # 8
        self._build_recovery(env, resume)  # 9
        self.logger = RunLogger(run_dir, enabled=self.rank == 0,
                                tensorboard=self.cfg.training.tensorboard,
                                wandb=self.cfg.training.wandb, config=self.cfg)
        self.profiler = RunProfiler(self)  # MFU per step; training.profile's window
        self.last_consistent_step = self.start_step  # a checkpoint resumed from was checked
        self.shards = self.memory.owned_shards(self.optimizer)  # ZeRO: what this rank updates
        self.consistency = ReplicaConsistency(
            self.memory.replicated(self.pm.chunks), self.comm, self.shards,
            self.store.node_caches() if self.store is not None else None)

    # --- the builds, in order -----------------------------------------------------------------
    def _log(self, *lines: str) -> None:
        if self.rank == 0 and lines:
            print("\n".join(f"mcpar: {line}" for line in lines), flush=True)

    def _start_process(self, env: DistEnv | None) -> str:
        """The explicit device and the process group (gloo on CPU, NCCL on CUDA); the device
        type the mesh is built on."""
        cfg = self.cfg
        info = select_device(cfg.training.device)
        if env is not None:
            join_process_group(env, info.backend, self.plan.collective_timeout_s)
        self.rank = env.rank if env else 0
        self.local_world_size = env.local_world_size if env else 1
        self.device = setup_worker(info, env.local_rank if env else 0, self.local_world_size)
        # The global RNG (dropout) starts from the config's seed, the same on every rank, so
        # that two runs of one config draw the same numbers (a resume restores its state).
        torch.manual_seed(cfg.training.seed)
        self.device_reason = info.reason
        return info.type

    def _build_data(self) -> None:
        """Corpus, training and validation streams (a layout-independent sample order)."""
        cfg, gbs = self.cfg, self.plan.global_batch_size
        corpus = load_corpus(
            cfg.data.source, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.val_fraction,
            token_dtype=cfg.data.token_dtype, cache_dir=cfg.data.cache_dir,
            is_main=self.rank == 0, barrier=self.comm.barrier,
        )
        self.corpus_description = corpus.description
        self.train_stream = BatchStream(corpus.train, cfg.model.seq_len, gbs, cfg.training.seed)
        self.val_stream = BatchStream(corpus.val, cfg.model.seq_len, gbs, cfg.training.seed)

    def _build_model(self) -> None:
        """The model, parallelized in the fixed order on the plan's stage cut, then the
        MemoryController's recompute and, last, torch.compile."""
        cfg = self.cfg
        self.spec = get_model_spec(cfg.model.kind)
        self.pm = parallelize(cfg, self.dims, self.comm, self.device, list(self.plan.stage_cut),
                              self.plan.compute.stages_of(self.dims.axis_rank("pp")))
        if cfg.model.init_from:  # a Hugging Face model's weights (a resume then loads over them)
            init_shards(cfg, self.pm.chunks, self.dims, self.plan.compute.placement)
        # The MemoryController's activation policy, last of the parallelize order (PP -> TP/SP
        # -> EP -> memory): the blocks (or attention cores) that rebuild in the backward pass.
        apply_layer_recompute(self.pm.chunks, self.pm.layer_ranges, self.dims.axis_rank("pp"),
                              self.dims.pp, self.plan.memory.recompute)
        # The experts' kernel is probed before compiling (the probe must not be traced).
        dtype = torch.bfloat16 if cfg.training.dtype == "bfloat16" else torch.float32
        notes = [describe_expert_kernel(self.device.type, dtype)] if cfg.model.is_moe else []
        notes += finish_blocks(self.pm.chunks, cfg, self.device)  # torch.compile: last
        self._log(*notes)
        self.meter = MemoryMeter(self.pm.params, self.device)  # measures the first step run

    def _split_batch(self, env: DistEnv | None) -> JobPlan:
        """Dynamic batch splitting: the ComputeController measures and plans a new split."""
        plan = self.plan
        choice, report = choose_split(
            self.cfg, plan.compute, plan.memory.budget_gb, self.dims, self.pm.chunks,
            self.pm.loss_fn, self.device, self.comm, self.local_world_size,
            self.activation_shape,
            memory_bytes=lambda m, b: plan.with_split(b, m).memory.estimate.total_bytes)
        self._log(report)
        return plan.with_split(choice.micro_batch_size, choice.num_microbatches)

    def _build_update(self) -> None:
        """The optimizer over what this rank holds, and the planned gradient exchange."""
        exchange = self.plan.communication
        self.optimizer, self.update_params = self.memory.build_optimizer(
            self.pm.params, self.cfg, exchange, self.comm)
        self.grad_exchange, exchange_text = build_grad_exchange(
            exchange, self.cfg, self.comm, self.grad_sync, self.optimizer,
            self.cfg.training.seed)
        if self.store is not None:  # the store reduces each layer's gradients and frees it
            self.grad_exchange.reducer = self.store.aggregate_gradients  # type: ignore[attr-defined]
        if exchange.strategy != "none":
            self._log(exchange_text)
        # Overlapping steps (the ComputeController's plan): each update is taken at once and
        # checked a step later.
        self.post_validation = None
        self._settled: list[Verdict] = []  # steps whose figures came in, for the loop to log
        self._stop_seen = False  # a settled step asked to stop: settle each step from now on
        if self.plan.compute.overlapped_steps:
            self.post_validation = PostValidatedUpdate(
                self.update_params, self.optimizer, self.comm,
                self.cfg.optimization.grad_clip,
                self.comm.group_ranks(self.plan.memory.shard_axis), self.rank)
            self._log("optimization.post_validation: each rank steps its optimizer as soon as "
                      "its gradients are final and checks the step's global norm and "
                      "finiteness one step later (a copy of its parameters, gradients and "
                      "optimizer state is kept)")

    def _build_compute(self) -> None:
        """The ComputeController's runtime from its plan: the pipeline executor, the step's
        task list, and the expert balancer of a model with experts."""
        cfg, plan, faults = self.cfg, self.plan, self.faults
        loss_fn = faults.wrap_loss(self.pm.loss_fn, self.rank) if faults else self.pm.loss_fn
        runtime = plan.compute.build(
            cfg, self.dims, self.comm, self.pm.chunks, self.device, self.meter.wrap_loss(loss_fn),
            self.activation_shape(plan.micro_batch_size),
            # The residual stream's dtype: fp32 under autocast, bf16 when offload keeps bf16
            # copies of the weights.
            self.pm.params[0].dtype, lambda: autocast(self.device, cfg.training.dtype),
            self.grad_sync, self._update, plan.memory.reduce_every_backward, self.optimizer,
            self.run_dir, has_experts=self.spec.expert_parallel is not None,
            is_main=self.rank == 0)
        self.executor, self.compute, self.moe = runtime.executor, runtime.controller, runtime.moe
        if self.store is not None:  # ZeRO-3: a chunk's weights are freed after each backward
            self.compute.after_backward = self.store.release_chunk
        self.meter.weight_grads = self.executor.weight_grads
        self.executor.hold_received = self.meter.holding
        self._log(*runtime.notes)

    def _build_recovery(self, env: DistEnv | None, resume: bool) -> None:
        """Fault recovery: when resuming, the newest valid checkpoint is restored (parameters,
        optimizer, RNG, data position) before the run logger opens metrics.jsonl."""
        rank_state = RankStateGroup([
            CompressionState(self.optimizer, self.grad_exchange.compressor,
                             coord=tuple(self.dims.axis_rank(a) for a in MODEL_AXES)),
            *([self.moe] if self.moe is not None else [])])
        self.recovery = FaultRecoveryManager(
            self.plan, self.run_dir, self.dims, self.pm.chunks, self.optimizer,
            self.train_stream, self.rank, barrier=self.comm.barrier, agree=self._agree,
            rank_state=rank_state, full_params=self.memory.full_parameters())
        if env is not None and self.cfg.optimization.checkpoint.interval > 0:
            self.recovery.install_sigterm_handler()
        # A run started from another run's checkpoint restores it as a resume does.
        loads = resume or self.cfg.optimization.checkpoint.load_from is not None
        self.start_step = self.recovery.restore() if loads else 0
        if resume and self.rank == 0:
            truncate_metrics(self.run_dir, self.start_step)

    def _setup_topology(self, topology: str) -> None:
        """Split the data axis by node for hierarchical / hybrid all-reduces."""
        if topology == "flat" or self.dims.dp == 1:
            return
        cluster = self.cfg.cluster
        link = None
        if cluster.inter_node_bandwidth_gbps is not None:
            assert cluster.intra_node_bandwidth_gbps is not None
            link = LinkModel(
                (cluster.intra_node_latency_us or 0.0) * 1e-6,
                cluster.intra_node_bandwidth_gbps * 1e9 / 8,
                (cluster.inter_node_latency_us or 0.0) * 1e-6,
                cluster.inter_node_bandwidth_gbps * 1e9 / 8,
            )
        self.comm.set_dp_topology(topology, detect_node_of_rank(cluster.ranks_per_node), link)
        if self.rank == 0:
            text = (f"mcpar: {topology} data-parallel all-reduce over {self.dims.dp_inter} "
                    f"node(s) x {self.dims.dp_intra} rank(s)")
            if self.comm.link is not None:
                text += f"; link model: {self.comm.link.describe()}"
            print(text, flush=True)

    def _agree(self, value: int) -> int:
        """Rank 0's ``value``, on every rank."""
        if self.dims.world_size == 1:
            return value
        mine = torch.tensor([value if self.rank == 0 else 0], dtype=torch.int64)
        self.comm.all_reduce(mine, axis="world")
        return int(mine.item())

    def activation_shape(self, micro_batch_size: int) -> tuple[int, int, int]:
        """Shape of the activations between pipeline stages (sequence-sharded under CP and SP)."""
        seq = self.cfg.model.seq_len // self.dims.cp
        if self.plan.sequence_parallel and self.dims.tp > 1:
            seq //= self.dims.tp
        return (micro_batch_size, seq, self.cfg.model.hidden_size)

    def _micro(self, stream: BatchStream, step: int, micro: int) -> tuple[torch.Tensor, ...]:
        cp_rank, cp = self.dims.axis_rank("cp"), self.dims.cp  # inputs, targets: its zigzag shard
        return tuple(shard_sequence(t, cp_rank, cp).to(self.device) for t in stream.micro_batch(
            step, self.dp_rank, self.dims.dp, micro, self.plan.micro_batch_size))

    def _step_batch(self, step: int) -> StepBatch:
        """This rank's micro-batches of ``step``: inputs where it holds the first stage,
        targets where it holds the last."""
        batches = [self._micro(self.train_stream, step, m)
                   for m in range(self.plan.num_microbatches)]
        inputs = [b[0] for b in batches] if self.pm.holds_first_stage else None
        targets = [b[1] for b in batches] if self.pm.holds_last_stage else None
        return inputs, targets

    # --- one optimizer step --------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        self.pm.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        batch = self._step_batch(step)
        rng = rng_state(self.device) if self.post_validation is not None else None
        with self.meter.step():
            result = self.compute.run_step(step, batch)
            if result is RUN_AGAIN:
                # The previous step's check undid the weights this one ran on: run it again,
                # with its dropout's random draws as they were.
                assert rng is not None
                set_rng_state(self.device, rng)
                result = self.compute.run_step(step, batch)
        assert result is None or isinstance(result, StepResult)
        self.train_stream.advance()
        return result


    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over `eval_batches` global batches (the same ones every time)."""
        self.pm.train(False)
        total = torch.zeros(2, dtype=torch.float64)
        for step in range(self.cfg.training.eval_batches):
            for micro in range(self.plan.num_microbatches):
                inputs, targets = self._micro(self.val_stream, step, micro)
                if self.dims.pp > 1:
                    loss = self.executor.forward_only_loss(inputs, targets, self.pm.loss_fn,
                                                           EVAL_TAG_BASE)
                else:
                    with autocast(self.device, self.cfg.training.dtype):
                        logits = self.pm.chunks[0](inputs)
                    loss = self.pm.loss_fn(logits, targets).item()
                if loss is not None:
                    total += torch.tensor([loss, 1.0], dtype=torch.float64)
        # Only last-stage ranks hold losses; summing over the world counts each of them.
        self.comm.all_reduce(total, axis="world")
        return float(total[0] / total[1])

    def _check_replicas(self, step: int) -> float:
        """The MemoryController's consistency check; a mismatch is logged and raised (the
        launcher restarts from the last valid checkpoint). Its seconds."""
        before = self.consistency.seconds
        mismatches = self.consistency.check(step)
        for found in mismatches:
            self.recovery.log.log("replica_mismatch", echo=True, **found)
        if not mismatches:
            self.last_consistent_step = step
        else:
            # A save still in flight from before the last passing check holds consistent
            # replicas: commit it, so the restart resumes there. A later one is left
            # uncommitted (it may hold the corruption) and is never taken for a checkpoint.
            pending = self.recovery.pending_step
            if pending is not None and pending <= self.last_consistent_step:
                self.recovery.wait()
            first = mismatches[0]
            who = ("which rank holds the corrupt copy cannot be told"
                   if first["ranks"] is None else
                   f"corrupt on ranks {first['ranks']}, by {first['attribution']}")
            raise ReplicaMismatch(
                f"step {step}: {first['tensor']} ('{first['axis']}') is corrupt ({who}; "
                f"{len(mismatches)} tensor(s) in all); restarting from the last valid "
                "checkpoint")
        return self.consistency.seconds - before

    def _largest_model_state(self) -> dict[str, int]:
        """The model-state bytes (counted from the tensors) of the rank holding the most."""
        held = model_state_bytes(self.pm.params, self.grad_sync, self.optimizer,
                                 self.store.held_tensors() if self.store is not None
                                 else ([], []))
        rows = self.comm.all_gather(torch.tensor(list(held.values()), dtype=torch.float64),
                                    axis="world")
        largest = max(rows, key=lambda row: float(row.sum()))
        return {name: int(v) for name, v in zip(held, largest.tolist(), strict=True)}

    # --- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, tr = self.cfg, self.cfg.training
        tokens_per_step = self.plan.global_batch_size * cfg.model.seq_len
        # All shards together, from the spec (a sharded model holds only part of it here).
        num_params = self.spec.num_params(cfg.model)
        if self.rank == 0:
            print(f"mcpar: device {self.device_reason}; layout {self.dims.describe()}; "
                  f"model {cfg.model.kind} {num_params / 1e6:.2f}M params; "
                  f"data {self.corpus_description}; run dir {self.run_dir}", flush=True)
        if self.recovery.loaded_from_other_run and self.recovery.enabled:
            # This run's first checkpoint is the state it starts from, in its own layout: a
            # reshard checked by `mcpar checkpoint verify` against the other run's.
            self.recovery.save(self.start_step)
        if self.start_step >= tr.steps:
            self.recovery.close()
            if self.rank == 0:
                print(f"mcpar: the checkpoint is at step {self.start_step}, training.steps is "
                      f"{tr.steps}: nothing to train (raise training.steps to continue)",
                      flush=True)
            self.logger.close()
            return {"final_step": self.start_step, "stopped": False}
        progress = None
        if self.rank == 0 and tr.progress:
            from tqdm import tqdm
            progress = tqdm(total=tr.steps, desc="train", unit="step", mininterval=1.0)
        start_wall = time.perf_counter()
        tokens_per_s_sum, loss, val_loss = 0.0, float("nan"), None
        steps_run, interval = 0, cfg.optimization.checkpoint.interval
        step_times: list[float] = []
        exposed_comm: list[float] = []  # per step, for the prediction's terms
        behind_slowest: list[Straggling | None] = []  # per step, likewise
        own: dict[int, dict] = {}  # each step's own figures until the step is settled
        for step in range(self.start_step, tr.steps):
            self.profiler.before_step(step)
            self.comm.stats.reset_step()
            synchronize(self.device)
            t0 = time.perf_counter()
            compiled = compile_seconds()
            if self.faults is not None:
                self.faults.before_step(step, self.rank, self.pm.params,
                                        [t for _, _, t in self.shards])
            result = self.train_step(step)
            synchronize(self.device)
            compile_s = compile_seconds() - compiled  # logged apart from the step's time
            step_time = time.perf_counter() - t0 - compile_s
            steps_run += 1
            step_times.append(step_time)
            # This rank's own figures of the step; the agreed ones join them once the step is
            # settled: at once, or at the next step's update under post-validation.
            own[step] = {
                "step": step + 1, "lr": lr_at(step, cfg), "tokens": tokens_per_step,
                "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                "comm_bytes": self.comm.stats.step_bytes(),
                "comm_bytes_by_axis": self.comm.stats.step_bytes_by_axis(),
                "comm_time_s": self.comm.stats.step_time_s(),
                # Waiting for gradient reductions after the step's compute: what overlap hid not.
                "exposed_comm_s": self.compute.exposed_comm_s(),
            }
            if compile_s > 0:
                own[step]["compile_s"] = compile_s
            exposed_comm.append(own[step]["exposed_comm_s"])
            settled = ([(step, result)] if self.post_validation is None
                       else self.take_settled())
            stop = False
            for done, agreed in settled:
                assert agreed is not None
                record = own.pop(done)
                loss, peak_mem = agreed.loss, agreed.peak_mem_bytes
                stop = stop or agreed.stop_requested
                self.max_params_per_rank = agreed.max_params_per_rank
                record.update({"loss": loss, "grad_norm": agreed.grad_norm,
                               "peak_mem_bytes": peak_mem, "skipped": agreed.skipped})
                straggling = agreed.straggling
                if straggling is not None:
                    # The replicas came to their gradient reductions this far apart: the
                    # slowest rank's lateness, which the exposed communication above includes.
                    record["slowest_rank"] = straggling.slowest_rank
                    record["grad_sync_spread_s"] = straggling.spread_s
                behind_slowest.append(straggling)
                if agreed.moe is not None:
                    record["moe"] = agreed.moe
                self.profiler.after_step(done, record)  # adds "mfu"
                if self._checks_replicas_after(done + 1):  # before a checkpoint keeps a bad one
                    record["consistency_check_s"] = self._check_replicas(done + 1)
                tokens_per_s_sum += record["tokens_per_s"]
                last = done + 1 == tr.steps
                if self._evaluates_after(done + 1):
                    val_loss = self.evaluate()
                    record["val_loss"] = val_loss
                if last or (done + 1) % tr.log_interval == 0:
                    self.logger.log(record)
                if progress is not None:
                    progress.update(1)
                    postfix = {"loss": f"{loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
                    if val_loss is not None:
                        postfix["val"] = f"{val_loss:.3f}"
                    progress.set_postfix(postfix, refresh=False)
            if not settled or settled[-1][0] != step:
                continue  # taken on post-validation's assumption: nothing is due after it
            last = step + 1 == tr.steps
            stop = not last and (stop or step + 1 == self.stop_after)
            if self._saves_after(step + 1) or (interval > 0 and stop):
                self.recovery.save(step + 1)
            if stop:
                break
        # An asynchronous save still in flight is committed (or raises) before the run ends.
        self.recovery.close()
        if progress is not None:
            progress.close()
        if tr.steps > self.start_step + steps_run:
            if self.rank == 0:
                print(f"mcpar: stopped after step {self.start_step + steps_run} of {tr.steps}"
                      + ("; continue with --resume" if interval > 0 else
                         " (no checkpoint: optimization.checkpoint.interval is 0)"), flush=True)
            self.logger.close()
            return {"final_step": self.start_step + steps_run, "stopped": True}
        summary = {
            "final_step": tr.steps, "final_loss": loss, "final_val_loss": val_loss,
            "model_state_bytes": self._largest_model_state(),
            "memory": trainer_memory(self),  # estimate and measurement per category
            "mean_tokens_per_s": tokens_per_s_sum / max(1, steps_run),
            "resumed_from_step": self.start_step,
            "layout": {"data": self.dims.dp, "tensor": self.dims.tp, "pipeline": self.dims.pp,
                       "experts": self.dims.ep, "world_size": self.dims.world_size},
            "wall_time_s": time.perf_counter() - start_wall, "num_params": num_params,
            "max_params_per_rank": self.max_params_per_rank,
            "skipped_steps": self.skipped_steps,
            "micro_batch_size": self.plan.micro_batch_size,
            "gradient_accumulation": self.plan.num_microbatches,
            "pipeline_stages": [list(r) for r in self.pm.layer_ranges],
            "flops_per_token": self.spec.flops_per_token(cfg.model),
            "device": self.device.type,
            "comm": self.comm.stats.breakdown(),
            "consistency": {"checks": self.consistency.checks,
                            "seconds": self.consistency.seconds,
                            "checksum_seconds": self.consistency.checksum_seconds},
        }
        if self.post_validation is not None:  # steps whose early update had to be redone
            redone = self.post_validation.redone_steps
            summary["post_validation"] = {"redone_steps": redone}
            if redone > REDONE_WARNING_SHARE * max(1, len(step_times)):
                self._log(f"optimization.post_validation: {redone} of {len(step_times)} steps "
                          "were redone (a clipped or non-finite step costs a second step): "
                          "raise optimization.grad_clip above the usual gradient norm, or set "
                          "post_validation false")
        if cfg.training.compile:  # what torch.compile did on every rank (a collective)
            summary["compile"] = compiled_per_rank(
                lambda t: self.comm.all_gather(t, axis="world"))
        if self.plan.auto is not None:  # the planner's prediction beside the measurement
            summary["prediction"] = predicted_against_measured(
                self.plan.auto.to_json()["chosen"], step_times, summary["memory"], exposed_comm,
                [(0.0, 0.0) if s is None else (s.own_wait_s, s.behind_mean_s)
                 for s in behind_slowest])
            # What it was priced on: the profile; the nodes and link where the job spans several.
            summary["prediction"]["ranked_on"] = self.plan.auto.ranked_on
        self.profiler.finish(summary)  # "mfu"; the profile report of a profiled window
        if self.rank == 0:
            if "prediction" in summary and summary["prediction"]["warning"]:
                print(f"mcpar: warning: {summary['prediction']['warning']}", flush=True)
            write_json_atomic(self.run_dir / "summary.json", summary)
            print(f"mcpar: done: {tr.steps} steps, loss {loss:.4f}, val loss {val_loss:.4f}, "
                  f"{summary['mean_tokens_per_s']:.0f} tokens/s, "
                  f"{summary['wall_time_s']:.1f} s", flush=True)
        self.logger.close()
        return summary

    def close(self) -> None:
        if dist.is_initialized():
            # Every rank is done communicating before any rank tears its connections down.
            self.comm.barrier()
            dist.destroy_process_group()


def run_worker(cfg: JobConfig, run_dir: Path, env: DistEnv, resume: bool = False,
               stop_after: int | None = None, plan: JobPlan | None = None) -> None:
    """Train as one worker of a launched job, leave the process group cleanly, and exit.

    The worker resolves the plan of ``cfg`` (the run directory's config) on the job's world,
    as the launcher did (or takes the launcher's ``plan``, e.g. an elastic re-plan); faults
    are injected only where a test asked for them in the environment.

    The exit skips interpreter finalization on purpose: gloo's worker threads can still hold
    completed work (tensors with Python references) whose destruction during finalization
    aborts the process (SIGABRT) after a run that succeeded. Every output is closed and flushed
    before this point.
    """
    trainer = Trainer(plan or resolve_job(cfg, env.world_size), run_dir, env, resume=resume,
                      stop_after=stop_after, faults=FaultInjector.from_env())
    # No closing barrier after a failure: a stalled or dead peer is often why this rank failed,
    # and waiting for it would report the barrier, one more timeout later, instead of the
    # collective that failed. The launcher stops the peers.
    trainer.train()
    trainer.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
