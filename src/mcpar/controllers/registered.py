"""Importing this module registers every built-in registry entry (``mcpar.registry``)."""

from mcpar.controllers.communication import codecs  # noqa: F401
from mcpar.controllers.compute import (  # noqa: F401
    pipeline_schedules,
    zero_bubble,
    zero_bubble_v,
)
from mcpar.controllers.memory import recompute, zero_stages  # noqa: F401
from mcpar.models.gpt import family as gpt_family  # noqa: F401
from mcpar.models.llama import family as llama_family  # noqa: F401
from mcpar.models.moe import family as moe_family  # noqa: F401
