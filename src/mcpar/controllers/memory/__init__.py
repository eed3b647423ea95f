"""MemoryController: where every tensor lives and what it costs (``estimate.py``: the per-rank
memory estimate of a plan, from the one memory model in ``mcpar.sim.memory``)."""
