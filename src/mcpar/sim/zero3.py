"""ZeRO-3's per-micro-batch traffic, plain or through the hierarchical parameter store.

Per micro-batch and per transformer block (one call each, so every call pays its latency):

- forward: all-gather of the block's shards over the whole data axis (``Group`` of the data
  ranks), in the weights' dtype, or int8 with one fp32 scale per 256 elements
  (``weight_gather: int8``, ZeRO++ qwZ: ``INT8_BYTES`` per element, plus the quantize pass on
  the shard and the dequantize pass on the gathered block);
- backward, plain: the same gather again, in the weights' dtype, and a reduce-scatter of the
  block's gradients over the whole data axis;
- backward, with the store (``allocation: topology_aware``, ZeRO++ hpZ): the forward gather left
  each rank a 1/k slice of the block (k = data ranks per node), so the backward gather runs over
  the k ranks of the node on NVLink; the gradients are reduce-scattered inside the node over the
  whole block (k ranks), then across the N nodes on the 1/k shard, each of the k shard groups on
  its rank's own share of the node's NICs. ``compression`` applies to that inter-node stage only:
  bf16 (2 bytes per element) or int8 with error feedback (``INT8_BYTES``, ZeRO++ qgZ, sent as an
  all-to-all of quantized chunks and summed locally, which the alpha-beta model prices as a
  reduce-scatter's bytes).

The root parameters (embedding, final norm, head) are priced as one more block's worth of the
rank's parameters spread over the block calls, as before the store: their single gather per
micro-batch is within the model's resolution. Codec passes run on the compute stream and are
returned apart (``encode``) so that they land on the critical path.
"""

from __future__ import annotations

from dataclasses import dataclass

from mcpar.registry.codec import CODECS, INT8_BYTES
from mcpar.sim.collectives import (
    Group,
    all_gather,
    inter_link,
    pairwise_all_to_all,
    reduce_scatter,
    ring_reduce_scatter,
)
from mcpar.sim.compute import Roofline
from mcpar.sim.hardware import Cluster
from mcpar.sim.workload import Layout

STORE = "topology_aware"


@dataclass
class Zero3Traffic:
    """Seconds per micro-batch of one parameter group's ZeRO-3 collectives."""

    forward: float  # the forward gathers (hidden behind the forward by prefetching)
    backward: float  # the backward gathers and gradient reduce-scatters
    reduce: float  # of which the reduce-scatters (once per step where the plan says so)
    encode: float  # quantize / dequantize / error-feedback passes (not hidden)
    inter_node_bytes: float  # bytes one node sends through its NICs (per micro-batch)


def uses_store(lay: Layout, group: Group, cluster: Cluster) -> bool:
    """The store changes anything only when the data axis crosses nodes."""
    return (lay.allocation == STORE and lay.zero_stage == 3
            and group.nodes(cluster.gpus_per_node) > 1)


def inter_grad_bytes(lay: Layout, g_b: float) -> float:
    """Bytes per gradient element on the store's inter-node reduce-scatter."""
    return CODECS.get(lay.compression).store_grad_bytes(g_b)


def zero3_traffic(count: float, w_b: float, g_b: float, group: Group, lay: Layout,
                  cluster: Cluster, net: float, topology: str, calls: int,
                  rl: Roofline) -> Zero3Traffic:
    """One micro-batch's ZeRO-3 traffic for `count` parameters sharded over `group`, moved in
    `calls` per-block calls each way (weights `w_b`, gradients `g_b` bytes per element)."""
    g = cluster.gpus_per_node
    k, nodes = group.per_node(g), group.nodes(g)
    crosses = nodes > 1
    gather_b = INT8_BYTES if lay.weight_gather == "int8" else w_b
    forward = calls * all_gather(count * gather_b / calls, group, cluster, net, topology)
    encode = 0.0
    if lay.weight_gather == "int8":
        # Quantize the own shard (read w_b, write int8), dequantize the gathered block.
        encode += rl.stream(count / group.size * (w_b + gather_b) + count * (gather_b + w_b))
    # What a flat ring sends out of each node: one n / p chunk per ring step, (p - 1) / p of
    # the buffer per collective (spread over the node's NICs).
    ring_share = (group.size - 1) / group.size if crosses else 0.0
    inter = ring_share * count * gather_b
    if not uses_store(lay, group, cluster):
        reduce = calls * reduce_scatter(count * g_b / calls, group, cluster, net, topology)
        backward = calls * all_gather(count * w_b / calls, group, cluster, net, topology) + reduce
        inter += ring_share * count * (w_b + g_b)
        return Zero3Traffic(forward, backward, reduce, encode, inter)
    local = Group(k, group.stride)  # the node's data ranks: NVLink only
    gather = calls * all_gather(count * w_b / calls, local, cluster, net, "flat")
    rs_local = calls * reduce_scatter(count * g_b / calls, local, cluster, net, "flat")
    shard_b = inter_grad_bytes(lay, g_b)
    shard = count / k * shard_b / calls  # one block's 1/k shard as it crosses nodes
    link = inter_link(cluster, net)  # each shard group on its rank's own NIC share
    if CODECS.get(lay.compression).store_all_to_all:
        rs_remote = calls * pairwise_all_to_all(shard, nodes, link)
        # Add the error, quantize (read g_b + 4, write int8 + the new error), dequantize and
        # sum the N received chunks into the owned 1/(kN) slice.
        encode += rl.stream(count / k * (g_b + 4 + shard_b + 4 + shard_b)
                            + count / (k * nodes) * g_b)
    else:
        rs_remote = calls * ring_reduce_scatter(shard, nodes, link)
        if shard_b < g_b:  # the cast down and back up
            encode += rl.stream(count / k * (g_b + shard_b) + count / (k * nodes) * 2 * g_b)
    # The secondary copy: each rank keeps its 1/k slice of every gathered block.
    encode += rl.stream(2 * count / k * w_b)
    # k shard rings per node, each sending (N - 1) / N of its 1/k shard across nodes.
    inter += (nodes - 1) / nodes * count * shard_b
    return Zero3Traffic(forward, gather + rs_local + rs_remote, rs_local + rs_remote, encode,
                        inter)
