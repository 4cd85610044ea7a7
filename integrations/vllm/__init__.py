"""vLLM integration: replicas pull on their own schedule, prompts wait for their version.

- `worker`: the worker extension (`WORKER_EXTENSION`) that holds each worker's mirrors (of
  the whole version, or of its tensor-parallel slice: `slices`), prefetches in the
  background (`mirrors`) and applies checked (`apply`).
- `engine`: the `AsyncLLM` side: `VllmEngine` (what the update agent drives),
  `VllmReplica` (what the dispatcher runs prompts on), `open_replica`, `PullSpec`.
- `backend`, `trainer`, `server_agent`, `plugin`: weightpull as a backend of vLLM's own
  weight-transfer API (`--weight-transfer-config '{"backend": "weightpull"}'`).
- `demo`: `weightpull demo --engine vllm`.

See docs/guides/vllm.md and docs/guides/vllm-backend.md.
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
