"""Link model and algorithm choice for the data-parallel all-reduce: flat ring or hierarchical.

Flat: the backend's own ring over every data-parallel rank. With ranks numbered node by node,
the ring crosses the inter-node link once per node boundary, and each of its 2(n-1) steps waits
for the slowest hop: T = 2(n-1) (a_inter + S / (n b_inter)).

Hierarchical: reduce-scatter inside the node (k ranks), all-reduce of the 1/k shards across the
N nodes, all-gather inside the node. The k shard all-reduces run at once and share the node's
link, so together they move what one all-reduce of S would:
T = 2(k-1) (a_intra + S / (k b_intra)) + 2(N-1) (a_inter + S / (N b_inter)).

On a node whose ranks share one network link, hierarchical sends 2(N-1)/N S through it instead
of 2(n-1)/n S and pays 2(N-1) inter-node latencies instead of 2(n-1). `hybrid` evaluates both
per message size and takes the faster, so it follows whatever link model it is given (measured
at start, or from the ``cluster`` section of the config).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    """alpha-beta model of the two link classes: latency in seconds, bandwidth in bytes/s."""

    intra_latency_s: float
    intra_bandwidth: float
    inter_latency_s: float
    inter_bandwidth: float

    def describe(self) -> str:
        return (f"intra-node {self.intra_bandwidth * 8 / 1e9:.3g} Gbit/s, "
                f"{self.intra_latency_s * 1e6:.0f} us; inter-node "
                f"{self.inter_bandwidth * 8 / 1e9:.3g} Gbit/s, {self.inter_latency_s * 1e6:.0f} us")


def flat_all_reduce_time(nbytes: float, ranks_per_node: int, num_nodes: int,
                         link: LinkModel) -> float:
    n = ranks_per_node * num_nodes
    if n == 1:
        return 0.0
    if num_nodes == 1:
        return 2 * (n - 1) * (link.intra_latency_s + nbytes / (n * link.intra_bandwidth))
    return 2 * (n - 1) * (link.inter_latency_s + nbytes / (n * link.inter_bandwidth))


def hierarchical_all_reduce_time(nbytes: float, ranks_per_node: int, num_nodes: int,
                                 link: LinkModel) -> float:
    k, nodes = ranks_per_node, num_nodes
    intra = 2 * (k - 1) * (link.intra_latency_s + nbytes / (k * link.intra_bandwidth))
    inter = 2 * (nodes - 1) * (link.inter_latency_s + nbytes / (nodes * link.inter_bandwidth))
    return intra + inter


def choose_all_reduce(nbytes: float, ranks_per_node: int, num_nodes: int,
                      link: LinkModel) -> str:
    """'flat' or 'hierarchical', whichever the link model predicts faster for this size."""
    if ranks_per_node == 1 or num_nodes == 1:
        return "flat"  # the two algorithms are the same collective
    flat = flat_all_reduce_time(nbytes, ranks_per_node, num_nodes, link)
    hier = hierarchical_all_reduce_time(nbytes, ranks_per_node, num_nodes, link)
    return "hierarchical" if hier < flat else "flat"


def fit_link(small_time_s: float, small_bytes: float, large_time_s: float, large_bytes: float,
             num_ranks: int) -> tuple[float, float]:
    """(latency, bandwidth) of one link class from two timed ring all-reduces over
    `num_ranks` ranks: T = 2(n-1) (a + S / (n b))."""
    steps = 2 * (num_ranks - 1)
    per_step_small = small_time_s / steps
    per_step_large = large_time_s / steps
    slope = (per_step_large - per_step_small) / ((large_bytes - small_bytes) / num_ranks)
    bandwidth = 1.0 / slope if slope > 0 else float("inf")
    latency = max(0.0, per_step_small - small_bytes / num_ranks / bandwidth)
    return latency, bandwidth
