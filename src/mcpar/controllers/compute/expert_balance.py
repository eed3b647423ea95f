"""The MoE side of a training step: routing statistics, bias balancing and expert migration.

After every optimizer step (inside the step, so its cost is in the step time):
1. each rank's MoE layers report the tokens they routed to each expert over the step's
   micro-batches; the counts are summed over the data axis (the global batch) and over the
   pipeline axis (every stage's layers), so every rank holds the same [layers, experts] table;
2. auxiliary-loss-free balancing (DeepSeek-V3): each expert's selection bias moves by
   ``router_bias_update_rate`` times the sign of (mean load - its load);
3. what the step's expert phase cost is measured (``controllers.compute.balance_costs:
   measured``, the default): each rank's expert compute time (its ``ShardedExperts`` time the
   experts' forward; the backward, about twice as long, is as unbalanced and is not timed
   apart), its expert all-to-all time (the Communicator's books, op ``all_to_all``
   on axis 'ep') and the wall time of the previous step's migrations; one all-reduce over
   'dp', 'pp' and 'tp' gives every rank the same per-expert-rank times, from which the wait on
   the slowest rank (max - mean) and the seconds per routed assignment follow (``StepCosts``);
4. the ComputeController's load balancer (controllers/load_balance.py) observes the table and
   the costs and may swap experts between expert-axis ranks; every rank runs the same
   deterministic balancer on the same numbers, so all take the same decision without a message,
   and the ranks involved exchange the experts' weights and optimizer state through the
   CommunicationController;
5. the step's routing metrics: per layer, tokens per expert (min/max/std), imbalance = max/mean
   tokens per expert-axis rank, dropped tokens; experts migrated; the measured step costs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from mcpar.comm.communicator import Communicator
from mcpar.config import JobConfig
from mcpar.controllers.compute.balance_plan import BalancePlan
from mcpar.controllers.compute.load_balance import (
    ExpertLoadBalancer,
    StepCosts,
    imbalance,
    rank_loads,
)
from mcpar.models.moe import MoELayer
from mcpar.models.spec import get_model_spec
from mcpar.parallel.expert import ShardedExperts, swap_expert_slots
from mcpar.topology import ParallelDims

BALANCER_PREFIX = "balancer/"


class MoERoutingController:
    def __init__(self, cfg: JobConfig, balance: BalancePlan, num_microbatches: int,
                 dims: ParallelDims, comm: Communicator,
                 chunks: list[torch.nn.Module], optimizer: torch.optim.Optimizer,
                 run_dir: Path | None, is_main: bool):
        """``balance``: the ComputeController's planned balancing; ``num_microbatches``: the
        plan's (the auxiliary loss is scaled by it)."""
        model = cfg.model
        self.comm, self.optimizer, self.dims = comm, optimizer, dims
        self.num_layers, self.num_experts = model.num_layers, model.num_experts
        self.bias_rate = model.router_bias_update_rate
        # Global layer index -> this rank's MoE layer (a pipeline stage holds some of them); the
        # model's spec says where a block's MoE layer is.
        self.layers: dict[int, MoELayer] = {}
        expert_plan = get_model_spec(model.kind).expert_parallel
        for chunk in chunks:
            for i, block in enumerate(chunk.pieces()[1] if expert_plan is not None else []):
                found = expert_plan.layers(block)
                if len(found) > 1:
                    raise ValueError(f"block {chunk.first_layer + i} has {len(found)} MoE "
                                     "layers; the routing table holds one per block")
                if found:
                    self.layers[chunk.first_layer + i] = found[0]
        num_micro = num_microbatches
        for layer in self.layers.values():
            # The language-model loss of a micro-batch is divided by the number of
            # micro-batches before backward; the auxiliary loss must be too.
            layer.aux_grad_scale = 1.0 / num_micro
            layer.reset_step_stats()  # forward passes before training (measurements) don't count
        self.measured = balance.costs == "measured"
        self._migration_s = 0.0  # wall time of the last step's migrations, on this rank
        self.balancer: ExpertLoadBalancer | None = None
        if dims.ep > 1 and balance.scheduler != "static":
            self.balancer = ExpertLoadBalancer(
                balance.scheduler, model.num_layers, model.num_experts, dims.ep,
                interval=balance.interval, migration_cost=balance.migration_cost,
                seed=cfg.training.seed)
        self.migrations_total = 0
        self.decision_log = (run_dir / "load_balance.jsonl"
                             if is_main and run_dir is not None and self.balancer else None)
        self._logged_decisions = 0

    def placement(self) -> np.ndarray:
        """[layers, experts] expert of each slot (identity without expert parallelism)."""
        if self.balancer is not None:
            return self.balancer.expert_of_slot.copy()
        return np.tile(np.arange(self.num_experts), (self.num_layers, 1))

    def _gather_counts(self) -> tuple[np.ndarray, np.ndarray]:
        counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.int64)
        dropped = torch.zeros(self.num_layers, dtype=torch.int64)
        for index, layer in self.layers.items():
            counts[index] = layer.step_counts.cpu()
            dropped[index] = layer.step_dropped.cpu()
        table = torch.cat([counts, dropped.unsqueeze(1)], dim=1)
        self.comm.all_reduce(table, axis="dp")
        self.comm.all_reduce(table, axis="pp")
        if self.dims.cp > 1:  # context ranks route other tokens of the same sequences
            self.comm.all_reduce(table, axis="cp")
        return table[:, :-1].numpy(), table[:, -1].numpy()

    def after_step(self, step: int) -> dict[str, object]:
        """Balance and report; returns the step's MoE metrics."""
        counts, dropped = self._gather_counts()
        if self.bias_rate > 0:
            for index, layer in self.layers.items():
                load = torch.from_numpy(counts[index]).double()
                error = torch.sign(load.mean() - load).float()
                layer.router.expert_bias += self.bias_rate * error.to(
                    layer.router.expert_bias.device)
        moved = 0
        costs: StepCosts | None = None
        if self.balancer is not None:
            costs = self._measure(counts) if self.measured else None
            swaps = self.balancer.observe(step, counts, costs)
            costs = self.balancer.last_costs
            start = time.perf_counter()
            for tag, swap in enumerate(swaps):
                layer = self.layers.get(swap.layer)
                if layer is not None:
                    assert isinstance(layer.experts, ShardedExperts)
                    swap_expert_slots(layer.experts, self.optimizer, swap.slot_a, swap.slot_b,
                                      tag=tag)
            self._migration_s = time.perf_counter() - start
            moved = 2 * len(swaps)
            self.migrations_total += moved
            self._log_decisions()
        for layer in self.layers.values():
            layer.reset_step_stats()
        metrics = self._metrics(counts, dropped, moved)
        if costs is not None:
            metrics["step_costs"] = asdict(costs)
        return metrics

    def _measure(self, counts: np.ndarray) -> StepCosts:
        """This step's expert-phase costs, the same on every rank (see the module docstring)."""
        dims, ep = self.dims, self.dims.ep
        table = torch.zeros(2 * ep + 1, dtype=torch.float64)
        me = dims.axis_rank("ep")
        for layer in self.layers.values():
            assert isinstance(layer.experts, ShardedExperts)
            table[me] += layer.experts.compute_s
            layer.experts.compute_s = 0.0
        table[ep + me] = self._migration_s
        table[2 * ep] = sum(float(row["time_s"]) for row in self.comm.stats.breakdown("step")
                            if row["op"] == "all_to_all" and row["axis"] == "ep")
        for axis in ("dp", "cp", "pp", "tp"):
            if self.comm.axis_size(axis) > 1:
                self.comm.all_reduce(table, axis=axis)
        # Entry r summed the edp replicas (data and context) x tp ranks of expert rank r (x the
        # pipeline stages, whose expert times add up); the all-to-all entry summed every rank.
        per_rank = table[:2 * ep].numpy().reshape(2, ep) / (dims.edp * dims.tp)
        compute_s, migration_s = per_rank
        assert self.balancer is not None
        loads = rank_loads(counts, self.balancer.expert_of_slot, ep).sum(axis=0)
        rate = float(compute_s.sum() / loads.sum()) if loads.sum() > 0 else 0.0
        # Every rank waits for the slowest, in the expert phase and for the migrating pair.
        return StepCosts(rate, float(compute_s.max() - compute_s.mean()),
                         float(table[2 * ep]) / (dims.dp * dims.cp * dims.tp),
                         float(migration_s.max()),
                         self.balancer.experts_moved_last_step)

    def _metrics(self, counts: np.ndarray, dropped: np.ndarray, moved: int) -> dict[str, object]:
        per_layer = []
        rank_imbalance = imbalance(counts, self.placement(), self.dims.ep)
        for index in range(self.num_layers):
            load = counts[index].astype(np.float64)
            per_layer.append({
                "min": int(load.min()), "max": int(load.max()), "std": float(load.std()),
                "imbalance": float(rank_imbalance[index]), "dropped": int(dropped[index]),
                "tokens_per_expert": [int(v) for v in counts[index]],
            })
        mean_load = counts.mean(axis=1, keepdims=True).clip(min=1e-9)
        return {
            "layers": per_layer,
            "imbalance": float(rank_imbalance.mean()),
            "max_expert_load_ratio": float((counts / mean_load).max()),
            "dropped_tokens": int(dropped.sum()),
            "migrations": moved,
            "migrations_total": self.migrations_total,
        }

    def _log_decisions(self) -> None:
        assert self.balancer is not None
        new = self.balancer.decisions[self._logged_decisions:]
        self._logged_decisions = len(self.balancer.decisions)
        if self.decision_log is not None and new:
            with self.decision_log.open("a") as out:
                for record in new:
                    out.write(json.dumps(record) + "\n")

    # --- checkpoint: the balancer's state (the same on every rank) ------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"moe/migrations_total": torch.tensor([self.migrations_total])}
        if self.balancer is not None:
            for name, tensor in self.balancer.state_tensors().items():
                out[BALANCER_PREFIX + name] = tensor
        return out

    def reshard(self, read_rank: Callable[[int], dict[str, torch.Tensor]], old_world: int,
                same_model: bool, same_experts: bool) -> list[str]:
        """The balancer's state across a layout change that keeps the expert degree (its tables
        are per slot of that degree's layout, and the experts stay in their saved slots): rank
        0's copy, the same on every rank. Another degree: nothing (it restarts)."""
        if not same_experts or self.balancer is None:
            return []
        self.load(read_rank(0))
        return ["load_balancer"]

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        if "moe/migrations_total" in tensors:
            self.migrations_total = int(tensors["moe/migrations_total"].item())
        if self.balancer is not None:
            self.balancer.load_state_tensors({
                name[len(BALANCER_PREFIX):]: value for name, value in tensors.items()
                if name.startswith(BALANCER_PREFIX)})
            self._logged_decisions = len(self.balancer.decisions)
