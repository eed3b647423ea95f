"""CommunicationController: every collective and every decision about the wire.

- ``controller.py``: the controller (an accounted ``Communicator``) and the data axis' reduction
  algorithm (flat, hierarchical, hybrid);
- ``grad_exchange.py``: the gradient-exchange strategies (all-reduce, PowerSGD, 1-bit momentum),
  one chosen per job;
- ``grad_sync.py``: the bucketed gradient synchronization the strategies drive.
"""
