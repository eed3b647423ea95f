"""ParallelDims: the one object that owns the parallel degrees and the device mesh.

The mesh order is fixed: pipeline outermost (it tolerates the slowest links: only activations cross
it, point to point), then data (which holds the expert axis as a sub-axis, as in the seed's layout),
then tensor innermost (its collectives run every layer, so its ranks must share a node). The
controllers query this object for process groups and never build their own.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch.distributed as dist

from mcpar.config import JobConfig
from mcpar.errors import UserError, problem


@dataclass
class ParallelDims:
    dp: int
    tp: int
    pp: int
    ep: int
    world_size: int
    _mesh: object | None = field(default=None, repr=False)
    # The data axis split by nodes (set by build_node_groups): 'dp_intra' joins the data-parallel
    # ranks of one node, 'dp_inter' the ranks at the same place on every node.
    dp_intra: int = 1
    dp_inter: int = 1
    _node_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict, repr=False)
    # The data axis split for experts (set by build_mesh when ep > 1): 'ep' joins ep consecutive
    # data-parallel ranks, which hold different experts and exchange tokens; 'edp' joins the
    # ranks at the same place of every expert group, which hold the same experts (replicas).
    edp: int = 1
    _expert_groups: dict[str, dist.ProcessGroup | None] = field(default_factory=dict,
                                                                repr=False)
    # Every rank, in a group of its own: the trainer's per-step bookkeeping runs on it while
    # the communication thread may still be exchanging on a mesh axis, and a mesh axis that
    # spans the world IS the default group (DeviceMesh reuses it), which two threads must not
    # drive at once.
    _world_group: dist.ProcessGroup | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.dp * self.tp * self.pp != self.world_size:
            raise ValueError(f"dp {self.dp} x tp {self.tp} x pp {self.pp} != {self.world_size}")
        if self.dp % self.ep:
            raise ValueError(f"expert degree {self.ep} does not divide data degree {self.dp}")
        self.dp_inter = self.dp
        self.edp = self.dp // self.ep

    @property
    def mesh_shape(self) -> tuple[int, int, int]:
        return (self.pp, self.dp, self.tp)

    @property
    def mesh_axis_names(self) -> tuple[str, str, str]:
        return ("pp", "dp", "tp")

    def describe(self) -> str:
        text = (
            f"{self.world_size} devices = tensor {self.tp} x pipeline {self.pp} x data {self.dp}"
        )
        if self.ep > 1:
            text += f", experts {self.ep} within the data axis ({self.dp // self.ep} expert groups)"
        return text

    def build_mesh(self, device_type: str) -> None:
        """Create the DeviceMesh once the default process group exists (world size > 1)."""
        if self.world_size == 1 or not dist.is_initialized():
            return
        from torch.distributed.device_mesh import init_device_mesh

        self._mesh = init_device_mesh(
            device_type, self.mesh_shape, mesh_dim_names=self.mesh_axis_names
        )
        self._world_group = dist.new_group(list(range(self.world_size)))
        if self.ep > 1:
            self._build_expert_groups()

    def expert_group_ranks(self) -> tuple[list[list[int]], list[list[int]]]:
        """Global ranks of every 'ep' group and every 'edp' group (carved out of each
        data-parallel group: consecutive data ranks share an expert group, so that on a
        cluster filled node by node the token all-to-all stays inside a node where it can)."""
        ep_lists, edp_lists = [], []
        for ranks in self.dp_group_ranks():
            ep_lists += [ranks[i:i + self.ep] for i in range(0, self.dp, self.ep)]
            edp_lists += [ranks[i::self.ep] for i in range(self.ep)]
        return ep_lists, edp_lists

    def _build_expert_groups(self) -> None:
        me = dist.get_rank()
        self._expert_groups = {"ep": None, "edp": None}
        # Every rank creates every group, in the same order (new_group is collective).
        for axis, lists in zip(("ep", "edp"), self.expert_group_ranks(), strict=True):
            for ranks in lists:
                group = dist.new_group(ranks) if len(ranks) > 1 else None
                if me in ranks:
                    self._expert_groups[axis] = group

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank along a mesh axis ('dp', 'tp', 'pp', the node split
        of the data axis 'dp_intra' / 'dp_inter', or its expert split 'ep' / 'edp'); None if
        size 1."""
        if self._mesh is None or getattr(self, axis) == 1:
            return None
        if axis in ("dp_intra", "dp_inter"):
            return self._node_groups[axis]
        if axis in ("ep", "edp"):
            return self._expert_groups[axis]
        return self._mesh.get_group(axis)  # type: ignore[attr-defined]

    @property
    def world_group(self) -> dist.ProcessGroup | None:
        """Every rank, apart from the default group (None before build_mesh)."""
        return self._world_group

    def axis_rank(self, axis: str) -> int:
        if self._mesh is None:
            return 0
        if axis in ("dp_intra", "dp_inter"):
            group = self._node_groups.get(axis)
            return 0 if group is None else dist.get_rank(group)
        if axis in ("ep", "edp"):
            dp_rank = self._mesh.get_local_rank("dp")  # type: ignore[attr-defined]
            return dp_rank % self.ep if axis == "ep" else dp_rank // self.ep
        return self._mesh.get_local_rank(axis)  # type: ignore[attr-defined]

    def dp_group_ranks(self) -> list[list[int]]:
        """Global ranks of every data-parallel group (the mesh is row-major over
        (pp, dp, tp), as init_device_mesh lays it out)."""
        return [[(p * self.dp + d) * self.tp + t for d in range(self.dp)]
                for p in range(self.pp) for t in range(self.tp)]

    def build_node_groups(self, node_of_rank: list[int]) -> None:
        """Split every data-parallel group by node, for hierarchical collectives.

        Every rank calls this with the same `node_of_rank` (global rank -> node index), because
        creating a process group is a collective over the world.
        """
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
                group = dist.new_group(ranks) if size > 1 else None
                if me in ranks:
                    self._node_groups[axis] = group


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


def resolve_layout(cfg: JobConfig, world_size: int | None) -> ParallelDims:
    """Check the layout against the model and the world size and fill the derived values.

    Fills ``parallelism.data`` (from the world size when unset) and
    ``optimization.gradient_accumulation`` (from ``global_batch_size`` when given). With
    ``world_size=None`` (``mcpar check``) the world size is what the degrees multiply to.
    Raises UserError listing every problem found.
    """
    par, model, opt = cfg.parallelism, cfg.model, cfg.optimization
    problems: list[str] = []
    tp, pp = par.tensor, par.pipeline
    dp = par.data
    if dp is None:
        if world_size is None:
            dp = 1
        elif world_size % (tp * pp):
            problems.append(problem(
                "parallelism.data",
                f"{world_size} workers cannot be split into tensor {tp} x pipeline {pp} groups; "
                f"use a world size divisible by {tp * pp}",
            ))
            dp = 1
        else:
            dp = world_size // (tp * pp)
    if world_size is not None and dp * tp * pp != world_size:
        problems.append(problem(
            "parallelism",
            f"the layout needs data {dp} x tensor {tp} x pipeline {pp} = {dp * tp * pp} devices, "
            f"but the job has {world_size}; change the degrees or the number of workers",
        ))
    if model.hidden_size % model.num_heads:
        problems.append(problem(
            "model.num_heads",
            f"{model.num_heads} heads do not divide hidden_size {model.hidden_size}",
        ))
    if model.num_heads % tp:
        problems.append(problem(
            "model.num_heads",
            f"{model.num_heads} heads are not divisible by parallelism.tensor {tp}",
        ))
    if model.ffn_size % tp:
        problems.append(problem(
            "model.ffn_hidden_size",
            f"{model.ffn_size} is not divisible by parallelism.tensor {tp}",
        ))
    if model.vocab_size % tp:
        problems.append(problem(
            "model.vocab_size",
            f"{model.vocab_size} is not divisible by parallelism.tensor {tp} (the vocabulary "
            "is split over tensor ranks)",
        ))
    if par.sequence_parallel and tp == 1:
        problems.append(problem(
            "parallelism.sequence_parallel",
            "shards the sequence over tensor ranks; it needs parallelism.tensor > 1",
        ))
    if par.sequence_parallel and model.seq_len % tp:
        problems.append(problem(
            "model.seq_len",
            f"{model.seq_len} is not divisible by parallelism.tensor {tp} "
            "(sequence parallelism splits it)",
        ))
    if model.num_layers < pp * par.virtual_stages:
        problems.append(problem(
            "model.num_layers",
            f"{model.num_layers} layers cannot fill pipeline {pp} x virtual_stages "
            f"{par.virtual_stages} stages; a stage would be empty",
        ))
    if model.tie_embeddings and pp > 1:
        problems.append(problem(
            "model.tie_embeddings",
            "a tied embedding cannot be split between the first and last pipeline stages; "
            "set it to false or use parallelism.pipeline 1",
        ))
    if dp % par.experts:
        problems.append(problem(
            "parallelism.experts",
            f"expert degree {par.experts} does not divide the data degree {dp} (the expert "
            f"axis is carved out of the data axis); use a divisor of {dp}",
        ))
    if model.kind == "moe" and par.sequence_parallel:
        problems.append(problem(
            "parallelism.sequence_parallel",
            "is not supported with model.kind 'moe' (the router needs every token of the "
            "sequence on each tensor rank); set it to false",
        ))
    if model.kind == "moe":
        if model.num_experts % par.experts:
            problems.append(problem(
                "model.num_experts",
                f"{model.num_experts} experts are not divisible by parallelism.experts "
                f"{par.experts}",
            ))
        if model.top_k > model.num_experts:
            problems.append(problem(
                "model.top_k",
                f"top_k {model.top_k} is larger than num_experts {model.num_experts}; use at "
                f"most {model.num_experts}",
            ))
    problems += communication_problems(cfg, dp)
    accum = opt.gradient_accumulation
    if opt.global_batch_size is not None:
        per_micro = opt.micro_batch_size * dp
        if opt.global_batch_size % per_micro:
            problems.append(problem(
                "optimization.global_batch_size",
                f"{opt.global_batch_size} is not divisible by micro_batch_size "
                f"{opt.micro_batch_size} x data {dp} = {per_micro}",
            ))
        elif accum is not None and accum * per_micro != opt.global_batch_size:
            problems.append(problem(
                "optimization.gradient_accumulation",
                f"{accum} x micro_batch_size {opt.micro_batch_size} x data {dp} != "
                f"global_batch_size {opt.global_batch_size}; set one of them only",
            ))
        else:
            accum = opt.global_batch_size // per_micro
    rpn = cfg.cluster.ranks_per_node
    if (rpn is not None and world_size is not None and not problems
            and cfg.controllers.communication.topology != "flat"):
        if world_size % rpn:
            problems.append(problem(
                "cluster.ranks_per_node",
                f"{world_size} ranks do not fill nodes of {rpn}; use a divisor of {world_size}",
            ))
        else:
            try:
                split_dp_by_node(ParallelDims(dp=dp, tp=tp, pp=pp, ep=par.experts,
                                              world_size=world_size),
                                 [r // rpn for r in range(world_size)])
            except UserError as err:
                problems += err.problems
    if problems:
        raise UserError(problems)
    par.data = dp
    opt.gradient_accumulation = accum or 1
    opt.global_batch_size = opt.micro_batch_size * opt.gradient_accumulation * dp
    return ParallelDims(dp=dp, tp=tp, pp=pp, ep=par.experts, world_size=dp * tp * pp)


def uses_onebit_adam(cfg: JobConfig) -> bool:
    """1-bit Adam runs when either key asks for it: it is AdamW whose momentum is exchanged
    in 1 bit past the freeze step."""
    return (cfg.controllers.communication.compression == "1bit"
            or cfg.optimization.optimizer == "onebit_adam")


def communication_problems(cfg: JobConfig, dp: int) -> list[str]:
    """Combinations of compression, optimizer, topology and layout that cannot work."""
    comm, opt, cluster = cfg.controllers.communication, cfg.optimization, cfg.cluster
    problems: list[str] = []
    if opt.optimizer == "onebit_adam" and comm.compression not in ("none", "1bit"):
        problems.append(problem(
            "controllers.communication.compression",
            f"{comm.compression!r} cannot be combined with optimization.optimizer "
            "'onebit_adam', which compresses the momentum in 1 bit itself; use compression "
            "'1bit' or optimizer 'adamw'",
        ))
    if (comm.compression != "none" or opt.optimizer == "onebit_adam") and dp == 1:
        key = ("controllers.communication.compression" if comm.compression != "none"
               else "optimization.optimizer")
        problems.append(problem(
            key, "compression acts on the data-parallel exchange, and this layout has data 1; "
            "use more data-parallel ranks or compression 'none' / optimizer 'adamw'",
        ))
    if uses_onebit_adam(cfg):
        if opt.freeze_step >= cfg.training.steps:
            problems.append(problem(
                "optimization.freeze_step",
                f"{opt.freeze_step} is not below training.steps {cfg.training.steps}: 1-bit "
                "Adam would never compress; use about 15-25% of the steps",
            ))
        if cfg.controllers.memory.zero_stage > 0:
            problems.append(problem(
                "controllers.memory.zero_stage",
                "1-bit Adam needs the whole momentum on every data-parallel rank and cannot "
                "shard optimizer state; use zero_stage 0",
            ))
    if comm.compression == "powersgd" and comm.powersgd_start_step >= cfg.training.steps:
        problems.append(problem(
            "controllers.communication.powersgd_start_step",
            f"{comm.powersgd_start_step} is not below training.steps {cfg.training.steps}: "
            "PowerSGD would never compress",
        ))
    link = [cluster.intra_node_bandwidth_gbps, cluster.intra_node_latency_us,
            cluster.inter_node_bandwidth_gbps, cluster.inter_node_latency_us]
    if any(v is not None for v in link) and any(v is None for v in link):
        problems.append(problem(
            "cluster", "give all four of intra/inter_node_bandwidth_gbps and "
            "intra/inter_node_latency_us, or none (they are then measured)",
        ))
    return problems
