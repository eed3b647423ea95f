"""CommunicationController: the job's decisions about the wire, on top of the accounted wire.

It is a :class:`~mcpar.comm.communicator.Communicator` (every collective it or the layers below
issue is counted in one set of books) that also decides:

- how the data axis reduces: ``flat``, ``hierarchical`` (reduce-scatter inside the node,
  all-reduce across nodes, all-gather inside the node) or ``hybrid`` (per bucket size, from a
  link model given in the config or measured at start);
- how gradients are exchanged (``grad_exchange.py``): plain all-reduce with an optional cast,
  PowerSGD, or 1-bit Adam's compressed momentum, chosen once when the job is built;
- whether ZeRO-3's parameter store carries a layer's gradient reduce-scatter and the next
  layer's gather in one all-to-all (``fuses_exchanges``): on gloo a small collective's time is
  mostly its fixed cost, so fewer collectives is the saving; NCCL keeps its native kernels.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from mcpar.comm.collectives import LinkModel, choose_all_reduce, fit_link
from mcpar.comm.communicator import CommHandle, Communicator
from mcpar.topology import ParallelDims


class CommunicationController(Communicator):
    """A Communicator that owns the data axis' reduction algorithm."""

    def __init__(self, dims: ParallelDims):
        super().__init__(dims)
        # Data-parallel all-reduce algorithm: 'flat', 'hierarchical' or 'hybrid' (per size).
        self.dp_topology = "flat"
        self.link: LinkModel | None = None

    def fuses_exchanges(self) -> bool:
        """Whether reduce-scatters and all-gathers of the data axis issued back to back travel as
        one all-to-all (``Communicator.exchange_async``). On gloo (CPU) yes: there a small
        collective's time is mostly its fixed cost (2 ranks on this project's 2-core machine: a
        0.1-0.4 MB all-gather or all-to-all took 0.4-1.1 ms, a 4 MB one 4-7 ms;
        ``bench/gloo_collectives.py``), so fewer collectives is the saving. On NCCL the native
        reduce-scatter and all-gather kernels run concurrently on their own streams and scale
        past an all-to-all's point-to-point sends: no."""
        return dist.is_initialized() and self._gloo("dp")

    # --- topology -------------------------------------------------------------------------------
    def set_dp_topology(self, topology: str, node_of_rank: list[int],
                        link: LinkModel | None = None) -> None:
        """Choose the data-parallel all-reduce algorithm. 'hierarchical' and 'hybrid' split the
        data axis by node (``node_of_rank``: node index of every global rank); 'hybrid' needs
        a link model and measures one when none is given."""
        self.dp_topology = topology
        if topology == "flat":
            return
        self.dims.build_node_groups(node_of_rank)
        if topology == "hybrid":
            self.link = link or self.measure_link()

    def measure_link(self, small_bytes: int = 8, large_bytes: int = 1 << 20) -> LinkModel:
        """Fit latency and bandwidth of the intra- and inter-node links from timed all-reduces
        on the node groups (the same figures on every rank: the slowest rank's times)."""
        results: dict[str, tuple[float, float]] = {}
        for axis in ("dp_intra", "dp_inter"):
            n = self.axis_size(axis)
            times = []
            for nbytes in (small_bytes, large_bytes):
                buf = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
                self.all_reduce(buf, axis=axis)  # warm the connection
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    self.all_reduce(buf, axis=axis)
                    best = min(best, time.perf_counter() - start)
                times.append(best)
            agreed = torch.tensor(times, dtype=torch.float64)
            self.all_reduce(agreed, axis="world", op="max")
            if n > 1:
                results[axis] = fit_link(float(agreed[0]), small_bytes, float(agreed[1]),
                                         large_bytes, n)
            else:
                results[axis] = (0.0, float("inf"))
        (intra_lat, intra_bw), (inter_lat, inter_bw) = results["dp_intra"], results["dp_inter"]
        return LinkModel(intra_lat, intra_bw, inter_lat, inter_bw)

    def dp_algorithm(self, nbytes: int) -> str:
        """The algorithm the data-parallel all-reduce of `nbytes` runs with."""
        if self.dp_topology == "hybrid":
            assert self.link is not None
            return choose_all_reduce(nbytes, self.dims.dp_intra, self.dims.dp_inter, self.link)
        if self.dp_topology == "hierarchical" and self.dims.dp_intra > 1:
            return "hierarchical"
        return "flat"

    def dp_all_reduce(self, tensor: torch.Tensor, codec: str = "none",
                      async_op: bool = False) -> CommHandle:
        """Sum `tensor` (flat) over the data axis with the configured algorithm; `codec` fp16 or
        bf16 casts what crosses the wire (under hierarchical, only the inter-node stage). Under
        context parallelism the context ranks hold replicas too: one flat all-reduce over the
        data and context axes together ('dp_cp'; the plan refuses the other algorithms)."""
        if self.dims.cp > 1:
            return self.all_reduce(tensor, axis="dp_cp", async_op=async_op)
        if self.axis_size("dp") == 1:
            return CommHandle(None)
        algorithm = self.dp_algorithm(tensor.numel() * tensor.element_size())
        if algorithm == "flat" and codec == "none":
            return self.all_reduce(tensor, axis="dp", async_op=async_op)

        def run() -> None:
            if algorithm == "flat":
                self._cast_all_reduce(tensor, "dp", codec)
            else:
                self._hierarchical_all_reduce(tensor, codec)

        if async_op:
            return self.run_async(run)
        run()
        return CommHandle(None)

    def _cast_all_reduce(self, tensor: torch.Tensor, axis: str, codec: str) -> None:
        if codec == "none":
            self.all_reduce(tensor, axis=axis)
            return
        wire = tensor.to({"fp16": torch.float16, "bf16": torch.bfloat16}[codec])
        self.all_reduce(wire, axis=axis, codec=codec)
        tensor.copy_(wire)

    def _hierarchical_all_reduce(self, tensor: torch.Tensor, codec: str) -> None:
        """Reduce-scatter inside the node, all-reduce the shards across nodes, all-gather
        inside the node. Sizes that do not divide by the node's rank count are padded."""
        k = self.axis_size("dp_intra")
        pad = (-tensor.numel()) % k
        padded = torch.cat([tensor, tensor.new_zeros(pad)]) if pad else tensor
        shard = self.reduce_scatter_along(padded, dim=0, axis="dp_intra")
        self._cast_all_reduce(shard, "dp_inter", codec)
        self.all_gather_into(padded, shard, axis="dp_intra")
        if pad:
            tensor.copy_(padded[:tensor.numel()])

