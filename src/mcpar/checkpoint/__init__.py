"""Fault recovery: the FaultRecoveryManager (``manager.py``), checkpoint files and manifest
(``files.py``), packing (``packing.py``), asynchronous saves (``async_save.py``) and restoring
on another layout (``reshard.py``)."""
