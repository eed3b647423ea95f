"""ParallelDims: the one object that owns the parallel degrees and the device mesh.

The mesh order is fixed: pipeline outermost (it tolerates the slowest links: only activations cross
it, point to point), then data (which holds the expert axis as a sub-axis, as in the seed's layout),
then context (its K/V ring runs every layer, but point to point and overlapped with attention),
then tensor innermost (its collectives run every layer, so its ranks must share a node). The
controllers query this object for process groups and never build their own.

Context parallelism ('cp') splits every sequence; the parameters are replicated over it exactly
as over the data axis, so their gradients are reduced over the two together: 'dp_cp' is that
combined group (one collective, not one per axis), the gradient exchange's axis (``grad_axis``).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mcpar.errors import UserError, problem

if TYPE_CHECKING:  # a plan's degrees are read without torch (`mcpar check`); groups import it
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    cp: int = 1  # context-parallel degree (every sequence split over cp ranks)
    _mesh: DeviceMesh | None = field(default=None, repr=False)
    # The data axis split by nodes (set by build_node_groups): 'dp_intra' joins the data-parallel
    # ranks of one node, 'dp_inter' the ranks at the same place on every node.
    dp_intra: int = 1
    dp_inter: int = 1
    _node_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)
    # The mesh's group per axis, looked up once: DeviceMesh.get_group costs ~70 us a call, and
    # ZeRO-3 issues several collectives per layer.
    _mesh_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict, repr=False)
    # The data axis split for experts (set by build_mesh when ep > 1): 'ep' joins ep consecutive
    # data-parallel ranks, which hold different experts and exchange tokens; 'edp' joins the
    # ranks at the same place of every expert group, which hold the same experts (replicas),
    # and, under context parallelism, the context ranks beside them, which hold them too.
    edp: int = 1
    _expert_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict,
                                                                repr=False)
    # Every rank, in a group of its own: the trainer's per-step bookkeeping runs on it while
    # the communication thread may still be exchanging on a mesh axis, and a mesh axis that
    # spans the world IS the default group (DeviceMesh reuses it), which two threads must not
    # drive at once.
    _world_group: dist.ProcessGroup | None = field(default=None, repr=False)
    # Under context parallelism: the data and context axes together (the gradients' replicas).
    _dp_cp_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp * self.cp != self.world_size:
            raise ValueError(f"dp {self.dp} x tp {self.tp} x pp {self.pp} x cp {self.cp} != "
                             f"{self.world_size}")
        if self.dp % self.ep:
            raise ValueError(f"expert degree {self.ep} does not divide data degree {self.dp}")
        self.dp_inter = self.dp
        self.edp = self.dp // self.ep * self.cp

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp, self.cp, self.tp)

    @property
    def mesh_axis_names(self) -> tuple[str, str, str, str]:
        return ("pp", "dp", "cp", "tp")

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same dense parameters: the data axis times the context axis."""
        return self.dp * self.cp

    @property
    def grad_axis(self) -> str:
        """The axis dense gradients are averaged over: 'dp', or 'dp_cp' under context
        parallelism (one collective over both axes)."""
        return "dp_cp" if self.cp > 1 else "dp"

    def describe(self) -> str:
        text = (
            f"{self.world_size} devices = tensor {self.tp} x pipeline {self.pp} x data {self.dp}"
        )
        if self.cp > 1:
            text += f" x context {self.cp}"
        if self.ep > 1:
            text += f", experts {self.ep} within the data axis ({self.dp // self.ep} expert groups)"
        return text

    def build_mesh(self, device_type: str) -> None:
        """Create the DeviceMesh once the default process group exists (world size > 1)."""
        import torch.distributed as dist

        if self.world_size == 1 or not dist.is_initialized():
            return
        from torch.distributed.device_mesh import init_device_mesh

        self._mesh = init_device_mesh(
            device_type, self.mesh_shape, mesh_dim_names=self.mesh_axis_names
        )
        self._mesh_groups = {}
        # group_desc names a group in torch's traces and logs ('undefined' without it).
        self._world_group = dist.new_group(list(range(self.world_size)),
                                           group_desc="mcpar_world")
        if self.ep > 1:
            self._build_expert_groups()
        if self.cp > 1:
            self._build_dp_cp_groups()

    def dp_cp_group_ranks(self) -> list[list[int]]:
        """Global ranks of every combined data x context group (row-major mesh order)."""
        return [[((p * self.dp + d) * self.cp + c) * self.tp + t
                 for d in range(self.dp) for c in range(self.cp)]
                for p in range(self.pp) for t in range(self.tp)]

    def _build_dp_cp_groups(self) -> None:
        import torch.distributed as dist

        me = dist.get_rank()
        # Every rank creates every group, in the same order (new_group is collective). A new
        # group even where it spans the world: the default group is driven by other threads.
        for ranks in self.dp_cp_group_ranks():
            group = dist.new_group(ranks, group_desc="mcpar_dp_cp")
            if me in ranks:
                self._dp_cp_group = group

    def expert_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """Global ranks of every 'ep' group and every 'edp' group (carved out of each
        data-parallel group: consecutive data ranks share an expert group, so that on a
        cluster filled node by node the token all-to-all stays inside a node where it can).
        An 'edp' group spans the context axis too: context ranks route their own tokens
        through the same experts, which are replicas like the data ranks' (one gradient
        reduction over both, as for the dense parameters' 'dp_cp')."""
        ep_lists = []
        for ranks in self.dp_group_ranks():
            ep_lists += [ranks[i:i + self.ep] for i in range(0, self.dp, self.ep)]
        edp_lists = [[((p * self.dp + d) * self.cp + c) * self.tp + t
                      for d in range(i, self.dp, self.ep) for c in range(self.cp)]
                     for p in range(self.pp) for t in range(self.tp) for i in range(self.ep)]
        return ep_lists, edp_lists

    def _build_expert_groups(self) -> None:
        import torch.distributed as dist

        me = dist.get_rank()
        self._expert_groups = {"ep": None, "edp": None}
        # Every rank creates every group, in the same order (new_group is collective).
        for axis, lists in zip(("ep", "edp"), self.expert_group_ranks(), strict=True):
            for ranks in lists:
                group = (dist.new_group(ranks, group_desc=f"mcpar_{axis}") if len(ranks) > 1
                         else None)
                if me in ranks:
                    self._expert_groups[axis] = group

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank along a mesh axis ('dp', 'cp', 'tp', 'pp', the data
        and context axes together 'dp_cp', the node split of the data axis 'dp_intra' /
        'dp_inter', or its expert split 'ep' / 'edp'); None if size 1."""
        if self._mesh is None or getattr(self, axis) == 1:
            return None
        if axis in ("dp_intra", "dp_inter"):
            return self._node_groups[axis]
        if axis in ("ep", "edp"):
            return self._expert_groups[axis]
        if axis == "dp_cp":
            return self._dp_cp_group
        group = self._mesh_groups.get(axis)
        if group is None:
            group = self._mesh_groups[axis] = self._mesh.get_group(axis)
        return group

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank, apart from the default group (None before build_mesh)."""
        return self._world_group

    def axis_rank(self, axis: str) -> int:
        import torch.distributed as dist

        if self._mesh is None:
            return 0
        if axis in ("dp_intra", "dp_inter"):
            group = self._node_groups.get(axis)
            return 0 if group is None else dist.get_rank(group)
        if axis in ("ep", "edp"):
            dp_rank = self._mesh.get_local_rank("dp")
            if axis == "ep":
                return dp_rank % self.ep
            return dp_rank // self.ep * self.cp + self._mesh.get_local_rank("cp")
        if axis == "dp_cp":
            return self._mesh.get_local_rank("dp") * self.cp + self._mesh.get_local_rank("cp")
        return self._mesh.get_local_rank(axis)

    def dp_group_ranks(self) -> list[list[int]]:
        """Global ranks of every data-parallel group (the mesh is row-major over
        (pp, dp, cp, tp), as init_device_mesh lays it out)."""
        return [[((p * self.dp + d) * self.cp + c) * self.tp + t for d in range(self.dp)]
                for p in range(self.pp) for c in range(self.cp) for t in range(self.tp)]

    def build_node_groups(self, node_of_rank: list[int]) -> None:
        """Split every data-parallel group by node, for hierarchical collectives.

        Every rank calls this with the same `node_of_rank` (global rank -> node index), because
        creating a process group is a collective over the world.
        """
        import torch.distributed as dist

        self.dp_intra, intra_lists, inter_lists = split_dp_by_node(self, node_of_rank)
        self.dp_inter = self.dp // self.dp_intra
        me = dist.get_rank() if dist.is_initialized() else 0
        self._node_groups = {"dp_intra": None, "dp_inter": None}
        if not dist.is_initialized():
            return
        # Every rank creates every group, in the same order (new_group is collective).
        for axis, lists, size in (("dp_intra", intra_lists, self.dp_intra),
                                  ("dp_inter", inter_lists, self.dp_inter)):
            for ranks in lists:
                group = dist.new_group(ranks, group_desc=f"mcpar_{axis}") if size > 1 else None
                if me in ranks:
                    self._node_groups[axis] = group


def replica_ranks(tp: int, pp: int, cp: int) -> int:
    """Ranks one data-parallel replica spans (the world size per data rank): what a world
    size must divide by when the data degree is left to the world."""
    return tp * pp * cp


def split_dp_by_node(dims: ParallelDims,
                     node_of_rank: list[int]) -> tuple[int, list[list[int]], list[list[int]]]:
    """(data-parallel ranks per node, intra-node rank lists, inter-node rank lists). Each node
    must hold the same number of ranks of every data-parallel group; UserError otherwise."""
    intra_lists: list[list[int]] = []
    inter_lists: list[list[int]] = []
    per_node_sizes: set[int] = set()
    for ranks in dims.dp_group_ranks():
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(node_of_rank[r], []).append(r)
        sizes = {len(v) for v in by_node.values()}
        per_node_sizes |= sizes
        members = list(by_node.values())
        if len(sizes) != 1:
            raise UserError([problem(
                "cluster.ranks_per_node",
                f"the data-parallel group {ranks} is spread unevenly over nodes "
                f"({ {n: len(v) for n, v in by_node.items()} }); hierarchical collectives "
                "need the same number of its ranks on every node: use topology 'flat' or "
                "a world size that fills whole nodes",
            )])
        intra_lists += members
        inter_lists += [list(col) for col in zip(*members, strict=True)]
    if len(per_node_sizes) != 1:
        raise UserError([problem("cluster.ranks_per_node",
                                 "nodes hold different numbers of data-parallel ranks")])
    return per_node_sizes.pop(), intra_lists, inter_lists


def node_key() -> str:
    """What names this process's node: MCPAR_NODE if set, then torchrun's GROUP_RANK, then
    SLURM_NODEID, then the hostname. (Network namespaces share the hostname, so an emulated
    cluster relies on GROUP_RANK or MCPAR_NODE.)"""
    for var in ("MCPAR_NODE", "GROUP_RANK", "SLURM_NODEID"):
        value = os.environ.get(var)
        if value:
            return f"{var}={value}"
    return f"host={socket.gethostname()}"


def detect_node_of_rank(ranks_per_node: int | None) -> list[int]:
    """Node index of every global rank, the same list on every rank: from
    ``cluster.ranks_per_node`` when given (consecutive ranks share a node), else from each
    rank's ``node_key`` gathered over the world (nodes numbered by first appearance)."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_initialized() else 1
    if ranks_per_node is not None:
        if world % ranks_per_node:
            raise UserError([problem(
                "cluster.ranks_per_node",
                f"{world} ranks do not fill nodes of {ranks_per_node}; use a divisor of {world}",
            )])
        return [r // ranks_per_node for r in range(world)]
    if world == 1:
        return [0]
    keys: list[str] = [""] * world
    dist.all_gather_object(keys, node_key())
    index: dict[str, int] = {}
    return [index.setdefault(k, len(index)) for k in keys]
