"""The MemoryController's planned parameter store (ZeRO-3) and optimizer-state offload: what
``plan_memory`` decides, as data, apart from the runtime each builds (``param_store.py``,
``offload.py``, which need torch), so that a job's plan is made without torch."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mcpar.sim.memory import gather_span

if TYPE_CHECKING:
    import torch
    from torch import nn

    from mcpar.controllers.communication.controller import CommunicationController
    from mcpar.controllers.communication.grad_sync import DataParallelGradSync, ShardSpec
    from mcpar.controllers.memory.offload import OffloadSpec
    from mcpar.controllers.memory.param_store import ParameterStore


@dataclass(frozen=True)
class StorePlan:
    """ZeRO-3's planned parameter store."""

    gather_mb: float  # one parameter gather holds at least this much of consecutive blocks
    node_cache: bool  # the hierarchical store (``allocation: topology_aware``)
    weight_codec: str  # what the parameter gathers carry: 'none' or 'int8'
    grad_codec: str  # the hierarchical store's inter-node gradient codec ('none' without it)
    ranks_per_node: int | None  # the cluster's, for the store's two levels (None: detected)

    def build(self, comm: CommunicationController, chunks: list[nn.Module], shards: ShardSpec,
              bucket_size_mb: float, overlap: bool, reduce_every_backward: bool = True,
              ) -> tuple[DataParallelGradSync, ParameterStore, str]:
        """Stage 3's gradient sync (one bucket per layer and kind; reduced after every backward
        or once per step, as the plan says) and parameter store, and a line for the start-up
        log saying what runs."""
        from mcpar.controllers.communication.grad_sync import DataParallelGradSync
        from mcpar.controllers.memory.param_store import ParameterStore, unit_groups
        from mcpar.topology import detect_node_of_rank

        if self.node_cache:
            # The store's two levels are the data axis split by node (as hierarchical
            # all-reduce).
            comm.dims.build_node_groups(detect_node_of_rank(self.ranks_per_node))
        names, groups, unit_of_group = unit_groups(chunks)
        # The largest block's full parameters (blocks alike but for experts), and a chunk's
        # blocks.
        blocks = [g for g, u in zip(groups, unit_of_group, strict=True) if ".block" in names[u]]
        block_bytes = max((sum(p.numel() * p.element_size() for p in g) for g in blocks),
                          default=0)
        span = gather_span(block_bytes, self.gather_mb, max(1, len(names) // len(chunks) - 1))
        sync = DataParallelGradSync([p for g in groups for p in g], bucket_size_mb,
                                    overlap=overlap, shards=shards, release_grads=True,
                                    groups=groups,
                                    reduce_every_backward=reduce_every_backward)
        store = ParameterStore(comm, chunks, sync.buckets, names, unit_of_group,
                               node_cache=self.node_cache, weight_codec=self.weight_codec,
                               grad_codec=self.grad_codec, span=span)
        per_gather = ("per layer" if span == 1 else
                      f"{span} blocks per gather ({span * block_bytes / 2**20:.2f} MiB, "
                      f"controllers.memory.gather_mb {self.gather_mb:g})")
        axis = shards[0][0]
        text = (f"memory: ZeRO stage 3, {len(names)} units gathered {per_gather} over "
                f"{comm.axis_size(axis)} " + ("data x context" if axis == "dp_cp" else
                                              "data-parallel") + " ranks")
        if self.node_cache:
            text += (f"; hierarchical parameter store: {comm.dims.dp_inter} node(s) x "
                     f"{comm.dims.dp_intra} rank(s), backward gathers inside the node, "
                     f"gradients reduced inside then across nodes ({self.grad_codec} across)")
        if self.weight_codec != "none":
            text += f"; {self.weight_codec} weight gathers"
        return sync, store, text


@dataclass(frozen=True)
class OffloadPlan:
    """The MemoryController's planned optimizer-state offload."""

    target: str  # 'none', 'cpu' or 'nvme'
    folder: str | None  # nvme: where the state files go (None: <run dir>/offload)
    buffer_bytes: int  # one streaming group
    masters: bool  # the fp32 master weights are offloaded too (the model trains on bf16 copies)

    def build(self, params: list[torch.nn.Parameter], run_dir: Path, rank: int,
              device: torch.device) -> OffloadSpec | None:
        """The offload (None without). With bf16 master weights, the store is filled from the
        fp32 parameters here and the parameters become bf16 copies, one at a time (so that no
        second full copy is ever resident): build it before the gradient buffers exist."""
        if self.target == "none":
            return None
        import torch

        from mcpar.controllers.memory.offload import OffloadSpec

        folder = Path(self.folder) if self.folder else run_dir / "offload"
        spec = OffloadSpec(self.target, folder / f"rank{rank}.state" if self.target == "nvme"
                           else None, self.buffer_bytes, self.masters, device)
        if spec.masters:
            unique = list({id(p): p for p in params if p.requires_grad}.values())
            spec.build(unique)
            with torch.no_grad():
                for p in unique:
                    p.data = p.data.to(torch.bfloat16)
        return spec
