"""The training loop of one worker: wires config, mesh, controllers, model, data and metrics.

Order of construction (fixed, so every rank builds the same thing):
1. device and process group (explicit device; gloo on CPU, NCCL on CUDA);
2. ParallelDims and its DeviceMesh;
3. CommunicationController over the mesh's groups;
4. data: corpus, training and validation streams (layout-independent sample order);
5. model from its spec with a seeded init, then data parallelism (bucketed gradient all-reduce);
6. optimizer, LR schedule, ComputeController;
7. the loop: ComputeController runs the step's micro-batch tasks, then clip and step.
"""

from __future__ import annotations

import datetime
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from mcpar.config import JobConfig
from mcpar.controllers.communication import CommunicationController
from mcpar.controllers.compute import ComputeController, MicroBatchTask
from mcpar.data import BatchStream, load_corpus
from mcpar.device import autocast, peak_memory_bytes, select_device, setup_worker, synchronize
from mcpar.launch import DistEnv
from mcpar.metrics import RunLogger, write_json_atomic
from mcpar.models.spec import get_model_spec
from mcpar.parallel.data import DataParallelGradSync
from mcpar.topology import resolve_layout


def lr_at(step: int, cfg: JobConfig) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr_ratio * lr` at the last step."""
    opt, total = cfg.optimization, cfg.training.steps
    if step < opt.warmup_steps:
        return opt.lr * (step + 1) / opt.warmup_steps
    progress = (step - opt.warmup_steps) / max(1, total - opt.warmup_steps)
    floor = opt.lr * opt.min_lr_ratio
    return floor + (opt.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def build_optimizer(model: torch.nn.Module, cfg: JobConfig) -> torch.optim.Optimizer:
    # Weight decay on matrices only; biases, norms and positions are left alone (GPT-2 practice).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = cfg.optimization
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": opt.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=opt.lr, betas=(opt.beta1, opt.beta2),
    )


@dataclass
class StepResult:
    loss: float
    grad_norm: float


class Trainer:
    def __init__(self, cfg: JobConfig, run_dir: Path, env: DistEnv | None):
        self.cfg = cfg
        self.run_dir = run_dir
        info = select_device(cfg.training.device)
        if env is not None and not dist.is_initialized():
            dist.init_process_group(
                backend=info.backend, rank=env.rank, world_size=env.world_size,
                init_method=f"tcp://{env.master_addr}:{env.master_port}",
                timeout=datetime.timedelta(minutes=5),
            )
        self.rank = env.rank if env else 0
        self.device = setup_worker(info, env.local_rank if env else 0,
                                   env.local_world_size if env else 1)
        self.device_reason = info.reason
        self.dims = resolve_layout(cfg, env.world_size if env else 1)
        self.dims.build_mesh(info.type)
        self.comm = CommunicationController(self.dims)
        self.dp_rank = self.dims.axis_rank("dp")

        opt, tr = cfg.optimization, cfg.training
        corpus = load_corpus(
            cfg.data.source, cfg.data.tokenizer, cfg.model.vocab_size, cfg.data.val_fraction,
            token_dtype=cfg.data.token_dtype, cache_dir=cfg.data.cache_dir,
            is_main=self.rank == 0, barrier=self.comm.barrier,
        )
        self.corpus_description = corpus.description
        gbs = opt.global_batch_size
        assert gbs is not None
        self.train_stream = BatchStream(corpus.train, cfg.model.seq_len, gbs, tr.seed)
        self.val_stream = BatchStream(corpus.val, cfg.model.seq_len, gbs, tr.seed)

        self.spec = get_model_spec(cfg.model.kind)
        self.model = self.spec.build(cfg.model, tr.seed).to(self.device)
        self.grad_sync = DataParallelGradSync(
            list(self.model.parameters()), self.comm,
            bucket_size_mb=cfg.controllers.communication.bucket_size_mb,
            overlap=cfg.controllers.communication.overlap,
        )
        self.optimizer = build_optimizer(self.model, cfg)
        self.compute = ComputeController(opt.gradient_accumulation or 1,
                                         self._forward_backward, self.grad_sync)
        self.logger = RunLogger(run_dir, enabled=self.rank == 0, tensorboard=tr.tensorboard)

    # --- one micro-batch -----------------------------------------------------------------------
    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with autocast(self.device, self.cfg.training.dtype):
            logits = self.model(inputs.to(self.device))
        return F.cross_entropy(logits.float().flatten(0, 1), targets.to(self.device).flatten())

    def _forward_backward(self, task: MicroBatchTask) -> float:
        inputs, targets = self.train_stream.micro_batch(
            task.step, self.dp_rank, self.dims.dp, task.micro_index,
            self.cfg.optimization.micro_batch_size,
        )
        loss = self._loss(inputs, targets)
        # Mean over the step's micro-batches; the data-parallel mean happens in the all-reduce.
        (loss / self.compute.num_microbatches).backward()
        return loss.item()

    # --- one optimizer step --------------------------------------------------------------------
    def train_step(self, step: int) -> StepResult:
        self.model.train()
        for group in self.optimizer.param_groups:
            group["lr"] = lr_at(step, self.cfg)
        losses = self.compute.run_step(step)
        clip = self.cfg.optimization.grad_clip
        # Gradients are already averaged over data ranks, so every rank computes the same norm.
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        self.optimizer.step()
        self.train_stream.advance()
        return StepResult(sum(losses) / len(losses), float(grad_norm))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean validation loss over `eval_batches` global batches (the same ones every time)."""
        self.model.eval()
        total = torch.zeros(2, dtype=torch.float64)
        opt = self.cfg.optimization
        for step in range(self.cfg.training.eval_batches):
            for micro in range(opt.gradient_accumulation or 1):
                inputs, targets = self.val_stream.micro_batch(
                    step, self.dp_rank, self.dims.dp, micro, opt.micro_batch_size)
                total[0] += self._loss(inputs, targets).item()
                total[1] += 1
        self.comm.all_reduce(total, axis="dp")
        return float(total[0] / total[1])

    def _gather_step_stats(self, loss: float) -> tuple[float, int]:
        """Data-parallel mean loss and the peak memory of the largest rank, in one collective."""
        local = torch.tensor([loss, float(peak_memory_bytes(self.device))], dtype=torch.float64)
        rows = self.comm.all_gather(local, axis="dp")
        # Peak memory over every rank (tensor/pipeline peers too, once they exist).
        stacked = torch.stack(rows)
        return float(stacked[:, 0].mean()), int(stacked[:, 1].max())

    # --- the loop ------------------------------------------------------------------------------
    def train(self) -> dict:
        cfg, tr = self.cfg, self.cfg.training
        tokens_per_step = cfg.optimization.global_batch_size * cfg.model.seq_len
        # All shards together, from the spec (a sharded model holds only part of it here).
        num_params = self.spec.num_params(cfg.model)
        if self.rank == 0:
            print(f"mcpar: device {self.device_reason}; layout {self.dims.describe()}; "
                  f"model {cfg.model.kind} {num_params / 1e6:.2f}M params; "
                  f"data {self.corpus_description}; run dir {self.run_dir}", flush=True)
        progress = None
        if self.rank == 0 and tr.progress:
            from tqdm import tqdm
            progress = tqdm(total=tr.steps, desc="train", unit="step", mininterval=1.0)
        start_wall = time.perf_counter()
        tokens_per_s_sum, loss, val_loss = 0.0, float("nan"), None
        for step in range(tr.steps):
            self.comm.stats.reset_step()
            synchronize(self.device)
            t0 = time.perf_counter()
            result = self.train_step(step)
            synchronize(self.device)
            step_time = time.perf_counter() - t0
            loss, peak_mem = self._gather_step_stats(result.loss)
            record = {
                "step": step + 1, "loss": loss, "lr": lr_at(step, cfg),
                "grad_norm": result.grad_norm, "tokens": tokens_per_step,
                "step_time_s": step_time, "tokens_per_s": tokens_per_step / step_time,
                "comm_bytes": self.comm.stats.step_bytes(),
                "comm_time_s": self.comm.stats.step_time_s(), "peak_mem_bytes": peak_mem,
            }
            tokens_per_s_sum += record["tokens_per_s"]
            last = step + 1 == tr.steps
            if last or (tr.eval_interval and (step + 1) % tr.eval_interval == 0):
                val_loss = self.evaluate()
                record["val_loss"] = val_loss
            if last or (step + 1) % tr.log_interval == 0:
                self.logger.log(record)
            if progress is not None:
                progress.update(1)
                postfix = {"loss": f"{loss:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
                if val_loss is not None:
                    postfix["val"] = f"{val_loss:.3f}"
                progress.set_postfix(postfix, refresh=False)
        if progress is not None:
            progress.close()
        summary = {
            "final_step": tr.steps, "final_loss": loss, "final_val_loss": val_loss,
            "mean_tokens_per_s": tokens_per_s_sum / tr.steps,
            "layout": {"data": self.dims.dp, "tensor": self.dims.tp, "pipeline": self.dims.pp,
                       "experts": self.dims.ep, "world_size": self.dims.world_size},
            "wall_time_s": time.perf_counter() - start_wall, "num_params": num_params,
            "flops_per_token": self.spec.flops_per_token(cfg.model),
            "device": self.device.type,
            "comm": self.comm.stats.breakdown(),
        }
        if self.rank == 0:
            write_json_atomic(self.run_dir / "summary.json", summary)
            print(f"mcpar: done: {tr.steps} steps, loss {loss:.4f}, val loss {val_loss:.4f}, "
                  f"{summary['mean_tokens_per_s']:.0f} tokens/s, "
                  f"{summary['wall_time_s']:.1f} s", flush=True)
        self.logger.close()
        return summary

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_worker(cfg: JobConfig, run_dir: Path, env: DistEnv) -> None:
    """Train as one worker of a launched job, and leave the process group cleanly."""
    trainer = Trainer(cfg, run_dir, env)
    try:
        trainer.train()
    finally:
        trainer.close()
