"""The trainer's side of serving: wait until the replicas serve a version.

A replica says what it serves with `report_serving` (its update agent does, after each
apply); the registry's status lists each live replica's version and drops a replica
whose liveness lapsed. `wait_until_served` reads that status until every live replica
serves the version, and ends on a replica that leaves instead of waiting for it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from .clock import Clock, MonotonicClock
from .errors import InvalidArgumentError, ReplicasLeftError, VersionWaitTimeoutError
from .registry import Registry

__all__ = ["wait_until_served"]

DEFAULT_POLL = 0.5  # seconds between status reads: a replica's report is seen within it


async def wait_until_served(
    registry: Registry,
    version: int,
    *,
    timeout: float | None = None,
    poll: float = DEFAULT_POLL,
    clock: Clock | None = None,
) -> Mapping[str, int]:
    """Wait until every live replica serves `version` or a newer one.

    It reads the registry's status every `poll` seconds: a replica counts from its first
    `report_serving` on, and leaves when its liveness lapses (the registry's
    `liveness_ttl`). A replica that leaves while it waits ends the wait, by name, rather
    than letting it wait for a version that replica will never report.

    Args:
        registry: The registry the replicas report to (served, for liveness).
        version: The least version each replica must serve; a non-negative int.
        timeout: Seconds to wait at most; None waits as long as it takes.
        poll: Seconds between status reads; positive.
        clock: What it sleeps on (default: `MonotonicClock`); a `FakeClock` in tests.

    Returns:
        Each live replica's name and the version it serves, once all serve `version`.

    Raises:
        InvalidArgumentError: `version`, `timeout` or `poll` is malformed.
        ReplicasLeftError: Replicas that were serving lapsed while it waited (named,
            with the version each served last).
        VersionWaitTimeoutError: `timeout` passed first; the message names the replicas
            behind and what each serves, or says that no replica reported at all.
    """
    if not isinstance(version, int) or isinstance(version, bool) or version < 0:
        raise InvalidArgumentError(f"version must be a non-negative int, got {version!r}")
    if timeout is not None and not (isinstance(timeout, (int, float)) and 0 <= timeout < math.inf):
        raise InvalidArgumentError(f"timeout must be finite seconds >= 0 or None, got {timeout!r}")
    if not (isinstance(poll, (int, float)) and 0 < poll < math.inf):
        raise InvalidArgumentError(f"poll must be positive finite seconds, got {poll!r}")
    clock = clock or MonotonicClock()
    deadline = None if timeout is None else clock.now() + timeout
    seen: dict[str, int] = {}  # every replica seen serving while it waits, and its last version
    while True:
        serving = dict((await registry.status()).serving)
        left = sorted(set(seen) - set(serving))
        if left:
            names = ", ".join(f"{r!r} (serving v{seen[r]})" for r in left)
            raise ReplicasLeftError(
                f"replicas {names} left (their liveness lapsed) before all served v{version}; "
                f"see why they died, restart them, or wait again for the {len(serving)} left",
                replicas=tuple(left),
            )
        seen.update(serving)
        if serving and all(v >= version for v in serving.values()):
            return serving
        remaining = None if deadline is None else deadline - clock.now()
        if remaining is not None and remaining <= 0:
            if not serving:
                raise VersionWaitTimeoutError(
                    f"no replica reports serving anything after {timeout} s, so none serves v{version}: "
                    "start the replicas (their update agents report to this registry), or check their address"
                )
            behind = ", ".join(f"{r!r} (v{v})" for r, v in sorted(serving.items()) if v < version)
            raise VersionWaitTimeoutError(f"replicas {behind} did not serve v{version} within {timeout} s")
        await clock.sleep(poll if remaining is None else min(poll, remaining))
