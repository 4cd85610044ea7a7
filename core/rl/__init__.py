"""The RL loop, built on the weight-transfer protocol (`weightpull`).

The protocol (registry, leases, slots, fencing, publisher, puller, relays) moves versioned
weights and knows nothing of training. This package is the decoupled RL loop on top of it,
engine-agnostic and sans-IO where it can be:

- `UpdateAgent` (`weightpull.rl.agent`): one per replica; prefetches the newest version,
  then pauses, applies and resumes its engine through `EngineControl`.
- `Dispatcher` (`weightpull.rl.dispatcher`): admits each `Prompt` only on a replica serving
  its `min_weight_version`.
- `Ledger` (`weightpull.rl.ledger`): every prompt's state through any process's death.
- `ReplayBuffer` and `Sampler` (`weightpull.rl.replay`): groups sampled by weight-version age.
- `StalenessClock`, `Trajectory`, `Group` (`weightpull.rl.staleness`): one clock for
  off-policy age.
- `Health` (`weightpull.rl.health`): whether any producer is left to wait for.

The protocol never imports this package (an import contract in pyproject.toml keeps it so).
"""

from .agent import AgentStats, EngineControl, PauseMode, UpdateAgent
from .dispatcher import Dispatcher, DispatchQueue, Prompt, Replica, ReplicaView
from .health import Health, Producer, agent_producers
from .ledger import Entry, Ledger, LedgerStore, MemoryStore, PromptState, Recovered, SqliteStore, Worker
from .replay import ReplayBuffer, Sampler
from .staleness import Group, StalenessClock, Trajectory

__all__ = [
    "AgentStats",
    "agent_producers",
    "Dispatcher",
    "DispatchQueue",
    "EngineControl",
    "Entry",
    "Group",
    "Health",
    "Ledger",
    "LedgerStore",
    "MemoryStore",
    "PauseMode",
    "Producer",
    "Prompt",
    "PromptState",
    "Recovered",
    "Replica",
    "ReplicaView",
    "ReplayBuffer",
    "Sampler",
    "SqliteStore",
    "StalenessClock",
    "Trajectory",
    "UpdateAgent",
    "Worker",
]
