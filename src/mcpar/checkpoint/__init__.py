"""Fault recovery: the FaultRecoveryManager (``manager.py``), checkpoint files and manifest
(``files.py``), packing (``packing.py``), asynchronous saves (``async_save.py``), the reader of a
checkpoint's saved pieces (``saved_state.py``, shared with ``mcpar checkpoint verify``) and
restoring on another layout (index maps in ``reshard.py``, the restore in
``reshard_restore.py``)."""
