"""Importing this module registers every built-in registry entry (``mcpar.registry``)."""

from mcpar.controllers.communication import codecs  # noqa: F401
from mcpar.controllers.compute import pipeline_schedules  # noqa: F401
from mcpar.controllers.memory import recompute  # noqa: F401
