"""The registry's decisions, as a synchronous state machine: no I/O, no awaits.

`RegistryMachine` holds the versions and the leases on them and decides every operation
in one plain call, over the transition tables in `states.py`. Time is read only from the
injected clock's `now()`, so leases are judged on the registry's clock and a fake one
drives it in tests. Since no call can be interrupted, whoever drives it (the in-process
registry, the ZeroMQ server, a fuzzer) gets each operation whole, with no lock.

Retired versions take no new leases. Leases granted before a version retired stay
valid and renewable until released or expired, so reads in flight finish; refusing new
ones is what lets a retired slot drain and be reclaimed while readers keep polling.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable
from typing import Protocol

import attrs

from .errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    LeaseNotFoundError,
    NoReadyVersionError,
    VersionInUseError,
    VersionNotFoundError,
    VersionOrderError,
    VersionStateError,
)
from .manifest import Manifest
from .records import Lease, LeaseInfo, RegistryStatus, VersionInfo
from .shard_assembly import ShardAssembly
from .sharding import check_shard
from .states import LEASE, VERSION, LeaseEvent, LeaseState, VersionEvent, VersionState

DEFAULT_MAX_TTL = 600.0
_MAX_ENDED_LEASES = 256  # ended leases kept per version, for status and idempotent release


class Now(Protocol):
    """All the machine needs of a clock (a `Clock`, a `FakeClock`)."""

    def now(self) -> float: ...


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
class _Version:
    version: int
    publisher: str
    slot: int
    created_at: float
    state: VersionState = VersionState.WRITING
    manifest: Manifest | None = None
    reason: str = ""
    leases: dict[str, _Lease] = attrs.Factory(dict)
    shards: ShardAssembly | None = None  # None: one plain publisher writes it

    def slots(self) -> list[tuple[str, int]]:
        """(publisher, slot) of every slot that holds a part of it."""
        return self.shards.slots() if self.shards is not None else [(self.publisher, self.slot)]


def check_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, got {value!r}")
    return value


def check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}")
    return value


class RegistryMachine:
    """Every decision of the registry, one synchronous call each. Methods and errors are
    those of the `Registry` protocol, less `wait_for_version` (waiting is I/O: `watch`
    tells a waiter when a version is announced)."""

    def __init__(self, clock: Now, *, max_ttl: float = DEFAULT_MAX_TTL) -> None:
        self.clock = clock
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
        self._watchers: list[Callable[[], None]] = []

    @property
    def newest_ready(self) -> int | None:
        return self._newest_ready

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback()` after each version is announced (made the newest READY)."""
        self._watchers.append(callback)

    # -- publishing ----------------------------------------------------------------------

    def begin(self, version: int, *, publisher: str, slot: int, shard: tuple[int, int] | None = None) -> None:
        """Record `version` as WRITING into `slot`. Versions strictly increase, and a slot
        is only begun once the version it held was reclaimed.

        With `shard=(index, count)` the version is written by `count` shard publishers:
        the first to begin it creates it, the others join it while it is WRITING."""
        check_int("version", version)
        check_name("publisher", publisher)
        check_int("slot", slot)
        index, count = check_shard(*shard) if shard is not None else (0, 0)
        record = self._versions.get(version)
        joining = record.shards if record is not None and shard is not None else None  # of a sharded version
        if record is not None and joining is not None:
            if record.state is not VersionState.WRITING:
                raise VersionStateError(
                    f"version {version} is {record.state} ({record.reason}); shard {index} cannot join it"
                )
            joining.check_join(index, count)
        elif version <= self._highest_begun:
            raise VersionOrderError(
                f"version {version} must exceed every version begun before (highest so far: {self._highest_begun})"
            )
        elif record is not None:  # a shard's abort came before any begin
            raise VersionStateError(f"version {version} is {record.state} ({record.reason}) before it began")
        for v in self._versions.values():
            if (publisher, slot) in v.slots():
                raise VersionInUseError(
                    f"slot {slot} of {publisher!r} still holds version {v.version} "
                    f"({v.state}); reclaim it before writing the slot again"
                )
        if joining is not None:
            joining.join(index, publisher, slot)
            return
        self._highest_begun = version
        shards = None
        if shard is not None:
            shards = ShardAssembly(version, count)
            shards.join(index, publisher, slot)
        self._versions[version] = _Version(version, publisher, slot, self.clock.now(), shards=shards)

    def commit(self, manifest: Manifest) -> None:
        """WRITING -> READY; the previous newest READY version retires. A sharded version
        takes each shard's commit, of a manifest naming that shard alone, and turns READY
        at the last one."""
        record = self._record(manifest.version)
        if record.shards is not None:
            if record.shards.commit(
                manifest, state=record.state, reason=record.reason, announced=self._highest_announced
            ):
                try:
                    whole = record.shards.whole()
                except InvalidArgumentError as exc:  # the shards do not tile the tensors: it can never be read
                    self._move(record, VersionEvent.ABORT)
                    record.reason = str(exc)
                    raise
                self._announce(record, whole)
            return  # else the version stays WRITING until its last shard commits
        if manifest.shards:
            raise InvalidArgumentError(f"v{manifest.version} was begun unsharded; its manifest names shards")
        if manifest.publisher != record.publisher or manifest.slot != record.slot:
            raise InvalidArgumentError(
                f"manifest for v{manifest.version} names publisher {manifest.publisher!r} "
                f"slot {manifest.slot}; it was begun by {record.publisher!r} slot {record.slot}"
            )
        if manifest.version < self._highest_announced:
            raise VersionOrderError(f"version {manifest.version} cannot be announced after {self._highest_announced}")
        self._announce(record, manifest)

    def _announce(self, record: _Version, manifest: Manifest) -> None:
        self._move(record, VersionEvent.COMMIT)
        record.manifest = manifest
        self._highest_announced = manifest.version
        previous, self._newest_ready = self._newest_ready, manifest.version
        if previous is not None and self._versions[previous].state is VersionState.READY:
            self._move(self._versions[previous], VersionEvent.RETIRE)
        for old in [v for v in self._versions.values() if v.shards is not None and v.version < manifest.version]:
            assert old.shards is not None  # for the type checker
            if not old.shards.began:  # an abort's tombstone: nobody may begin it now anyway
                del self._versions[old.version]
            elif old.state is VersionState.WRITING:  # it can never be READY now: free its shards' slots
                self._move(old, VersionEvent.ABORT)
                old.reason = f"superseded by v{manifest.version} before every shard committed"
        for callback in self._watchers:
            callback()

    def abort(self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None) -> None:
        """WRITING -> ABORTED. Any shard may abort a sharded version, even before any
        shard began it (its siblings are then refused), and aborting it again does nothing."""
        if shard is not None:
            _, count = check_shard(*shard)
            if check_int("version", version) not in self._versions:
                self._versions[version] = _Version(
                    version,
                    "",
                    0,
                    self.clock.now(),
                    VersionState.ABORTED,
                    reason=reason,
                    shards=ShardAssembly(version, count),
                )
                return
        record = self._record(version)
        if record.shards is not None and record.state is VersionState.ABORTED:
            return
        self._move(record, VersionEvent.ABORT)
        record.reason = reason

    def retire(self, version: int) -> None:
        """Withdraw a READY version: no new leases; those held stay valid."""
        record = self._record(version)
        self._move(record, VersionEvent.RETIRE)
        if self._newest_ready == version:
            self._newest_ready = None

    def reclaim(self, version: int) -> None:
        """Give a RETIRED or ABORTED version's slot back to its publisher. Refused while
        any lease on it is alive; the newest READY version is never reclaimable. Of a
        sharded version, the first shard's reclaim drops it: its siblings then find it
        gone, which frees their slots too (no lease on it can ever be valid again)."""
        record = self._record(version)
        if record.shards is not None and record.state is VersionState.WRITING:
            raise VersionInUseError(
                f"version {version} is WRITING: shards {record.shards.waiting()} have not committed"
            )
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

    def newest(self) -> Manifest | None:
        if self._newest_ready is None:
            return None
        return self._versions[self._newest_ready].manifest

    def get(self, version: int) -> Manifest:
        record = self._record(version)
        if record.manifest is None:
            raise VersionStateError(f"version {version} is {record.state}: it has no manifest")
        return record.manifest

    def acquire(self, version: int | None = None, *, ttl: float, holder: str) -> Lease:
        """Lease the newest READY version, or `version` if it is READY."""
        check_name("holder", holder)
        if not isinstance(ttl, (int, float)) or not 0 < ttl <= self.max_ttl:
            raise InvalidArgumentError(f"ttl must be in (0, {self.max_ttl}] seconds, got {ttl!r}")
        if version is None:
            if self._newest_ready is None:
                raise NoReadyVersionError("no version is READY yet")
            version = self._newest_ready
        record = self._record(version)
        if record.state is not VersionState.READY:
            raise VersionStateError(
                f"version {version} is {record.state} and takes no new leases (newest READY: {self._newest_ready})"
            )
        lease = _Lease(
            f"{self._lease_prefix}-{next(self._lease_ids)}", version, holder, float(ttl), self.clock.now() + ttl
        )
        self._prune(record)
        record.leases[lease.id] = lease
        self._lease_index[lease.id] = version
        return lease.public()

    def renew(self, lease: Lease) -> Lease:
        record = self._lease(lease)
        if record is None:
            raise LeaseNotFoundError(f"lease {lease.id} on v{lease.version} is unknown")
        if self._expired(record):
            raise LeaseExpiredError(f"lease {lease.id} of {record.holder!r} on v{record.version} expired")
        record.state = LEASE.fire(record.state, LeaseEvent.RENEW, f"{lease.id}")
        record.expires_at = self.clock.now() + record.ttl
        return record.public()

    def release(self, lease: Lease) -> None:
        """End a lease. Idempotent: releasing an ended or forgotten lease does nothing."""
        record = self._lease(lease)
        if record is not None and not self._expired(record) and record.state is LeaseState.ACTIVE:
            record.state = LEASE.fire(record.state, LeaseEvent.RELEASE, f"{lease.id}")

    def is_valid(self, lease: Lease) -> bool:
        record = self._lease(lease)
        return record is not None and not self._expired(record) and record.state is LeaseState.ACTIVE

    # -- replicas and status -------------------------------------------------------------

    def report_serving(self, replica: str, version: int) -> None:
        self._serving[check_name("replica", replica)] = check_int("version", version)

    def status(self) -> RegistryStatus:
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
        check_int("version", version)
        try:
            return self._versions[version]
        except KeyError:
            raise VersionNotFoundError(f"version {version} is unknown (never begun, or reclaimed)") from None

    def _move(self, record: _Version, event: VersionEvent) -> None:
        record.state = VERSION.fire(record.state, event, f"v{record.version}")

    def _lease(self, lease: Lease) -> _Lease | None:
        version = self._lease_index.get(lease.id)
        if version is None or version != lease.version:
            return None
        return self._versions[version].leases.get(lease.id)

    def _expired(self, lease: _Lease) -> bool:
        """Judge the lease on the registry's clock, recording expiry when it is seen."""
        if lease.state is LeaseState.ACTIVE and self.clock.now() >= lease.expires_at:
            lease.state = LEASE.fire(lease.state, LeaseEvent.EXPIRE, lease.id)
        return lease.state is LeaseState.EXPIRED

    def _live_leases(self, record: _Version) -> list[_Lease]:
        return [x for x in record.leases.values() if not self._expired(x) and x.state is LeaseState.ACTIVE]

    def _prune(self, record: _Version) -> None:
        ended = [i for i, x in record.leases.items() if x.state is not LeaseState.ACTIVE or self._expired(x)]
        for lease_id in ended[: max(0, len(ended) - _MAX_ENDED_LEASES)]:
            del record.leases[lease_id]
            del self._lease_index[lease_id]
