"""Link model and algorithm choice for the data-parallel all-reduce: flat ring or hierarchical.

The formulas are the cost model's (``mcpar.sim.collectives``: ``ring_all_reduce``,
``two_level_all_reduce``, ``fit_ring_link``), so the runtime's ``hybrid`` choice and the simulator
price a collective alike; this module only says which links the runtime's measured model gives
them.

Flat: the backend's own ring over every data-parallel rank. With ranks numbered node by node,
the ring crosses the inter-node link once per node boundary, and each of its 2(n-1) steps waits
for the slowest hop: T = 2(n-1) (a_inter + S / (n b_inter)).

Hierarchical: reduce-scatter inside the node (k ranks), all-reduce of the 1/k shards across the
N nodes, all-gather inside the node. The k shard all-reduces run at once and share the node's
link (each gets b_inter / k), so together they move what one all-reduce of S would:
T = 2(k-1) (a_intra + S / (k b_intra)) + 2(N-1) (a_inter + S / (N b_inter)).

On a node whose ranks share one network link, hierarchical sends 2(N-1)/N S through it instead
of 2(n-1)/n S and pays 2(N-1) inter-node latencies instead of 2(n-1). `hybrid` evaluates both
per message size and takes the faster, so it follows whatever link model it is given (measured
at start, or from the ``cluster`` section of the config).
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.sim.collectives import Link, fit_ring_link, ring_all_reduce, two_level_all_reduce


@dataclass(frozen=True)
class LinkModel:
    """alpha-beta model of the two link classes: latency in seconds, bandwidth in bytes/s."""

    intra_latency_s: float
    intra_bandwidth: float
    inter_latency_s: float
    inter_bandwidth: float

    def intra(self) -> Link:
        return Link(self.intra_latency_s, self.intra_bandwidth)

    def inter(self, sharing: int = 1) -> Link:
        """The inter-node link as each of `sharing` rings running over it at once gets it."""
        return Link(self.inter_latency_s, self.inter_bandwidth / sharing)

    def describe(self) -> str:
        return (f"intra-node {self.intra_bandwidth * 8 / 1e9:.3g} Gbit/s, "
                f"{self.intra_latency_s * 1e6:.0f} us; inter-node "
                f"{self.inter_bandwidth * 8 / 1e9:.3g} Gbit/s, {self.inter_latency_s * 1e6:.0f} us")


def flat_all_reduce_time(nbytes: float, ranks_per_node: int, num_nodes: int,
                         link: LinkModel) -> float:
    n = ranks_per_node * num_nodes
    return ring_all_reduce(nbytes, n, link.intra() if num_nodes == 1 else link.inter())


def hierarchical_all_reduce_time(nbytes: float, ranks_per_node: int, num_nodes: int,
                                 link: LinkModel) -> float:
    return two_level_all_reduce(nbytes, ranks_per_node, num_nodes, link.intra(),
                                link.inter(sharing=ranks_per_node)).total


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
    fitted = fit_ring_link(small_time_s, small_bytes, large_time_s, large_bytes, num_ranks)
    return fitted.alpha, fitted.bandwidth
