"""Checkpoints of a run's shared variables: ``synkhronos.checkpoint.save`` / ``load``.

The public path of ``synkhronos.variables.checkpoint``, where they live.
"""

from .variables.checkpoint import *  # noqa: F401,F403
from .variables.checkpoint import __all__  # noqa: F401
