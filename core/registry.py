"""The registry: the directory of published versions and the leases readers hold on them.

`Registry` is what publishers and pullers need of one, embedded or served;
`connect_registry` finds one. `InProcessRegistry`, the embedded default, is a thin async
face on `RegistryMachine` (registry_machine.py), which makes every decision in one
synchronous call: the face adds only waiting for a version. A served registry
(drivers/zmq_registry) and one in a Ray actor (drivers/ray_registry.py) drive the same
machine, made from the table of operations (operations.py): a new operation is one entry
there, its machine method, and its method here and on the protocol it belongs to.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import Any, Protocol, Self, runtime_checkable

import anyio

from . import operations, plugins
from .clock import Clock, MonotonicClock, within
from .errors import (
    DriverUnavailableError,
    InvalidArgumentError,
    PublisherLapsedError,
    VersionNotFoundError,
    VersionStateError,
    VersionWaitTimeoutError,
)
from .manifest import Manifest
from .operations import OperationsClient
from .principals import ADMIN, Principal
from .records import Lease, LeaseInfo, Progress, PullReport, RegistryStatus, Reservation, VersionInfo
from .registry_machine import DEFAULT_MAX_TTL, RegistryMachine, check_int
from .states import VersionState

__all__ = [
    "DEFAULT_MAX_TTL",
    "REGISTRY_ENV",
    "AsyncResource",
    "InProcessRegistry",
    "Lease",
    "LeaseInfo",
    "Principal",
    "Registry",
    "RegistryMachine",
    "RegistryStatus",
    "Reservation",
    "ReservingRegistry",
    "SliceRelayingRegistry",
    "StreamingRegistry",
    "as_streaming",
    "VersionInfo",
    "connect_registry",
]

REGISTRY_ENV = "WEIGHTPULL_REGISTRY"  # the address of a served registry
# connect_registry's clients, entry points of weightpull.registry_clients (the core names no driver).
_SERVED = "tcp"
_RAY = "ray"


@runtime_checkable
class AsyncResource(Protocol):
    """An async context manager whose exit is `aclose()`: what it started (a served
    client's heartbeat) runs no longer than the `async with` block. Closing twice is
    harmless."""

    async def aclose(self) -> None: ...
    async def __aenter__(self) -> Self: ...
    async def __aexit__(self, *exc_info: object) -> bool | None: ...


@runtime_checkable
class Registry(AsyncResource, Protocol):
    """What publishers and pullers need from a registry, embedded or served. Its
    operations are below; its lifecycle (`aclose`, `async with`) is `AsyncResource`'s,
    as it is no operation: nothing of it crosses the wire.

    `publisher=` names the line a reader follows: the versions of that owner (a
    principal's name; see `RegistryMachine`). Left out, the registry's default line: where
    one principal publishes, every version. A registry of an earlier release takes no
    `publisher=`: callers pass it only when they name one."""

    async def begin(
        self, version: int | None = None, *, publisher: str, slot: int, shard: tuple[int, int] | None = None
    ) -> int: ...
    async def commit(self, manifest: Manifest) -> None: ...
    async def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None: ...
    async def newest(self, *, publisher: str | None = None) -> Manifest | None: ...
    async def get(self, version: int) -> Manifest: ...
    async def acquire(
        self, version: int | None = None, *, ttl: float, holder: str, publisher: str | None = None
    ) -> Lease: ...
    async def renew(self, lease: Lease) -> Lease: ...
    async def release(self, lease: Lease) -> None: ...
    async def is_valid(self, lease: Lease) -> bool: ...
    async def retire(self, version: int) -> None: ...
    async def reclaim(self, version: int) -> None: ...
    async def wait_for_version(
        self, min_version: int, timeout: float | None = None, *, publisher: str | None = None
    ) -> Manifest: ...
    async def report_serving(self, replica: str, version: int, *, pull: PullReport | None = None) -> None: ...
    async def status(self) -> RegistryStatus: ...


@runtime_checkable
class StreamingRegistry(Registry, Protocol):
    """A registry whose versions can be read while they are written (every registry of
    weightpull's own is one): a publisher `stream`s a version's manifest, then `mark`s
    buckets committed; a reader leases it with `acquire(..., streaming=True)` and waits
    for each bucket with `wait_for_buckets`."""

    async def acquire(
        self,
        version: int | None = None,
        *,
        ttl: float,
        holder: str,
        streaming: bool = False,
        publisher: str | None = None,
    ) -> Lease: ...
    async def stream(self, manifest: Manifest) -> None: ...
    async def mark(self, version: int, committed: int) -> None: ...
    async def commit_stream(self, version: int, digests: Sequence[str] | None = None) -> None: ...
    async def progress(self, version: int) -> Progress: ...
    async def wait_for_buckets(
        self, version: int, at_least: int, timeout: float | None = None, *, publisher: str | None = None
    ) -> Progress: ...


@runtime_checkable
class ReservingRegistry(Protocol):
    """A registry that takes publishers' slots ahead of their first version (every
    registry of weightpull's own does): a publisher's `reserve` registers them, and a
    puller's `prepare` maps them and sizes its mirror from `reservations()`, so that the
    first version moves as quickly as the rest."""

    async def reserve(self, reservation: Reservation) -> None: ...
    async def reservations(self) -> tuple[Reservation, ...]: ...


@runtime_checkable
class RelayingRegistry(Protocol):
    """A registry that hands readers a source of each version (every registry of
    weightpull's own does): a replica holding a READY version `offer`s its mirror; a
    reader's `acquire(..., host=...)` is placed at the source the registry picks (the
    lease names it); a relay keeps its mirror while `readers_at` it is above 0.

    A relay of one rank's slice names its layout (`part=`, with the slice's `digests` from
    the layout's first relay that read the version's slot); see `SliceRelayingRegistry`.

    A relay may offer a version it is still receiving (`offer(..., landed=k)`, a STREAMING
    version too) and `mark_offer` each new count of buckets its mirror holds; a streaming
    reader placed there waits for them with `wait_for_buckets(..., source=lease.source)`,
    which raises `NoSourceError` once that relay offers it no longer."""

    async def acquire(
        self,
        version: int | None = None,
        *,
        ttl: float,
        holder: str,
        streaming: bool = False,
        host: str | None = None,
        exclude: Iterable[str] = (),
        publisher: str | None = None,
        part: str | None = None,
    ) -> Lease: ...
    async def offer(
        self,
        version: int,
        *,
        holder: str,
        host: str,
        descriptor: bytes,
        cap: int | None = None,
        landed: int | None = None,
        part: str | None = None,
        digests: Sequence[str] | None = None,
    ) -> None: ...
    async def mark_offer(self, version: int, landed: int, *, holder: str) -> None: ...
    async def withdraw(self, version: int, *, holder: str) -> None: ...
    async def readers_at(self, version: int, holder: str) -> int: ...
    async def wait_for_buckets(
        self,
        version: int,
        at_least: int,
        timeout: float | None = None,
        *,
        source: str | None = None,
        publisher: str | None = None,
    ) -> Progress: ...


@runtime_checkable
class SliceRelayingRegistry(RelayingRegistry, Protocol):
    """A `RelayingRegistry` that also relays tensor-parallel ranks' slices (every registry
    of weightpull's own does): a lease or offer names the slice's layout (`part=`, a
    `weightpull.slices.slice_key`), only readers of that layout are placed at its offers,
    and they check what they read against the digests the layout's first relay from the
    version's slot gave (`part_digests`)."""

    async def part_digests(self, version: int, part: str) -> tuple[str, ...] | None: ...


def as_streaming(registry: Registry) -> StreamingRegistry:
    """`registry`, for a publisher or puller made with `stream=True`: one that cannot
    stream is refused when they are made, naming it."""
    if not isinstance(registry, StreamingRegistry):
        raise InvalidArgumentError(f"{type(registry).__name__} cannot stream versions (stream=True)")
    return registry


class InProcessRegistry(OperationsClient):
    """The registry inside one process: the default, and what a served one wraps. Each
    operation is one call on its `machine`, made as `principal` (an admin by default:
    one process owns all it holds); only `wait_for_version` awaits.

    `as_principal(p)` gives a face on the same registry that acts as `p`, so one process
    can try the authority rules a served registry enforces. `liveness_ttl` makes it judge
    liveness too (a served registry does; in one process nobody dies alone, so off)."""

    def __init__(
        self,
        clock: Clock | None = None,
        *,
        max_ttl: float = DEFAULT_MAX_TTL,
        liveness_ttl: float | None = None,
        principal: Principal = ADMIN,
        machine: RegistryMachine | None = None,
    ) -> None:
        if not isinstance(principal, Principal):
            raise InvalidArgumentError(f"principal must be a Principal, got {principal!r}")
        self.clock: Clock = clock or MonotonicClock()
        self.machine = machine or RegistryMachine(self.clock, max_ttl=max_ttl, liveness_ttl=liveness_ttl)
        self.principal = principal
        self._waiters: InProcessRegistry = self  # whose event waiters wait on: one per machine
        self.machine.watch(self._wake)
        self._changed: anyio.Event | None = None  # made lazily: needs a running loop

    def as_principal(self, principal: Principal) -> InProcessRegistry:
        """This registry, acting as `principal` (its waiters wake with this one's)."""
        view = InProcessRegistry.__new__(InProcessRegistry)
        view.clock, view.machine, view.principal, view._waiters = self.clock, self.machine, principal, self._waiters
        return view

    @property
    def max_ttl(self) -> float:
        return self.machine.max_ttl

    async def _op(self, name: str, **values: Any) -> Any:
        """Each operation of the table (`OperationsClient`'s methods): one call on the
        machine as this face's principal, with the values as they are."""
        return operations.call(self.machine, name, values, by=self.principal)

    async def wait_for_buckets(
        self,
        version: int,
        at_least: int,
        timeout: float | None = None,
        *,
        source: str | None = None,
        publisher: str | None = None,
    ) -> Progress:
        """The version's progress once `at_least` of its buckets may be read (or it is
        READY); `VersionStateError` naming the reason if it ended otherwise, or was never
        streamed; `VersionWaitTimeoutError` after `timeout`. A version not begun yet,
        newer than every one begun, is waited for (a reader may ask before the trainer
        begins it); `VersionNotFoundError` once a later one began instead (in `publisher`'s
        line; None: the default line). With `source`
        (a relay's name), of that relay's copy (`RegistryMachine.progress`): woken by its
        marks, and `NoSourceError` once it offers the version no longer.
        `PublisherLapsedError` when the publisher of a version not begun yet lapses (one
        that lapses while it streams ends it ABORTED, as above)."""
        check_int("at_least", at_least)
        deadline = None if timeout is None else self.clock.now() + timeout
        while True:
            try:
                progress: Progress | None = self.machine.progress(version, source=source, by=self.principal)
            except VersionNotFoundError:
                if self.machine.begun(version, publisher):
                    raise
                progress = None
            if progress is not None:
                if progress.committed >= at_least or progress.state in (VersionState.READY, VersionState.RETIRED):
                    return progress
                if not progress.state.being_written:
                    why = f" ({progress.reason})" if progress.reason else ""
                    raise VersionStateError(f"version {version} is {progress.state}{why}: its stream ended unfinished")
            if progress is None:
                self._check_lapse(publisher, f"v{version}")
            remaining = None if deadline is None else deadline - self.clock.now()
            if remaining is not None and remaining <= 0:
                got = (
                    "not begun" if progress is None else f"{progress.committed} of {progress.buckets} buckets committed"
                )
                raise VersionWaitTimeoutError(f"v{version}: {got} within {timeout} s, not {at_least}")
            await within(self.clock, self._until_lapse(publisher, remaining), self._event().wait)

    async def wait_for_version(
        self, min_version: int, timeout: float | None = None, *, publisher: str | None = None
    ) -> Manifest:
        """The newest READY manifest of `publisher`'s line (None: the default line) once
        its version is at least `min_version`; `VersionWaitTimeoutError` after `timeout`,
        and `PublisherLapsedError` as soon as the line's publisher lapses (the registry's
        `liveness_ttl`), before or while it waits."""
        check_int("min_version", min_version)
        deadline = None if timeout is None else self.clock.now() + timeout
        while (newest := self.machine.newest_of(publisher)) is None or newest < min_version:
            self._check_lapse(publisher, f"a version >= {min_version}")
            remaining = None if deadline is None else deadline - self.clock.now()
            if remaining is not None and remaining <= 0:
                of = "" if publisher is None else f" of {publisher!r}"
                raise VersionWaitTimeoutError(
                    f"no version{of} >= {min_version} within {timeout} s (newest READY: {newest})"
                )
            await within(self.clock, self._until_lapse(publisher, remaining), self._event().wait)
        manifest = self.machine.newest(publisher=publisher)
        assert manifest is not None
        return manifest

    def _check_lapse(self, publisher: str | None, waits_for: str) -> None:
        """`PublisherLapsedError` if the publisher a wait on `publisher`'s line waits on lapsed."""
        name = self.machine.waited_on(publisher)
        if name is not None and self.machine.lapsed(name):
            raise PublisherLapsedError(
                f"publisher {name!r} lapsed (not heard from for {self.machine.liveness_ttl:g} s): {waits_for} "
                f"will not come from it; restart it (or check why it died), then wait again",
                publisher=name,
            )

    def _until_lapse(self, publisher: str | None, remaining: float | None) -> float | None:
        """How long a wait sleeps at most: `remaining`, or less, to wake when the
        publisher it waits on is due to lapse (a renewal then just sleeps again)."""
        name = self.machine.waited_on(publisher)
        due = None if name is None else self.machine.lapses_at(name)
        if due is None:
            return remaining
        until = max(0.0, due - self.clock.now())
        return until if remaining is None else min(remaining, until)

    async def aclose(self) -> None:
        """Nothing to release: it owns no task, and its waiters are their callers' own
        (closing wakes none). It keeps working afterwards, as a served client does:
        others (a server, other holders) may still rely on its versions and leases."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def _event(self) -> anyio.Event:
        waiters = self._waiters
        if waiters._changed is None:
            waiters._changed = anyio.Event()
        return waiters._changed

    def _wake(self) -> None:
        """Wake every waiter, whoever drove the machine to change."""
        if self._changed is not None:
            self._changed.set()
            self._changed = None


def connect_registry(address: str | None = None, **options: Any) -> Registry:
    """The registry at `address` (else at `$WEIGHTPULL_REGISTRY`), or, with neither, a new
    in-process one. `tcp://`, `ipc://` and `inproc://` addresses are served over ZeroMQ
    (the `service` extra; `options` go to its client: key, server_key, timeout, ...);
    `ray://NAME` is a registry in the named Ray actor NAME (the `verl` extra, which brings
    Ray). The client loads lazily.

    Use it as it comes (`aclose()` when done) or as `async with connect_registry(...) as
    registry:`, which also keeps a served client's heartbeat inside the block."""
    address = address or os.environ.get(REGISTRY_ENV) or None
    if address is None:
        return InProcessRegistry()
    target, extra, needs = (_RAY, "verl", "Ray") if address.startswith("ray://") else (_SERVED, "service", "pyzmq")
    try:
        client = plugins.load_builtin(plugins.REGISTRY_CLIENTS, target, "its client")
    except ImportError as exc:
        raise DriverUnavailableError(
            f"the registry at {address} needs {needs}: pip install 'weightpull[{extra}]' ({exc.__cause__ or exc})"
        ) from exc
    registry: Registry = client(address, **options)  # loaded by name, so typed here
    return registry
