"""weightpull inside verl: the `transport_pull` checkpoint engine (docs/guides/verl.md).

Importing this package registers the engine with verl's `CheckpointEngineRegistry`: name
it in `checkpoint_engine.custom_backend_module` and verl imports it on every worker.
"""

from .engine import BACKEND, TransportPullCheckpointEngine
from .settings import Settings

__all__ = ["BACKEND", "Settings", "TransportPullCheckpointEngine"]
