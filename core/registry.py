"""The registry: the directory of published versions and the leases readers hold on them.

`InProcessRegistry` is the embedded default. It is sans-IO apart from waiting: every
decision is a synchronous step over the transition tables in `states.py`, and leases
are judged on the registry's own injected clock. A served registry implements the same
`Registry` protocol.

Retired versions take no new leases. Leases granted before a version retired stay
valid and renewable until released or expired, so reads in flight finish; refusing new
ones is what lets a retired slot drain and be reclaimed while readers keep polling.
"""

from __future__ import annotations

import importlib
import itertools
import os
import uuid
from typing import Any, Protocol, runtime_checkable

import anyio
import attrs

from .clock import Clock, MonotonicClock, within
from .errors import (
    DriverUnavailableError,
    InvalidArgumentError,
    LeaseExpiredError,
    LeaseNotFoundError,
    NoReadyVersionError,
    VersionInUseError,
    VersionNotFoundError,
    VersionOrderError,
    VersionStateError,
    VersionWaitTimeoutError,
)
from .manifest import Manifest
from .records import Lease, LeaseInfo, RegistryStatus, VersionInfo
from .sharding import check_shard
from .states import LeaseEvent, LeaseState, VersionEvent, VersionState, transition

DEFAULT_MAX_TTL = 600.0
_MAX_ENDED_LEASES = 256  # ended leases kept per version, for status and idempotent release
REGISTRY_ENV = "WEIGHTPULL_REGISTRY"  # the address of a served registry
_SERVED = "weightpull.drivers.zmq_registry.client:ZmqRegistry"


@runtime_checkable
class Registry(Protocol):
    """What publishers and pullers need from a registry, embedded or served."""

    async def begin(self, version: int, *, publisher: str, slot: int, shard: tuple[int, int] | None = None) -> None: ...
    async def commit(self, manifest: Manifest) -> None: ...
    async def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None: ...
    async def newest(self) -> Manifest | None: ...
    async def get(self, version: int) -> Manifest: ...
    async def acquire(self, version: int | None = None, *, ttl: float, holder: str) -> Lease: ...
    async def renew(self, lease: Lease) -> Lease: ...
    async def release(self, lease: Lease) -> None: ...
    async def is_valid(self, lease: Lease) -> bool: ...
    async def retire(self, version: int) -> None: ...
    async def reclaim(self, version: int) -> None: ...
    async def wait_for_version(self, min_version: int, timeout: float | None = None) -> Manifest: ...
    async def report_serving(self, replica: str, version: int) -> None: ...
    async def status(self) -> RegistryStatus: ...


@attrs.define
class _Lease:
    id: str
    version: int
    holder: str
    ttl: float
    expires_at: float
    state: LeaseState = LeaseState.ACTIVE

    def public(self) -> Lease:
        return Lease(self.id, self.version, self.holder, self.ttl, self.expires_at)


@attrs.define
class _Part:
    """One shard publisher's part of a sharded version: begun, then committed."""

    publisher: str
    slot: int
    manifest: Manifest | None = None


@attrs.define
class _Version:
    version: int
    publisher: str
    slot: int
    created_at: float
    state: VersionState = VersionState.WRITING
    manifest: Manifest | None = None
    reason: str = ""
    leases: dict[str, _Lease] = attrs.Factory(dict)
    shards: int = 0  # how many shard publishers write it; 0: one plain publisher
    parts: dict[int, _Part] = attrs.Factory(dict)  # shard index -> its part

    def slots(self) -> list[tuple[str, int]]:
        """(publisher, slot) of every slot that holds a part of it."""
        if self.shards:
            return [(p.publisher, p.slot) for p in self.parts.values()]
        return [(self.publisher, self.slot)]


def _check_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}")
    return value


class InProcessRegistry:
    """The registry inside one process: the default, and the state a served one wraps."""

    def __init__(self, clock: Clock | None = None, *, max_ttl: float = DEFAULT_MAX_TTL) -> None:
        self.clock: Clock = clock or MonotonicClock()
        self.max_ttl = max_ttl
        self._versions: dict[int, _Version] = {}
        self._lease_index: dict[str, int] = {}  # lease id -> version
        self._highest_begun = -1
        self._highest_announced = -1  # withdrawn or not: announced versions only go up
        self._newest_ready: int | None = None
        self._serving: dict[str, int] = {}
        # Lease ids are unique across registries: one from before a served registry
        # restarted is never mistaken for one granted since.
        self._lease_prefix = uuid.uuid4().hex[:12]
        self._lease_ids = itertools.count(1)
        self._committed: anyio.Event | None = None  # made lazily: needs a running loop

    # -- publishing ----------------------------------------------------------------------

    async def begin(self, version: int, *, publisher: str, slot: int, shard: tuple[int, int] | None = None) -> None:
        """Record `version` as WRITING into `slot`. Versions strictly increase, and a slot
        is only begun once the version it held was reclaimed.

        With `shard=(index, count)` the version is written by `count` shard publishers:
        the first to begin it creates it, the others join it while it is WRITING."""
        _check_int("version", version)
        _check_name("publisher", publisher)
        _check_int("slot", slot)
        index, count = check_shard(*shard) if shard is not None else (0, 0)
        record = self._versions.get(version)
        joining = shard is not None and record is not None and record.shards > 0
        if joining:
            assert record is not None
            if record.state is not VersionState.WRITING:
                raise VersionStateError(f"version {version} is {record.state} ({record.reason}); shard {index} cannot join it")
            if record.shards != count or index in record.parts:
                raise InvalidArgumentError(
                    f"shard {index} of {count} cannot join v{version}: it has {record.shards} shards, "
                    f"of which {sorted(record.parts)} began"
                )
        elif version <= self._highest_begun:
            raise VersionOrderError(
                f"version {version} must exceed every version begun before "
                f"(highest so far: {self._highest_begun})"
            )
        elif record is not None:  # a shard's abort came before any begin
            raise VersionStateError(f"version {version} is {record.state} ({record.reason}) before it began")
        for v in self._versions.values():
            if (publisher, slot) in v.slots():
                raise VersionInUseError(
                    f"slot {slot} of {publisher!r} still holds version {v.version} "
                    f"({v.state}); reclaim it before writing the slot again"
                )
        if joining:
            assert record is not None
            record.parts[index] = _Part(publisher, slot)
            return
        self._highest_begun = version
        record = self._versions[version] = _Version(version, publisher, slot, self.clock.now(), shards=count)
        if shard is not None:
            record.parts[index] = _Part(publisher, slot)

    async def commit(self, manifest: Manifest) -> None:
        """WRITING -> READY; the previous newest READY version retires. A sharded version
        takes each shard's commit, of a manifest naming that shard alone, and turns READY
        at the last one."""
        record = self._record(manifest.version)
        if record.shards:
            return self._commit_shard(record, manifest)
        if manifest.shards:
            raise InvalidArgumentError(f"v{manifest.version} was begun unsharded; its manifest names shards")
        if manifest.publisher != record.publisher or manifest.slot != record.slot:
            raise InvalidArgumentError(
                f"manifest for v{manifest.version} names publisher {manifest.publisher!r} "
                f"slot {manifest.slot}; it was begun by {record.publisher!r} slot {record.slot}"
            )
        if manifest.version < self._highest_announced:
            raise VersionOrderError(
                f"version {manifest.version} cannot be announced after {self._highest_announced}"
            )
        self._announce(record, manifest)

    def _announce(self, record: _Version, manifest: Manifest) -> None:
        self._move(record, VersionEvent.COMMIT)
        record.manifest = manifest
        self._highest_announced = manifest.version
        previous, self._newest_ready = self._newest_ready, manifest.version
        if previous is not None and self._versions[previous].state is VersionState.READY:
            self._move(self._versions[previous], VersionEvent.RETIRE)
        for old in [v for v in self._versions.values() if v.shards and v.version < manifest.version]:
            if not old.parts:  # an abort's tombstone: nobody may begin it now anyway
                del self._versions[old.version]
            elif old.state is VersionState.WRITING:  # it can never be READY now: free its shards' slots
                self._move(old, VersionEvent.ABORT)
                old.reason = f"superseded by v{manifest.version} before every shard committed"
        if self._committed is not None:
            self._committed.set()
            self._committed = None

    def _commit_shard(self, record: _Version, manifest: Manifest) -> None:
        version = manifest.version
        if len(manifest.shards) != 1:
            raise InvalidArgumentError(f"a shard commits a manifest naming itself alone; v{version}'s names {len(manifest.shards)}")
        shard = manifest.shards[0]
        part = record.parts.get(shard.index)
        if shard.count != record.shards or part is None or (part.publisher, part.slot) != (shard.publisher, shard.slot):
            raise InvalidArgumentError(
                f"shard {shard.index} of {shard.count} from {shard.publisher!r} slot {shard.slot} "
                f"was not begun for v{version}"
            )
        if record.state is not VersionState.WRITING:
            raise VersionStateError(f"version {version} is {record.state} ({record.reason}); shard {shard.index} cannot commit")
        if part.manifest is not None:
            raise InvalidArgumentError(f"shard {shard.index} of v{version} already committed")
        if version < self._highest_announced:
            raise VersionOrderError(f"version {version} cannot be announced after {self._highest_announced}")
        for other in record.parts.values():
            m = other.manifest
            if m is not None and (m.layout.signature, m.transport) != (manifest.layout.signature, manifest.transport):
                raise InvalidArgumentError(
                    f"shard {shard.index} of v{version} disagrees with shard {m.shards[0].index} on the layout or transport"
                )
        part.manifest = manifest
        committed = [p.manifest for _, p in sorted(record.parts.items()) if p.manifest is not None]
        if len(committed) < record.shards:
            return  # the version stays WRITING until its last shard commits
        try:
            whole = attrs.evolve(committed[0], shards=[m.shards[0] for m in committed])
        except InvalidArgumentError as exc:  # the shards do not tile the tensors: it can never be read
            self._move(record, VersionEvent.ABORT)
            record.reason = str(exc)
            raise
        self._announce(record, whole)

    async def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None:
        """WRITING -> ABORTED. Any shard may abort a sharded version, even before any
        shard began it (its siblings are then refused), and aborting it again does nothing."""
        if shard is not None:
            _, count = check_shard(*shard)
            if _check_int("version", version) not in self._versions:
                self._versions[version] = _Version(version, "", 0, self.clock.now(), VersionState.ABORTED,
                                                   reason=reason, shards=count)
                return
        record = self._record(version)
        if record.shards and record.state is VersionState.ABORTED:
            return
        self._move(record, VersionEvent.ABORT)
        record.reason = reason

    async def retire(self, version: int) -> None:
        """Withdraw a READY version: no new leases; those held stay valid."""
        record = self._record(version)
        self._move(record, VersionEvent.RETIRE)
        if self._newest_ready == version:
            self._newest_ready = None

    async def reclaim(self, version: int) -> None:
        """Give a RETIRED or ABORTED version's slot back to its publisher. Refused while
        any lease on it is alive; the newest READY version is never reclaimable. Of a
        sharded version, the first shard's reclaim drops it: its siblings then find it
        gone, which frees their slots too (no lease on it can ever be valid again)."""
        record = self._record(version)
        if record.shards and record.state is VersionState.WRITING:
            waiting = sorted(set(range(record.shards)) - {i for i, p in record.parts.items() if p.manifest})
            raise VersionInUseError(f"version {version} is WRITING: shards {waiting} have not committed")
        live = self._live_leases(record)
        if live:
            holders = ", ".join(sorted({lease.holder for lease in live}))
            raise VersionInUseError(f"version {version} is leased by {holders}")
        if record.state is VersionState.READY:
            raise VersionInUseError(f"version {version} is READY; retire it first")
        self._move(record, VersionEvent.RECLAIM)
        for lease_id in record.leases:
            self._lease_index.pop(lease_id, None)
        del self._versions[version]

    # -- reading -------------------------------------------------------------------------

    async def newest(self) -> Manifest | None:
        if self._newest_ready is None:
            return None
        return self._versions[self._newest_ready].manifest

    async def get(self, version: int) -> Manifest:
        record = self._record(version)
        if record.manifest is None:
            raise VersionStateError(f"version {version} is {record.state}: it has no manifest")
        return record.manifest

    async def acquire(self, version: int | None = None, *, ttl: float, holder: str) -> Lease:
        """Lease the newest READY version, or `version` if it is READY."""
        _check_name("holder", holder)
        if not isinstance(ttl, (int, float)) or not 0 < ttl <= self.max_ttl:
            raise InvalidArgumentError(f"ttl must be in (0, {self.max_ttl}] seconds, got {ttl!r}")
        if version is None:
            if self._newest_ready is None:
                raise NoReadyVersionError("no version is READY yet")
            version = self._newest_ready
        record = self._record(version)
        if record.state is not VersionState.READY:
            raise VersionStateError(
                f"version {version} is {record.state} and takes no new leases "
                f"(newest READY: {self._newest_ready})"
            )
        lease = _Lease(f"{self._lease_prefix}-{next(self._lease_ids)}", version, holder, float(ttl), self.clock.now() + ttl)
        self._prune(record)
        record.leases[lease.id] = lease
        self._lease_index[lease.id] = version
        return lease.public()

    async def renew(self, lease: Lease) -> Lease:
        record = self._lease(lease)
        if record is None:
            raise LeaseNotFoundError(f"lease {lease.id} on v{lease.version} is unknown")
        if self._expired(record):
            raise LeaseExpiredError(
                f"lease {lease.id} of {record.holder!r} on v{record.version} expired"
            )
        record.state = transition("lease", record.state, LeaseEvent.RENEW, f"{lease.id}")
        record.expires_at = self.clock.now() + record.ttl
        return record.public()

    async def release(self, lease: Lease) -> None:
        """End a lease. Idempotent: releasing an ended or forgotten lease does nothing."""
        record = self._lease(lease)
        if record is not None and not self._expired(record) and record.state is LeaseState.ACTIVE:
            record.state = transition("lease", record.state, LeaseEvent.RELEASE, f"{lease.id}")

    async def is_valid(self, lease: Lease) -> bool:
        record = self._lease(lease)
        return record is not None and not self._expired(record) and record.state is LeaseState.ACTIVE

    async def wait_for_version(self, min_version: int, timeout: float | None = None) -> Manifest:
        """The newest READY manifest once its version is at least `min_version`."""
        _check_int("min_version", min_version)
        deadline = None if timeout is None else self.clock.now() + timeout
        while self._newest_ready is None or self._newest_ready < min_version:
            if self._committed is None:
                self._committed = anyio.Event()
            remaining = None if deadline is None else deadline - self.clock.now()
            if remaining is not None and remaining <= 0:
                raise VersionWaitTimeoutError(
                    f"no version >= {min_version} within {timeout} s "
                    f"(newest READY: {self._newest_ready})"
                )
            await within(self.clock, remaining, self._committed.wait)
        manifest = await self.newest()
        assert manifest is not None
        return manifest

    # -- replicas and status -------------------------------------------------------------

    async def report_serving(self, replica: str, version: int) -> None:
        self._serving[_check_name("replica", replica)] = _check_int("version", version)

    async def status(self) -> RegistryStatus:
        now = self.clock.now()
        versions, leases = [], []
        for record in sorted(self._versions.values(), key=lambda r: r.version):
            live = self._live_leases(record)
            versions.append(
                VersionInfo(
                    version=record.version,
                    state=record.state,
                    publisher=record.publisher,
                    slot=record.slot,
                    nbytes=record.manifest.nbytes if record.manifest else None,
                    age=now - record.created_at,
                    live_leases=len(live),
                    reason=record.reason,
                )
            )
            leases += [LeaseInfo(x.id, x.version, x.holder, x.expires_at - now) for x in live]
        return RegistryStatus(self._newest_ready, tuple(versions), tuple(leases), dict(self._serving))

    # -- internals -----------------------------------------------------------------------

    def _record(self, version: int) -> _Version:
        _check_int("version", version)
        try:
            return self._versions[version]
        except KeyError:
            raise VersionNotFoundError(
                f"version {version} is unknown (never begun, or reclaimed)"
            ) from None

    def _move(self, record: _Version, event: VersionEvent) -> None:
        record.state = transition("version", record.state, event, f"v{record.version}")

    def _lease(self, lease: Lease) -> _Lease | None:
        version = self._lease_index.get(lease.id)
        if version is None or version != lease.version:
            return None
        return self._versions[version].leases.get(lease.id)

    def _expired(self, lease: _Lease) -> bool:
        """Judge the lease on the registry's clock, recording expiry when it is seen."""
        if lease.state is LeaseState.ACTIVE and self.clock.now() >= lease.expires_at:
            lease.state = transition("lease", lease.state, LeaseEvent.EXPIRE, lease.id)
        return lease.state is LeaseState.EXPIRED

    def _live_leases(self, record: _Version) -> list[_Lease]:
        return [x for x in record.leases.values() if not self._expired(x) and x.state is LeaseState.ACTIVE]

    def _prune(self, record: _Version) -> None:
        ended = [i for i, x in record.leases.items() if x.state is not LeaseState.ACTIVE or self._expired(x)]
        for lease_id in ended[: max(0, len(ended) - _MAX_ENDED_LEASES)]:
            del record.leases[lease_id]
            del self._lease_index[lease_id]


def connect_registry(address: str | None = None, **options: Any) -> Registry:
    """The registry served at `address` (else at `$WEIGHTPULL_REGISTRY`), or, with
    neither, a new in-process one. `options` go to the served registry's client (secret,
    timeout, ...). The client loads lazily: it needs pyzmq, the `service` extra."""
    address = address or os.environ.get(REGISTRY_ENV) or None
    if address is None:
        return InProcessRegistry()
    module, _, name = _SERVED.partition(":")
    try:
        client = getattr(importlib.import_module(module), name)
    except ImportError as exc:
        raise DriverUnavailableError(
            f"the registry at {address} is served over ZeroMQ, which needs pyzmq: "
            f"pip install 'weightpull[service]' ({exc})"
        ) from exc
    return client(address, **options)
