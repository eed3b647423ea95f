"""The build of the CommunicationController's planned gradient exchange (``plan.py``).

Under ZeRO the exchange is a reduce-scatter into each rank's shard; otherwise the codec's
registry entry (``codecs.py``, or a plug-in) builds it from the plan.
"""

from __future__ import annotations

import torch

from mcpar.config import JobConfig
from mcpar.controllers.communication.codecs import ExchangeContext, RuntimeCodec
from mcpar.controllers.communication.controller import CommunicationController
from mcpar.controllers.communication.exchanges import GradExchange, ReduceScatterExchange
from mcpar.controllers.communication.grad_sync import DataParallelGradSync
from mcpar.controllers.communication.plan import CommPlan
from mcpar.registry.codec import CODECS


def build_grad_exchange(plan: CommPlan, cfg: JobConfig, comm: CommunicationController,
                        sync: DataParallelGradSync, optimizer: torch.optim.Optimizer,
                        seed: int) -> tuple[GradExchange, str]:
    """The planned strategy, wired into ``sync``; and a line for the start-up log saying what
    runs."""
    exchange: GradExchange
    if plan.strategy == "reduce_scatter":
        exchange = ReduceScatterExchange(comm)
        # The buckets carry the MemoryController's shard axis ('dp', or 'dp_cp').
        axis = next((b.axis for b in sync.buckets if not b.expert), "dp")
        ranks = "data x context" if axis == "dp_cp" else "data-parallel"
        text = (f"gradient exchange: ZeRO stage {plan.zero_stage}, "
                f"reduce-scatter over {comm.axis_size(axis)} {ranks} ranks")
    else:
        entry = CODECS.get(plan.codec)
        if not isinstance(entry, RuntimeCodec):
            raise ValueError(f"gradient codec {plan.codec!r} is priced only: it has no build")
        exchange, text = entry.build(ExchangeContext(
            cfg, plan.topology, plan.overlap, plan.codec_settings, comm, sync, optimizer, seed))
    sync.set_exchange(exchange)
    return exchange, text
