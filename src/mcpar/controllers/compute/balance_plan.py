"""The expert load balancer's plan (``controllers.compute``), apart from the balancer itself
(``expert_balance.py``, which needs torch), so that a job's plan is made without torch."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BalancePlan:
    """How the expert load balancer runs (``controllers.compute``)."""

    scheduler: str  # 'static' (no balancer), 'greedy' or 'reinforcement'
    interval: int  # steps between balancing decisions
    migration_cost: float
    costs: str  # 'measured' or 'modeled' expert-phase costs
