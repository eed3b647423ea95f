"""CommunicationController: every collective and every decision about the wire.

- ``controller.py``: the controller (an accounted ``Communicator``) and the data axis' reduction
  algorithm (flat, hierarchical, hybrid);
- ``codecs.py``: the registered gradient codecs (rules, terms and builds);
- ``exchanges.py``: the gradient-exchange strategies (all-reduce, reduce-scatter, PowerSGD,
  1-bit momentum); ``grad_exchange.py``: the one a job runs, planned and built;
- ``grad_sync.py``: the bucketed gradient synchronization the strategies drive.
"""
