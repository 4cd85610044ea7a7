"""weightpull: versioned model weights from a trainer to inference replicas, by pull.

The trainer publishes a version into a slot it registered once; each replica leases the
newest version, reads it one-sidedly into its own mirror and keeps it only if the lease
held throughout. `import weightpull` loads the core alone (anyio, attrs and cattrs): no torch,
no transport library, no vLLM.

The top level holds what a user writes (`__all__`) and the errors a user catches most.
Every error is in `weightpull.errors`; the RL loop built on the protocol is `weightpull.rl`.
A name that left the top level (`_MOVED`) still resolves there for one release, with a
`DeprecationWarning` naming its new place.
"""

from . import errors as _errors
from . import layout as _layout
from . import rl as _rl
from . import sharding as _sharding
from . import slices as _slices
from . import transport as _transport
from .clock import Clock, FakeClock, MonotonicClock
from .errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    NoProgressError,
    NoReadyVersionError,
    PermissionDeniedError,
    PublishError,
    PullError,
    RegistryError,
    RegistryUnavailableError,
    TornReadError,
    TransportError,
    VersionWaitTimeoutError,
    WeightpullError,
)
from .layout import Layout, TensorSpec, plan_layout
from .manifest import Manifest
from .moved import forward_names as _forward_names
from .principals import Principal, Role
from .publisher import Publisher, PublishResult, WhenFull
from .puller import Pulled, Puller
from .registry import (
    InProcessRegistry,
    Lease,
    Registry,
    RegistryStatus,
    RelayingRegistry,
    ReservingRegistry,
    StreamingRegistry,
    connect_registry,
)
from .rl.agent import EngineControl, PauseMode, UpdateAgent
from .rl.dispatcher import Dispatcher, Prompt
from .serving import wait_until_served
from .settings import LeaseSettings, RelaySettings, SlotSettings
from .sharding import Sharding
from .slice_puller import SlicePulled, SlicePuller
from .slices import RankSlice
from .states import LeaseState, SlotState, VersionState
from .tensors import HostTensor, TensorAdapter, as_tensors
from .transport import Transport
from .transports import create_transport, list_transports, register_transport

__version__ = "0.1.0"

__all__ = [
    # publishing and pulling
    "Publisher",
    "PublishResult",
    "SlotSettings",
    "WhenFull",
    "Puller",
    "Pulled",
    "LeaseSettings",
    "RelaySettings",
    "as_tensors",
    "SlicePuller",
    "SlicePulled",
    "RankSlice",
    # the registry
    "connect_registry",
    "InProcessRegistry",
    "Registry",
    "StreamingRegistry",
    "ReservingRegistry",
    "RelayingRegistry",
    "Lease",
    "RegistryStatus",
    "Principal",
    "Role",
    "wait_until_served",
    # transports
    "create_transport",
    "list_transports",
    "register_transport",
    "Transport",
    # what a version holds
    "Manifest",
    "Layout",
    "TensorSpec",
    "plan_layout",
    "Sharding",
    "TensorAdapter",
    "HostTensor",
    # states and clocks
    "VersionState",
    "LeaseState",
    "SlotState",
    "Clock",
    "MonotonicClock",
    "FakeClock",
    # the RL loop's replica side (all of the loop: weightpull.rl)
    "UpdateAgent",
    "EngineControl",
    "PauseMode",
    "Dispatcher",
    "Prompt",
    # the errors a user catches most (every error: weightpull.errors)
    "WeightpullError",
    "InvalidArgumentError",
    "RegistryError",
    "RegistryUnavailableError",
    "PermissionDeniedError",
    "NoReadyVersionError",
    "LeaseExpiredError",
    "VersionWaitTimeoutError",
    "PublishError",
    "PullError",
    "TornReadError",
    "NoProgressError",
    "TransportError",
]

# Names the top level held before 0.2, and the module each lives in now.
_MOVED = {
    **{
        name: _errors
        for name in (
            "AgentFailedError",
            "ApplyCheckError",
            "ApplyError",
            "AuthenticationError",
            "DigestMismatchError",
            "DriverUnavailableError",
            "IncompleteApplyError",
            "InvalidTransitionError",
            "LeaseNotFoundError",
            "MalformedMessageError",
            "MessageTooLargeError",
            "NoFreeSlotError",
            "NoProducerError",
            "NoSourceError",
            "PeerGoneError",
            "ProtocolError",
            "RegionNotRegisteredError",
            "ReplayedMessageError",
            "SlotWaitTimeoutError",
            "StaleSampleError",
            "UnknownDriverError",
            "UnsupportedModelError",
            "VersionInUseError",
            "VersionNotFoundError",
            "VersionOrderError",
            "VersionStateError",
        )
    },
    "Bucket": _layout,
    "Placement": _layout,
    "Region": _transport,
    "Remote": _transport,
    "Shard": _sharding,
    "plan_slice": _slices,
    "Group": _rl,
    "StalenessClock": _rl,
    "Trajectory": _rl,
}

__getattr__ = _forward_names(__name__, _MOVED)
