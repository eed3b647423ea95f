"""Optimizers that need the CommunicationController (communication-compressing ones)."""

from mcpar.optim.onebit_adam import OneBitAdam

__all__ = ["OneBitAdam"]
