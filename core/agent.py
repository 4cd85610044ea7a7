"""Deprecated: moved to `weightpull.rl.agent` (the RL loop, a layer of its own on the
protocol). This path forwards for one release, with a `DeprecationWarning`."""

from .moved import forward_module
from .rl import agent

__getattr__ = forward_module(__name__, agent)
