"""mcpar.sim: an analytical cost model of transformer training steps, a simulator of published
runs and mcpar configs, and a planner that searches layouts under the memory limit.

Layering: this package imports only ``mcpar.config`` and ``mcpar.errors`` from the rest of mcpar
(and torch only in ``localprofile``, which measures this machine).
"""
