"""An emulated multi-node cluster on one host: one network namespace per "node", joined to a
switch namespace by veth pairs shaped with ``tc`` (DESIGN.md §6), so that communication-bound
features can be measured on a slow inter-node link without a real cluster.

It is test and benchmark tooling (``tests/test_netcluster.py``, ``bench/emulated_cluster.py``):
mcpar's own code never imports it. ``netcluster.cluster`` builds the clusters,
``netcluster.host`` wraps ``ip``/``tc``, ``netcluster.forwarder`` is the user-space switch,
``netcluster.torchrun`` starts one torchrun per node and ``netcluster.stats`` reads what the
link did. CLI: ``python -m netcluster run ...`` / ``python -m netcluster cleanup``.
"""

from .cluster import (
    DEFAULT_MASTER_PORT,
    DEFAULT_SUBNET,
    NODE_IF,
    SWITCH_IF,
    LoopbackCluster,
    NetCluster,
    main,
    parse_delay,
    parse_rate,
)
from .host import (
    ROOT_PREFIX,
    NetClusterError,
    available,
    cleanup,
    list_namespaces,
    netem_available,
)

__all__ = [
    "DEFAULT_MASTER_PORT",
    "DEFAULT_SUBNET",
    "NODE_IF",
    "ROOT_PREFIX",
    "SWITCH_IF",
    "LoopbackCluster",
    "NetCluster",
    "NetClusterError",
    "available",
    "cleanup",
    "list_namespaces",
    "main",
    "netem_available",
    "parse_delay",
    "parse_rate",
]
