"""vLLM integration: replicas pull on their own schedule, prompts wait for their version.

- `worker`: the worker extension (`WORKER_EXTENSION`) that holds each worker's mirrors,
  prefetches in the background and applies through vLLM's `reload_weights`.
- `engine`: the `AsyncLLM` side: `VllmEngine` (what the update agent drives),
  `VllmReplica` (what the dispatcher runs prompts on), `open_replica`.
- `demo`: `weightpull demo --engine vllm`.

See docs/guides/vllm.md.
"""

from .engine import OpenReplica, PullSpec, VllmEngine, VllmReplica, engine_args, open_replica, shutdown, start_engine
from .worker import WORKER_EXTENSION, WeightpullWorker

__all__ = [
    "WORKER_EXTENSION",
    "OpenReplica",
    "PullSpec",
    "VllmEngine",
    "VllmReplica",
    "WeightpullWorker",
    "engine_args",
    "open_replica",
    "shutdown",
    "start_engine",
]
