"""The ComputeController's stage cut: where the model is cut into pipeline stages.

Stages are balanced by the modelled cost of each piece (the embedding and the output head
included, since a large vocabulary makes the head cost as much as several blocks), not by
counting layers. The cut is the ComputeController's decision; its one formula lives in
``mcpar.sim.stages`` so that the cost model prices exactly the cut the trainer makes (the
simulator may not import the controllers).
"""

from __future__ import annotations

from mcpar.sim.stages import balanced_cut, partition_layers, piece_costs

__all__ = ["balanced_cut", "partition_layers", "piece_costs"]
