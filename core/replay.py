"""Deprecated: moved to `weightpull.rl.replay` (the RL loop, a layer of its own on the
protocol). This path forwards for one release, with a `DeprecationWarning`."""

from .moved import forward_module
from .rl import replay

__getattr__ = forward_module(__name__, replay)
