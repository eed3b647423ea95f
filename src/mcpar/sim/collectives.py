"""Collective costs from the alpha-beta model of each algorithm: mcpar's one link model, priced
by the simulator and by the runtime's ``hybrid`` choice (``mcpar.comm.collectives``) alike. The
formulas and how a group's links are chosen: docs/cost_model.md ("Communication, α-β per
algorithm").

Notation (Thakur, Rabenseifner & Gropp 2005): p ranks, n bytes per rank (for an all-gather the
gathered size, for an all-to-all what a rank sends), alpha seconds per message step, beta
seconds per byte. The reduction's arithmetic is left out: on GPUs it runs at memory speed, far
above any link's. A ``Group`` is ``size`` ranks, ``per_node`` of them in each node. The
hierarchical all-reduce sends as many inter-node bytes per NIC as a well-formed flat ring; it
wins on latency (2(N-1) inter-node steps instead of 2(p-1)) and is where compression of only
the inter-node stage plugs in.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mcpar.sim.hardware import Cluster


@dataclass(frozen=True)
class Link:
    alpha: float  # seconds per message step
    bandwidth: float  # bytes/s per rank per direction, as a collective sustains it

    def beta(self) -> float:
        return 1.0 / self.bandwidth


@dataclass(frozen=True)
class Group:
    """`size` ranks whose neighbours are `stride` global ranks apart (mesh order: tp innermost)."""

    size: int
    stride: int

    def per_node(self, gpus_per_node: int) -> int:
        if self.stride >= gpus_per_node:
            return 1
        return max(1, min(self.size, gpus_per_node // self.stride))

    def nodes(self, gpus_per_node: int) -> int:
        return -(-self.size // self.per_node(gpus_per_node))


def intra_link(cluster: Cluster, net_eff: float) -> Link:
    return Link(cluster.alpha_intra, cluster.accel.intra_bw * net_eff)


def inter_link(cluster: Cluster, net_eff: float, nics: int = 1) -> Link:
    return Link(cluster.alpha_inter, cluster.inter_bw * nics * net_eff)


def group_link(group: Group, cluster: Cluster, net_eff: float) -> Link:
    """The link that bounds a flat collective over `group`."""
    k = group.per_node(cluster.gpus_per_node)
    if group.nodes(cluster.gpus_per_node) == 1:
        return intra_link(cluster, net_eff)
    nic = inter_link(cluster, net_eff, nics=k)
    # Intra-node hops of the same ring run on NVLink; the node's NICs are the bottleneck unless
    # they together outrun one GPU's NVLink.
    bw = min(nic.bandwidth, cluster.accel.intra_bw * net_eff) if k > 1 else nic.bandwidth
    return Link(cluster.alpha_inter, bw)


def ring_reduce_scatter(n: float, p: int, link: Link) -> float:
    if p <= 1 or n <= 0:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * n * link.beta()


def ring_all_gather(n: float, p: int, link: Link) -> float:
    """`n` is the size of the gathered (full) buffer."""
    return ring_reduce_scatter(n, p, link)


def ring_all_reduce(n: float, p: int, link: Link) -> float:
    if p <= 1 or n <= 0:
        return 0.0
    return 2 * (p - 1) * link.alpha + 2 * (p - 1) / p * n * link.beta()


def pairwise_all_to_all(n: float, p: int, link: Link) -> float:
    """`n`: bytes one rank sends in total (its own block included)."""
    if p <= 1 or n <= 0:
        return 0.0
    return (p - 1) * link.alpha + (p - 1) / p * n * link.beta()


def point_to_point(n: float, link: Link) -> float:
    return link.alpha + n * link.beta() if n > 0 else 0.0


@dataclass(frozen=True)
class Phases:
    """A collective split into its intra-node and inter-node parts (seconds)."""

    intra: float
    inter: float

    @property
    def total(self) -> float:
        return self.intra + self.inter


def two_level_all_reduce(n: float, per_node: int, nodes: int, intra: Link, inter: Link,
                         inter_bytes_factor: float = 1.0) -> Phases:
    """Hierarchical all-reduce of `n` bytes over `nodes` nodes of `per_node` ranks: ring
    reduce-scatter inside the node, ring all-reduce of each 1/per_node shard across the nodes
    (the per_node shard rings run at once, each on the `inter` link it gets), ring all-gather
    inside the node. `inter_bytes_factor` scales the inter-node bytes only (compression of
    that stage). The runtime's hybrid choice (``mcpar.comm.collectives``) prices with this too."""
    local = ring_reduce_scatter(n, per_node, intra) + ring_all_gather(n, per_node, intra)
    remote = ring_all_reduce(n / per_node * inter_bytes_factor, nodes, inter)
    return Phases(local, remote)


def fit_ring_link(small_time_s: float, small_bytes: float, large_time_s: float,
                  large_bytes: float, num_ranks: int) -> Link:
    """The link of two timed ring all-reduces over `num_ranks` ranks: ``ring_all_reduce``
    solved for alpha and bandwidth (T = 2 (p-1) alpha + 2 (p-1)/p n / bandwidth)."""
    steps = 2 * (num_ranks - 1)
    per_step_small = small_time_s / steps
    per_step_large = large_time_s / steps
    slope = (per_step_large - per_step_small) / ((large_bytes - small_bytes) / num_ranks)
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    alpha = max(0.0, per_step_small - small_bytes / num_ranks / bandwidth)
    return Link(alpha, bandwidth)


def measured(cluster: Cluster, op: str, n: float, group: Group) -> float | None:
    """A collective priced from the profile's own measurement (CPU/gloo), else None.

    Measured between two ranks as t = alpha + n beta; a p-rank ring takes p - 1 such steps
    and moves 2 (p - 1) / p of the buffer per rank, twice what two ranks move per byte. The
    profile measures one machine's loopback: a group that spans nodes (``local_cluster``'s
    ``nodes``) is priced on their link instead (None)."""
    if op not in cluster.op_costs or group.nodes(cluster.gpus_per_node) > 1:
        return None
    p = group.size
    if p <= 1 or n <= 0:
        return 0.0
    if op == "p2p":
        return host_p2p(n, cluster)
    alpha, beta = cluster.op_costs[op]
    return (p - 1) * alpha + 2 * (p - 1) / p * n * beta


def host_p2p(n: float, cluster: Cluster) -> float | None:
    """A point-to-point send of `n` bytes between two ranks of one host, as the profile
    measured it (its share of a rank's time), else None."""
    if "p2p" not in cluster.op_costs:
        return None
    alpha, beta = cluster.op_costs["p2p"]
    return alpha + n * beta if n > 0 else 0.0


def p2p(n: float, group: Group, cluster: Cluster, net_eff: float) -> float:
    """One point-to-point send of `n` bytes between neighbours of `group`."""
    cost = measured(cluster, "p2p", n, group)
    return cost if cost is not None else point_to_point(n, group_link(group, cluster, net_eff))


def flat_all_reduce(n: float, group: Group, cluster: Cluster, net_eff: float) -> float:
    return ring_all_reduce(n, group.size, group_link(group, cluster, net_eff))


def hierarchical_all_reduce(n: float, group: Group, cluster: Cluster, net_eff: float,
                            inter_bytes_factor: float = 1.0) -> Phases:
    """Intra-node reduce-scatter, inter-node all-reduce of the shard, intra-node all-gather.

    `inter_bytes_factor` scales the inter-node bytes only (compression of that stage)."""
    g = cluster.gpus_per_node
    # Each GPU has its own NIC (one rail per GPU), so every shard ring gets a whole one.
    return two_level_all_reduce(n, group.per_node(g), group.nodes(g), intra_link(cluster, net_eff),
                                inter_link(cluster, net_eff), inter_bytes_factor)


def tree_all_reduce(n: float, group: Group, cluster: Cluster, net_eff: float) -> float:
    """NCCL's tree across nodes (chains inside them): the hierarchical algorithm's bandwidth
    terms, with 2 log2(N) inter-node latency steps instead of 2 (N - 1)."""
    g = cluster.gpus_per_node
    k, nodes = group.per_node(g), group.nodes(g)
    intra = intra_link(cluster, net_eff)
    inter = inter_link(cluster, net_eff)
    local = ring_reduce_scatter(n, k, intra) + ring_all_gather(n, k, intra)
    depth = math.ceil(math.log2(nodes)) if nodes > 1 else 0
    remote = 2 * depth * inter.alpha + 2 * (nodes - 1) / nodes * (n / k) * inter.beta()
    return local + remote


def all_reduce(n: float, group: Group, cluster: Cluster, net_eff: float,
               topology: str) -> float:
    """All-reduce time under `topology`: 'flat' ring, 'hierarchical' (two-level rings), or
    'auto' (what NCCL or mcpar's hybrid mode picks per message: the fastest of those and
    NCCL's tree)."""
    cost = measured(cluster, "ar", n, group)
    if cost is not None:
        return cost
    flat = flat_all_reduce(n, group, cluster, net_eff)
    if topology == "flat" or group.nodes(cluster.gpus_per_node) == 1:
        return flat
    hier = hierarchical_all_reduce(n, group, cluster, net_eff).total
    if topology == "hierarchical":
        return hier
    return min(flat, hier, tree_all_reduce(n, group, cluster, net_eff))


def reduce_scatter(n: float, group: Group, cluster: Cluster, net_eff: float,
                   topology: str, op: str = "rs") -> float:
    """Reduce-scatter (op 'rs') or all-gather ('ag') of an `n`-byte buffer over `group`; the
    ring costs of the two are the same."""
    cost = measured(cluster, op, n, group)
    if cost is not None:
        return cost
    if op == "rs" and cluster.accel.is_cpu and group.nodes(cluster.gpus_per_node) > 1:
        # On gloo the runtime reduce-scatters by an all-to-all of the chunks
        # (``mcpar.all_to_all_reduce_scatter``): every chunk crosses the link once, directly.
        return all_to_all(n, group, cluster, net_eff)
    flat = ring_reduce_scatter(n, group.size, group_link(group, cluster, net_eff))
    if topology == "flat" or group.nodes(cluster.gpus_per_node) == 1:
        return flat
    hier = hierarchical_all_reduce(n, group, cluster, net_eff).total / 2
    if topology == "hierarchical":
        return hier
    return min(flat, hier, tree_all_reduce(n, group, cluster, net_eff) / 2)


def all_gather(n: float, group: Group, cluster: Cluster, net_eff: float,
               topology: str) -> float:
    return reduce_scatter(n, group, cluster, net_eff, topology, op="ag")


def all_to_all(n: float, group: Group, cluster: Cluster, net_eff: float) -> float:
    """Pairwise all-to-all of `n` bytes per rank: the on-node share rides NVLink while the
    off-node share leaves through the rank's own NIC, in parallel."""
    p = group.size
    if p <= 1 or n <= 0:
        return 0.0
    g = cluster.gpus_per_node
    k = group.per_node(g)
    intra, inter = intra_link(cluster, net_eff), inter_link(cluster, net_eff)
    on_node = (k - 1) / p * n
    off_node = (p - k) / p * n
    latency = (k - 1) * intra.alpha + (p - k) * inter.alpha
    return latency + max(on_node * intra.beta(), off_node * inter.beta())


def onebit_all_reduce(num_values: float, group: Group, cluster: Cluster, net_eff: float,
                      hierarchical: bool) -> float:
    """1-bit compressed all-reduce (1-bit Adam's compression stage): an all-to-all of packed
    signs and then an all-to-all of the re-compressed signs (an all-gather's bytes, sent to every
    peer at once, as the runtime does), 1 bit per value plus one fp32 scale per rank chunk.
    Hierarchical: fp16 reduce-scatter/all-gather inside the node, 1-bit only between nodes."""
    g = cluster.gpus_per_node
    p = group.size
    if p <= 1:
        return 0.0
    scales = 4.0 * p
    if hierarchical and group.nodes(g) > 1:
        k, nodes = group.per_node(g), group.nodes(g)
        intra = intra_link(cluster, net_eff)
        local = 2 * ring_reduce_scatter(2.0 * num_values, k, intra)
        shard_bits = num_values / k / 8 + scales
        remote = 2 * pairwise_all_to_all(shard_bits, nodes, inter_link(cluster, net_eff))
        return local + remote
    link = group_link(group, cluster, net_eff)
    bits = num_values / 8 + scales
    return 2 * pairwise_all_to_all(bits, p, link)
