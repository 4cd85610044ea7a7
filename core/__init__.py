"""weightpull: versioned model weights from a trainer to inference replicas, by pull.

The trainer publishes a version into a slot it registered once; each replica leases the
newest version, reads it one-sidedly into its own mirror and keeps it only if the lease
held throughout. `import weightpull` loads the core alone (anyio, attrs and cattrs): no torch,
no transport library, no vLLM.
"""

from .clock import Clock, FakeClock, MonotonicClock
from .errors import (
    AgentFailedError,
    ApplyCheckError,
    ApplyError,
    AuthenticationError,
    DigestMismatchError,
    DriverUnavailableError,
    IncompleteApplyError,
    InvalidArgumentError,
    InvalidTransitionError,
    LeaseExpiredError,
    LeaseNotFoundError,
    MalformedMessageError,
    MessageTooLargeError,
    NoFreeSlotError,
    NoProducerError,
    NoProgressError,
    NoReadyVersionError,
    NoSourceError,
    PeerGoneError,
    PermissionDeniedError,
    ProtocolError,
    PublishError,
    PullError,
    RegionNotRegisteredError,
    RegistryError,
    RegistryUnavailableError,
    ReplayedMessageError,
    SlotWaitTimeoutError,
    StaleSampleError,
    TornReadError,
    TransportError,
    UnknownDriverError,
    UnsupportedModelError,
    VersionInUseError,
    VersionNotFoundError,
    VersionOrderError,
    VersionStateError,
    VersionWaitTimeoutError,
    WeightpullError,
)
from .layout import Bucket, Layout, Placement, TensorSpec, plan_layout
from .manifest import Manifest
from .principals import Principal, Role
from .publisher import Publisher, PublishResult, WhenFull
from .puller import Pulled, Puller
from .registry import InProcessRegistry, Lease, Registry, RegistryStatus, RelayingRegistry, connect_registry
from .rl.agent import EngineControl, PauseMode, UpdateAgent
from .rl.dispatcher import Dispatcher, Prompt
from .rl.staleness import Group, StalenessClock, Trajectory
from .sharding import Shard, Sharding
from .slice_puller import SlicePulled, SlicePuller
from .slices import RankSlice, plan_slice
from .states import LeaseState, SlotState, VersionState
from .tensors import HostTensor, TensorAdapter
from .transport import Region, Remote, Transport
from .transports import create_transport, list_transports, register_transport

__version__ = "0.1.0"

__all__ = [
    "AgentFailedError",
    "ApplyCheckError",
    "ApplyError",
    "AuthenticationError",
    "Bucket",
    "Clock",
    "connect_registry",
    "create_transport",
    "DigestMismatchError",
    "Dispatcher",
    "DriverUnavailableError",
    "EngineControl",
    "FakeClock",
    "Group",
    "HostTensor",
    "IncompleteApplyError",
    "InProcessRegistry",
    "InvalidArgumentError",
    "InvalidTransitionError",
    "Layout",
    "Lease",
    "LeaseExpiredError",
    "LeaseNotFoundError",
    "LeaseState",
    "list_transports",
    "MalformedMessageError",
    "Manifest",
    "MessageTooLargeError",
    "MonotonicClock",
    "NoFreeSlotError",
    "NoProducerError",
    "NoProgressError",
    "NoReadyVersionError",
    "PauseMode",
    "PeerGoneError",
    "PermissionDeniedError",
    "Placement",
    "plan_layout",
    "plan_slice",
    "Principal",
    "Prompt",
    "ProtocolError",
    "Publisher",
    "PublishError",
    "PublishResult",
    "Pulled",
    "Puller",
    "PullError",
    "RankSlice",
    "Region",
    "RegionNotRegisteredError",
    "register_transport",
    "Registry",
    "RegistryError",
    "RegistryStatus",
    "RegistryUnavailableError",
    "Remote",
    "ReplayedMessageError",
    "Role",
    "Shard",
    "Sharding",
    "SlicePulled",
    "SlicePuller",
    "SlotState",
    "SlotWaitTimeoutError",
    "StalenessClock",
    "StaleSampleError",
    "TensorAdapter",
    "TensorSpec",
    "TornReadError",
    "Trajectory",
    "Transport",
    "TransportError",
    "UnknownDriverError",
    "UnsupportedModelError",
    "UpdateAgent",
    "VersionInUseError",
    "VersionNotFoundError",
    "VersionOrderError",
    "VersionState",
    "VersionStateError",
    "VersionWaitTimeoutError",
    "WeightpullError",
    "WhenFull",
    "NoSourceError",
    "RelayingRegistry",
]
