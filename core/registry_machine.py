"""The registry's decisions, as a synchronous state machine: no I/O, no awaits.

`RegistryMachine` holds the versions and the leases on them and decides every operation
in one plain call, over the transition tables in `states.py`. Time is read only from the
injected clock's `now()`, so leases are judged on the registry's clock and a fake one
drives it in tests. Since no call can be interrupted, whoever drives it (the in-process
registry, the ZeroMQ server, a fuzzer) gets each operation whole, with no lock.

Retired versions take no new leases. Leases granted before a version retired stay
valid and renewable until released or expired, so reads in flight finish; refusing new
ones is what lets a retired slot drain and be reclaimed while readers keep polling.

Authority: every operation names the principal that asks (`by`, principals.py) and is
checked here, so an embedded registry, the server and the fuzzer enforce one set of rules.
A version belongs to the principal that began it (its *owner*: a publisher's name, or for
an admin the first part of the publisher name it wrote under); a lease to the owner of its
holder name; a serving report to the owner of its replica name. Only the owner, or an
admin, acts on them; a lease id alone authorizes nothing. The registry numbers versions:
a publisher asks for a number (its step, say) and gets it when it is still free, else
the next free one, so no other principal can make its next version fail.

Lines: each owner's versions form a line of their own, which its readers follow. A
line's newest READY version is retired only by a newer one of the same line (or by its
owner, an admin, or its owner's lapse), its numbers go up only by its own begins, and
its announcements are ordered among themselves alone: no other principal can make the
line's readers lose its newest version or read another's in its place. A reader names
the line it follows (`publisher=`, an owner's name); one that names none follows the
registry's default line: of the lines with a READY version, the one that announced last
(every version's line, where one principal publishes). The shards of one version are
one line: an admin (an embedded registry's process) that writes them under names of
several roots keeps them in the line of the first, from then on.

Liveness (with `liveness_ttl`): every principal that is heard from (any operation, or a
`keepalive` naming the names it owns) stays alive for `liveness_ttl` seconds. When a
publisher lapses, its WRITING versions end ABORTED and its READY version is withdrawn
(RETIRED), each with the reason; when a reader lapses, its serving reports go.
"""

from __future__ import annotations

import collections
import itertools
import logging
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import NoReturn, Protocol

import attrs

from .digests import check_servable
from .errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    LeaseNotFoundError,
    NoReadyVersionError,
    NoSourceError,
    PermissionDeniedError,
    VersionInUseError,
    VersionNotFoundError,
    VersionOrderError,
    VersionStateError,
)
from .manifest import Manifest
from .principals import ADMIN, Principal, Role, root
from .records import (
    LapseInfo,
    Lease,
    LeaseInfo,
    OfferInfo,
    Progress,
    PullInfo,
    PullReport,
    RegistryStatus,
    Reservation,
    VersionInfo,
)
from .relays import ORIGIN, Offer, RelayBook, check_part
from .shard_assembly import ShardAssembly
from .sharding import check_shard
from .sources import Reader
from .states import LEASE, VERSION, LeaseEvent, LeaseState, VersionEvent, VersionState

log = logging.getLogger("weightpull.registry")

DEFAULT_MAX_TTL = 600.0
MAX_VERSION = 2**63 - 1  # versions fit a signed 64-bit integer wherever they are stored
MAX_VERSION_JUMP = 2**32  # how far past the highest version a non-admin may ask to begin
MAX_RESERVED_SLOTS = 64  # slots one publisher may reserve ahead
MAX_RESERVATIONS = 1024  # publishers with a reservation at once: the table cannot grow without bound
# Versions one principal may hold unreclaimed (an admin, trusted, is not bounded): the table
# cannot grow without bound, and no principal can hold many numbers another line asks for.
MAX_HELD_VERSIONS = 128
# The numbers of the versions reclaimed last are given to no line: a reader that knew a
# number from one line (a manifest it kept, a version its agent chose) never leases another
# line's under it. Lines number on their own, so only this keeps numbers from coming back.
QUARANTINED_NUMBERS = 1024
_MAX_ENDED_LEASES = 256  # ended leases kept per version, for status and idempotent release
LAPSE_WINDOW = 600.0  # seconds a lapse stays in the status
MAX_LAPSES = 64  # lapses the status keeps at most: the table cannot grow without bound
MAX_SOURCE_NAME = 256  # a pull report's source name, at most


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
    source: str = ""  # a relay's holder name; "": the version's own slot
    descriptor: bytes = b""

    def public(self) -> Lease:
        return Lease(self.id, self.version, self.holder, self.ttl, self.expires_at, self.source, self.descriptor)


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
    owner: str = ""  # the principal name it belongs to
    asked: int = -1  # the number its publisher asked for (shards of one version ask alike)
    committed: int = 0  # of a STREAMING version: buckets readers may read

    def slots(self) -> list[tuple[str, int]]:
        """(publisher, slot) of every slot that holds a part of it."""
        return self.shards.slots() if self.shards is not None else [(self.publisher, self.slot)]


@attrs.define
class _Line:
    """One owner's line of versions: what its readers follow."""

    owner: str
    highest_begun: int = -1
    highest_announced: int = -1  # withdrawn or not: a line's announcements only go up
    newest: int | None = None  # its newest READY version
    announced_at: int = 0  # the registry's count of announcements when it last announced
    begun_at: int = 0  # the registry's count of begins when it last began


def check_int(what: str, value: object) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"{what} must be a non-negative int, got {value!r}")
    return value


def _delta_of(manifest: Manifest | None) -> tuple[int, int] | None:
    """(base, section bytes) of a manifest's delta, as the status shows it; None without one."""
    delta = None if manifest is None else manifest.delta
    return None if delta is None else (delta.base, delta.nbytes)


def _check_pull(pull: object) -> None:
    if not isinstance(pull, PullReport):
        raise InvalidArgumentError(f"pull must be a PullReport, got {type(pull).__name__}")
    if not (isinstance(pull.seconds, (int, float)) and 0 <= pull.seconds < 1e18):
        raise InvalidArgumentError(f"a pull's seconds must be a number >= 0, got {pull.seconds!r}")
    check_int("a pull's nbytes", pull.nbytes)
    if not isinstance(pull.source, str) or len(pull.source) > MAX_SOURCE_NAME:
        raise InvalidArgumentError(f"a pull's source must be a name of at most {MAX_SOURCE_NAME} characters")


def check_name(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"{what} must be a non-empty string, got {value!r}")
    return value


class RegistryMachine:
    """Every decision of the registry, one synchronous call each. Methods and errors are
    those of the `Registry` protocol, less `wait_for_version` (waiting is I/O: `watch`
    tells a waiter when a version is announced), plus `by`: the principal that asks
    (an admin when left out, as an embedded registry's own process is)."""

    def __init__(self, clock: Now, *, max_ttl: float = DEFAULT_MAX_TTL, liveness_ttl: float | None = None) -> None:
        if liveness_ttl is not None and not (isinstance(liveness_ttl, (int, float)) and liveness_ttl > 0):
            raise InvalidArgumentError(f"liveness_ttl must be positive seconds or None, got {liveness_ttl!r}")
        self.clock = clock
        self.max_ttl = max_ttl
        self.liveness_ttl = liveness_ttl
        self._versions: dict[int, _Version] = {}
        self._lease_index: dict[str, int] = {}  # lease id -> version
        self._lines: dict[str, _Line] = {}  # owner -> its line
        # An admin's shard publisher of one root that joined a version of another's line -> that line
        self._joined: dict[str, str] = {}
        self._dropped: collections.deque[int] = collections.deque(maxlen=QUARANTINED_NUMBERS)
        self._quarantined: set[int] = set()  # the same, to look up
        self._begins = itertools.count(1)
        self._announcements = itertools.count(1)
        self._serving: dict[str, int] = {}
        self._alive: dict[str, float] = {}  # principal name -> when its liveness lapses
        self._lapsed: set[str] = set()  # those whose lapse was acted on
        # Lapses lately, for the status: (name, when, what it ended), oldest first.
        self._lapses: collections.deque[tuple[str, float, tuple[str, ...]]] = collections.deque(maxlen=MAX_LAPSES)
        self._pulls: dict[str, tuple[int, float, PullReport]] = {}  # replica -> (version, when, its last pull)
        # Lease ids are unique across registries: one from before a served registry
        # restarted is never mistaken for one granted since.
        self._lease_prefix = uuid.uuid4().hex[:12]
        self._lease_ids = itertools.count(1)
        self._watchers: list[Callable[[], None]] = []
        self.relays = RelayBook()  # replicas' offers to serve versions, and leases placed at them
        self._reservations: dict[str, Reservation] = {}  # publisher -> its slots, registered ahead

    @property
    def newest_ready(self) -> int | None:
        """The default line's newest READY version."""
        return self.newest_of(None)

    def newest_of(self, publisher: str | None) -> int | None:
        """The newest READY version of `publisher`'s line (None: the default line)."""
        self._sweep()
        line = self._follow(publisher)
        return None if line is None else line.newest

    def begun(self, version: int, publisher: str | None = None) -> bool:
        """Whether `version`, or a later one, was begun in `publisher`'s line (None: the
        default line): a line's numbers only go up, so a version not begun by then never
        will be in it."""
        line = self._follow(publisher)
        return line is not None and version <= line.highest_begun

    def _follow(self, publisher: str | None) -> _Line | None:
        """The line a reader follows: `publisher`'s, or the default line (of those with a
        READY version, the one that announced last; while none has one, the one that
        announced, else began, last)."""
        if publisher is not None:
            return self._lines.get(check_name("publisher", publisher))
        ready = [line for line in self._lines.values() if line.newest is not None]
        return max(ready or self._lines.values(), key=lambda line: (line.announced_at, line.begun_at), default=None)

    def _joined_line(self, name: str) -> str:
        """The line an admin's versions under `name` go to: its own, or, once its shards
        joined a version of another's line (the ranks of one trainer named apart), that one."""
        seen = {name}
        while (name := self._joined.get(name, name)) not in seen:
            seen.add(name)
        return name

    def _line(self, owner: str) -> _Line:
        line = self._lines.get(owner)
        if line is None:
            line = self._lines[owner] = _Line(owner)
        return line

    def _line_of(self, record: _Version) -> _Line:
        return self._line(record.owner)

    def watch(self, callback: Callable[[], None]) -> None:
        """Call `callback()` whenever what a waiter waits on may have changed: a version
        announced, a stream's buckets marked, a version ended."""
        self._watchers.append(callback)

    def _changed(self) -> None:
        for callback in self._watchers:
            callback()

    # -- publishing ----------------------------------------------------------------------

    def begin(
        self,
        version: int | None = None,
        *,
        publisher: str,
        slot: int,
        shard: tuple[int, int] | None = None,
        by: Principal = ADMIN,
    ) -> int:
        """Record a version as WRITING into `slot`; return its number. `version` is the
        number asked for (None: the next): it is given when it exceeds every version begun
        and is free, else the next free number (another principal's versions took it, or a
        restarted publisher asks again from its start). A slot is only begun once the
        version it held was reclaimed.

        With `shard=(index, count)` the version is written by `count` shard publishers of
        one principal asking for the same number: the first to begin it creates it, the
        others join it while it is WRITING."""
        self._enter(by, "begin")
        check_name("publisher", publisher)
        check_int("slot", slot)
        asked = None if version is None else check_int("version", version)
        index, count = check_shard(*shard) if shard is not None else (0, 0)
        owner = self._check_publisher(by, "begin", publisher)
        if by.is_admin:
            owner = self._joined_line(owner)
        self._touch(owner)  # an admin's publisher has liveness too, from its first begin
        joining = None if shard is None or asked is None else self._find_sharded(None if by.is_admin else owner, asked)
        if joining is not None:
            assert joining.shards is not None
            if by.is_admin and joining.owner != owner:  # shards of one version are one line, from now on
                self._joined[owner] = joining.owner
            if joining.state is not VersionState.WRITING:
                raise VersionStateError(
                    f"version {joining.version} is {joining.state} ({joining.reason}); shard {index} cannot join it"
                )
            joining.shards.check_join(index, count)
        if joining is None and not by.is_admin:
            held = sum(1 for v in self._versions.values() if v.owner == owner)
            if held >= MAX_HELD_VERSIONS:
                raise InvalidArgumentError(
                    f"{owner!r} holds {held} versions not reclaimed, the most one principal may: reclaim some first"
                )
        number = joining.version if joining is not None else self._number(asked, by, owner)
        for v in self._versions.values():
            if (publisher, slot) in v.slots():
                raise VersionInUseError(
                    f"slot {slot} of {publisher!r} still holds version {v.version} "
                    f"({v.state}); reclaim it before writing the slot again"
                )
        if joining is not None:
            assert joining.shards is not None
            joining.shards.join(index, publisher, slot)
            return number
        line = self._line(owner)
        line.highest_begun, line.begun_at = number, next(self._begins)
        shards = None
        if shard is not None:
            shards = ShardAssembly(number, count)
            shards.join(index, publisher, slot)
        self._versions[number] = _Version(
            number,
            publisher,
            slot,
            self.clock.now(),
            shards=shards,
            owner=owner,
            asked=number if asked is None else asked,
        )
        return number

    def commit(self, manifest: Manifest, *, by: Principal = ADMIN) -> None:
        """WRITING -> READY; the previous newest READY version retires. A sharded version
        takes each shard's commit, of a manifest naming that shard alone, and turns READY
        at the last one."""
        self._enter(by, "commit")
        record = self._record(manifest.version)
        self._check_owner(by, record, "commit")
        self._check_publisher(by, "commit", manifest.publisher)
        if record.shards is not None:
            if record.shards.commit(
                manifest, state=record.state, reason=record.reason, announced=self._line_of(record).highest_announced
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
        self._check_manifest(record, manifest)
        if record.state is VersionState.STREAMING and attrs.evolve(manifest, digests=None) != record.manifest:
            raise InvalidArgumentError(
                f"v{manifest.version} commits a manifest other than the one it streamed (only digests may come now)"
            )
        self._announce(record, manifest)

    def commit_stream(self, version: int, digests: Sequence[str] | None = None, *, by: Principal = ADMIN) -> None:
        """STREAMING -> READY: `commit` of the manifest `stream` gave (with the digests the
        publisher computed meanwhile, if any), without sending it again: a large model's
        manifest costs milliseconds each way, on the path to serving."""
        self._enter(by, "commit_stream")
        record = self._record(version)
        self._check_owner(by, record, "commit_stream")
        if record.state is not VersionState.STREAMING or record.manifest is None:
            why = f" ({record.reason})" if record.reason else ""
            raise VersionStateError(
                f"version {version} is {record.state}{why}: only a STREAMING one commits its stream"
            )
        manifest = record.manifest if digests is None else attrs.evolve(record.manifest, digests=digests)
        self._check_manifest(record, manifest)
        self._announce(record, manifest)

    def _check_manifest(self, record: _Version, manifest: Manifest) -> None:
        if manifest.publisher != record.publisher or manifest.slot != record.slot:
            raise InvalidArgumentError(
                f"manifest for v{manifest.version} names publisher {manifest.publisher!r} "
                f"slot {manifest.slot}; it was begun by {record.publisher!r} slot {record.slot}"
            )
        announced = self._line_of(record).highest_announced
        if manifest.version < announced:
            raise VersionOrderError(
                f"version {manifest.version} cannot be announced after {announced} of {record.owner!r}"
            )

    def stream(self, manifest: Manifest, *, by: Principal = ADMIN) -> None:
        """WRITING -> STREAMING: the version's manifest (digests, if any, come with its
        commit), so that readers who opt in may lease it and read buckets as `mark`
        commits them. A sharded version does not stream."""
        self._enter(by, "stream")
        record = self._record(manifest.version)
        self._check_owner(by, record, "stream")
        self._check_publisher(by, "stream", manifest.publisher)
        if record.shards is not None or manifest.shards:
            raise InvalidArgumentError(f"v{manifest.version} is sharded: sharded versions do not stream")
        if manifest.digests is not None:
            raise InvalidArgumentError(f"v{manifest.version}: a stream's digests come with its commit, not before")
        self._check_manifest(record, manifest)
        self._move(record, VersionEvent.STREAM)
        record.manifest = manifest
        self._changed()

    def mark(self, version: int, committed: int, *, by: Principal = ADMIN) -> None:
        """Of a STREAMING version, the first `committed` buckets are copied and fenced:
        readers may read them. The count only grows."""
        self._enter(by, "mark")
        record = self._record(version)
        self._check_owner(by, record, "mark")
        check_int("committed", committed)
        if record.state is not VersionState.STREAMING or record.manifest is None:
            why = f" ({record.reason})" if record.reason else ""
            raise VersionStateError(f"version {version} is {record.state}{why}: only a STREAMING one takes marks")
        total = len(record.manifest.layout.buckets)
        if not record.committed <= committed <= total:
            raise InvalidArgumentError(
                f"v{version}: {committed} buckets committed is not between the {record.committed} "
                f"marked before and its {total} buckets"
            )
        self._move(record, VersionEvent.MARK)
        record.committed = committed
        self._changed()

    def progress(self, version: int, *, source: str | None = None, by: Principal = ADMIN) -> Progress:
        """How many of the version's buckets may be read now. With `source` (a lease's:
        a relay's holder name), how many may be read from that relay's mirror: the
        buckets it holds, READY only once it holds every one of a READY version.
        `NoSourceError` when that relay offers the version no longer (withdrawn, its
        liveness lapsed): its readers must read it afresh elsewhere."""
        self._enter(by, "progress")
        record = self._record(version)
        total = len(record.manifest.layout.buckets) if record.manifest is not None else 0
        if record.state in (VersionState.READY, VersionState.RETIRED):
            committed = total
        elif record.state is VersionState.STREAMING:
            committed = record.committed
        else:
            committed = 0
        relayed = (VersionState.STREAMING, VersionState.READY, VersionState.RETIRED)
        if not source or source == ORIGIN or record.state not in relayed:
            return Progress(version, record.state, committed, total, record.reason)  # an ended stream: the reason
        offer = self.relays.offer_of(version, check_name("source", source))
        if offer is None:
            raise NoSourceError(f"relay {source!r} offers v{version} no longer (withdrawn, or its liveness lapsed)")
        landed = min(committed, total if offer.landed is None else offer.landed)
        state = record.state if landed == total else VersionState.STREAMING  # the relay's copy is still coming
        return Progress(version, state, landed, total, record.reason, source=source)

    def _announce(self, record: _Version, manifest: Manifest) -> None:
        self._move(record, VersionEvent.COMMIT)
        record.manifest = manifest
        if manifest.digests is None and self.relays.drop_offers(record.version):
            log.warning("v%s was committed without digests: its relays' offers end", record.version)
        line = self._line_of(record)
        line.highest_announced, line.announced_at = manifest.version, next(self._announcements)
        previous, line.newest = line.newest, manifest.version
        if previous is not None and self._versions[previous].state is VersionState.READY:
            self._move(self._versions[previous], VersionEvent.RETIRE)  # its own line's alone
        superseded = [
            v
            for v in self._versions.values()
            # Its own line's; an admin's tombstone (no owner: it stood for any publisher) too.
            if v.shards is not None and v.owner in (record.owner, "") and v.version < manifest.version
        ]
        for old in superseded:
            assert old.shards is not None  # for the type checker
            if not old.shards.began:  # an abort's tombstone: nobody may begin it now anyway
                del self._versions[old.version]
            elif old.state is VersionState.WRITING:  # it can never be READY now: free its shards' slots
                self._move(old, VersionEvent.ABORT)
                old.reason = f"superseded by v{manifest.version} before every shard committed"
        self._changed()

    def abort(
        self, version: int, reason: str = "", *, shard: tuple[int, int] | None = None, by: Principal = ADMIN
    ) -> None:
        """WRITING -> ABORTED. Any shard may abort a sharded version by the number its
        shards asked for, even before any shard began it (its siblings are then refused),
        and aborting it again does nothing."""
        self._enter(by, "abort")
        if shard is not None:
            _, count = check_shard(*shard)
            check_int("version", version)
            if by.role is Role.READER:
                self._refuse(by, "abort", f"v{version}", "readers cannot begin or end versions")
            owner = None if by.is_admin else by.name
            found = self._find_sharded(owner, version)
            if found is None:  # before any shard began: a tombstone its siblings will find
                # Numbered as a begin would be (bounded, never a number used before), but not
                # counted as begun: a restarted registry takes replayed aborts before the
                # older versions that were READY, which must keep their numbers.
                number = self._number(version, by, owner or "")
                self._versions[number] = _Version(
                    number,
                    "",
                    0,
                    self.clock.now(),
                    VersionState.ABORTED,
                    reason=reason,
                    shards=ShardAssembly(number, count),
                    owner=owner or "",
                    asked=version,
                )
                return
            version = found.version
        record = self._record(version)
        self._check_owner(by, record, "abort")
        if record.shards is not None and record.state is VersionState.ABORTED:
            return
        self._move(record, VersionEvent.ABORT)
        record.reason = reason
        self._changed()

    def retire(self, version: int, *, by: Principal = ADMIN) -> None:
        """Withdraw a READY version: no new leases; those held stay valid."""
        self._enter(by, "retire")
        record = self._record(version)
        self._check_owner(by, record, "retire")
        self._move(record, VersionEvent.RETIRE)
        record.reason = record.reason or f"retired by {by}"
        line = self._line_of(record)
        if line.newest == version:
            line.newest = None

    def reclaim(self, version: int, *, by: Principal = ADMIN) -> None:
        """Give a RETIRED or ABORTED version's slot back to its publisher. Refused while
        any lease on it is alive; the newest READY version is never reclaimable. Of a
        sharded version, the first shard's reclaim drops it: its siblings then find it
        gone, which frees their slots too (no lease on it can ever be valid again)."""
        self._enter(by, "reclaim")
        record = self._record(version)
        self._check_owner(by, record, "reclaim")
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
        self._drop(record)

    # -- reading -------------------------------------------------------------------------

    def newest(self, *, publisher: str | None = None, by: Principal = ADMIN) -> Manifest | None:
        """The newest READY manifest of `publisher`'s line (None: the default line's)."""
        self._enter(by, "newest")
        line = self._follow(publisher)
        if line is None or line.newest is None:
            return None
        return self._versions[line.newest].manifest

    def get(self, version: int, *, by: Principal = ADMIN) -> Manifest:
        self._enter(by, "get")
        record = self._record(version)
        if record.manifest is None:
            raise VersionStateError(f"version {version} is {record.state}: it has no manifest")
        return record.manifest

    def acquire(
        self,
        version: int | None = None,
        *,
        ttl: float,
        holder: str,
        by: Principal = ADMIN,
        streaming: bool = False,
        host: str | None = None,
        exclude: Iterable[str] = (),
        publisher: str | None = None,
        part: str | None = None,
    ) -> Lease:
        """Lease the newest READY version of `publisher`'s line (None: the default line),
        or `version` if it is READY (and of that line, when `publisher` is named). With
        `streaming`, a STREAMING version counts too: the line's newest of either, or
        `version` if it is one.

        With `host` (the reader's), the lease is placed at a source of the version the
        registry picks (`weightpull.sources.choose_source`: its own slot, or a replica's
        offered mirror, never one in `exclude`); the lease names it (`source`,
        `descriptor`). `NoSourceError` when every source is full or excluded. With `part`
        too (a tensor-parallel rank's slice layout, `weightpull.slices.slice_key`), the
        source is the slot or a mirror offered for that very layout; without, never one
        offered for a slice."""
        self._enter(by, "acquire")
        check_part(part)
        check_name("holder", holder)
        if not by.owns(holder):
            self._refuse(by, "acquire", f"a lease for {holder!r}", "a principal holds leases only under its own names")
        self._touch_named(by, holder)
        if not isinstance(ttl, (int, float)) or not 0 < ttl <= self.max_ttl:
            raise InvalidArgumentError(f"ttl must be in (0, {self.max_ttl}] seconds, got {ttl!r}")
        readable = (VersionState.READY, VersionState.STREAMING) if streaming else (VersionState.READY,)
        line = self._follow(publisher)
        if version is None:
            streams = [
                v.version
                for v in self._versions.values()
                if streaming and v.state is VersionState.STREAMING and line is not None and v.owner == line.owner
            ]
            newest = max([*streams, -1 if line is None or line.newest is None else line.newest])
            if newest < 0:
                raise NoReadyVersionError(self._why_none_ready(line, publisher))
            version = newest
        record = self._record(version)
        if publisher is not None and record.owner != publisher:
            raise VersionNotFoundError(f"{publisher!r} has no version {version} (it is {record.owner!r}'s)")
        if record.state not in readable:
            why = f" ({record.reason})" if record.reason else ""
            newest_ready = None if line is None else line.newest
            raise VersionStateError(
                f"version {version} is {record.state}{why} and takes no new leases (newest READY: {newest_ready})"
            )
        lease = _Lease(
            f"{self._lease_prefix}-{next(self._lease_ids)}", version, holder, float(ttl), self.clock.now() + ttl
        )
        if host is not None:
            check_name("host", host)
            if isinstance(exclude, str):
                raise InvalidArgumentError(f"exclude is a collection of source names, not the string {exclude!r}")
            self._sync_relays()
            if not streaming:  # a reader that reads every bucket at once: relays holding it whole only
                exclude = (*exclude, *(o.holder for o in self.relays.offers(version) if not self._whole(o, record)))
            offer = self.relays.place(lease.id, version, Reader(holder, host), exclude=tuple(exclude), part=part)
            if offer is not None:
                lease.source, lease.descriptor = offer.holder, offer.descriptor
        self._prune(record)
        record.leases[lease.id] = lease
        self._lease_index[lease.id] = version
        return lease.public()

    def renew(self, lease: Lease, *, by: Principal = ADMIN) -> Lease:
        self._enter(by, "renew")
        record = self._lease(lease)
        if record is None:
            raise LeaseNotFoundError(f"lease {lease.id} on v{lease.version} is unknown")
        self._check_holder(by, record, "renew")
        if self._expired(record):
            raise LeaseExpiredError(f"lease {lease.id} of {record.holder!r} on v{record.version} expired")
        record.state = LEASE.fire(record.state, LeaseEvent.RENEW, f"{lease.id}")
        record.expires_at = self.clock.now() + record.ttl
        return record.public()

    def release(self, lease: Lease, *, by: Principal = ADMIN) -> bool:
        """End a lease; whether it was still valid (as `is_valid` says) until then.
        Idempotent: releasing an ended or forgotten lease does nothing (and says False)."""
        self._enter(by, "release")
        record = self._lease(lease)
        if record is not None:
            self._check_holder(by, record, "release")
        valid = record is not None and not self._expired(record) and record.state is LeaseState.ACTIVE
        if valid:
            assert record is not None
            record.state = LEASE.fire(record.state, LeaseEvent.RELEASE, f"{lease.id}")
        self.relays.release(lease.id)
        return valid

    def is_valid(self, lease: Lease, *, by: Principal = ADMIN) -> bool:
        self._enter(by, "is_valid")
        record = self._lease(lease)
        return record is not None and not self._expired(record) and record.state is LeaseState.ACTIVE

    # -- relays -------------------------------------------------------------------------

    def offer(
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
        by: Principal = ADMIN,
    ) -> None:
        """A replica that holds READY `version` whole in a mirror offers to serve it from
        there, as `holder` (a name of its own) on `host`, at most `cap` readers at once.
        Its readers check every bucket against the publisher's digests, so a version
        without digests cannot be offered. The offer lasts until withdrawn, the version
        is reclaimed or aborted, or the offering principal's liveness lapses.

        With `landed`, the mirror holds only the version's first `landed` buckets so far
        (it is still receiving them): the version may be STREAMING too, and the relay
        advances the count with `mark_offer`. Streaming readers placed there read each
        bucket once the relay holds it; a stream committed without digests ends its offers.

        With `part`, the mirror holds one tensor-parallel rank's slice of READY `version`
        (sharded or not), whole, laid out as slice layout `part` says; only readers of
        that layout are placed there. They check it against the slice's digests, one a
        bucket of the slice's mirror: `digests`, which only a holder whose copy came from
        the version's own slot may give (the first such stands; `RelayBook.attest`); a
        relay that read from a relay offers with none, once they are recorded."""
        self._enter(by, "offer")
        check_name("holder", holder)
        if not by.owns(holder):
            self._refuse(by, "offer", f"v{version} as {holder!r}", "a principal offers only under its own names")
        self._touch_named(by, holder)
        record = self._record(version)
        if part is not None or digests is not None:
            self._offer_part(record, holder, host, descriptor, cap, part, digests)
            return
        relayable = (VersionState.READY,) if landed is None else (VersionState.READY, VersionState.STREAMING)
        if record.state not in relayable or record.manifest is None:
            whole = "only a READY version" if landed is None else "only a READY or STREAMING version"
            raise VersionStateError(f"version {version} is {record.state}: {whole} may be relayed")
        if record.manifest.sharded:
            raise InvalidArgumentError(f"v{version} is sharded: a relay serves whole versions only")
        if record.state is VersionState.READY:  # a stream's digests come with its commit
            check_servable(version, record.manifest.digests, len(record.manifest.layout.buckets))
        before = self.relays.offer_of(version, holder)
        if landed is not None:
            self._check_landed(record, holder, landed, before)
        self._sync_relays()
        hops = self.relays.hops_of(version, holder)
        self.relays.offer(Offer(version, holder, host, descriptor, cap, hops, landed))
        self._changed()

    def _offer_part(
        self,
        record: _Version,
        holder: str,
        host: str,
        descriptor: bytes,
        cap: int | None,
        part: str | None,
        digests: Sequence[str] | None,
    ) -> None:
        """`offer` of one rank's slice (`part`), vouched for by `digests` or by those
        recorded already."""
        version = record.version
        if part is None:
            raise InvalidArgumentError("digests come with an offer of a slice: pass part= (its layout's key)")
        check_part(part)
        if record.state is not VersionState.READY or record.manifest is None:
            raise VersionStateError(f"version {version} is {record.state}: only a READY version's slice may be relayed")
        self._sync_relays()
        if digests is not None:
            self.relays.attest(version, part, digests, holder)
        elif self.relays.attested(version, part) is None:
            raise InvalidArgumentError(
                f"{holder!r}: no digests of v{version}'s slice layout {part} are recorded yet, so no reader could "
                "check this relay: the first relay of a layout reads it from the version's slot and offers with "
                "digests"
            )
        hops = self.relays.hops_of(version, holder)
        self.relays.offer(Offer(version, holder, host, descriptor, cap, hops, None, part))
        self._changed()

    def part_digests(self, version: int, part: str, *, by: Principal = ADMIN) -> tuple[str, ...] | None:
        """The digests of slice layout `part` of `version` (one a bucket of its mirror),
        as the first relay of that layout that read it from the version's slot computed
        them; None while none did."""
        self._enter(by, "part_digests")
        check_int("version", version)
        return self.relays.attested(version, check_part(part) or "")

    def mark_offer(self, version: int, landed: int, *, holder: str, by: Principal = ADMIN) -> None:
        """`holder`'s mirror now holds the first `landed` buckets of `version`, which it
        offered while receiving it: its readers may read them. The count only grows, and
        never past the buckets the version's publisher committed."""
        self._enter(by, "mark_offer")
        check_name("holder", holder)
        if not by.owns(holder):
            self._refuse(by, "mark_offer", f"v{version} as {holder!r}", "a principal marks only its own offers")
        self._touch_named(by, holder)
        record = self._record(version)
        offer = self.relays.offer_of(version, holder)
        if offer is None:
            why = f" ({record.reason})" if record.reason else ""
            raise VersionStateError(
                f"{holder!r} offers no v{version} (v{version} is {record.state}{why}): offer it before marking"
            )
        self._check_landed(record, holder, landed, offer)
        self.relays.mark(version, holder, landed)
        self._changed()

    def _check_landed(self, record: _Version, holder: str, landed: object, before: Offer | None) -> None:
        """A relay's count of buckets held: within what the publisher committed, and no
        fewer than it said before."""
        check_int("landed", landed)
        assert isinstance(landed, int) and record.manifest is not None
        total = len(record.manifest.layout.buckets)
        committed = record.committed if record.state is VersionState.STREAMING else total
        floor = 0 if before is None else total if before.landed is None else before.landed
        if not floor <= landed <= committed:
            raise InvalidArgumentError(
                f"{holder!r}: {landed} buckets of v{record.version} landed is not between the {floor} it said "
                f"before and the {committed} its publisher committed (of {total})"
            )

    def _whole(self, offer: Offer, record: _Version) -> bool:
        total = len(record.manifest.layout.buckets) if record.manifest is not None else 0
        return offer.landed is None or (offer.landed == total and record.state is not VersionState.STREAMING)

    def withdraw(self, version: int, *, holder: str, by: Principal = ADMIN) -> None:
        """End an offer (idempotent). Leases placed at it read on until they end: the
        relay keeps its mirror while `readers_at` says any do."""
        self._enter(by, "withdraw")
        check_name("holder", holder)
        if not by.owns(holder):
            self._refuse(by, "withdraw", f"v{version} as {holder!r}", "a principal withdraws only its own offers")
        if self.relays.withdraw(check_int("version", version), holder) is not None:
            self._changed()  # its streaming readers are told now

    def readers_at(self, version: int, holder: str, *, by: Principal = ADMIN) -> int:
        """Live leases reading `version` from `holder`'s mirror: while above 0, the relay
        must neither overwrite nor drop that mirror."""
        self._enter(by, "readers_at")
        self._sync_relays()
        return self.relays.leases_at(check_int("version", version), check_name("holder", holder))

    def _sync_relays(self) -> None:
        """Release the placements of leases that ended (expired, or forgotten)."""
        for lease_id in self.relays.placed():
            version = self._lease_index.get(lease_id)
            record = None if version is None else self._versions[version].leases.get(lease_id)
            if record is None or self._expired(record) or record.state is not LeaseState.ACTIVE:
                self.relays.release(lease_id)

    # -- replicas, liveness and status ---------------------------------------------------

    def report_serving(
        self, replica: str, version: int, *, pull: PullReport | None = None, by: Principal = ADMIN
    ) -> None:
        """Replica `replica` serves `version` now; with `pull`, how the pull that brought it
        went (the status shows it)."""
        self._enter(by, "report_serving")
        check_name("replica", replica)
        if not by.owns(replica):
            self._refuse(by, "report_serving", f"replica {replica!r}", "a principal reports only what it serves itself")
        check_int("version", version)
        if pull is not None:
            _check_pull(pull)
        self._serving[replica] = version
        if pull is not None:
            self._pulls[replica] = (version, self.clock.now(), pull)
        self._touch(root(replica))

    # -- reservations --------------------------------------------------------------------

    def reserve(self, reservation: Reservation, *, by: Principal = ADMIN) -> None:
        """A publisher's slots, registered before its first version, so that readers map
        them and size their mirror ahead of v1. A publisher's newer reservation replaces
        its older; all of a publisher's go when its liveness lapses (its slots with it)."""
        self._enter(by, "reserve")
        if not isinstance(reservation, Reservation):
            raise InvalidArgumentError(f"reserve takes a Reservation, got {type(reservation).__name__}")
        check_name("publisher", reservation.publisher)
        self._check_publisher(by, "reserve", reservation.publisher)
        check_int("nbytes", reservation.nbytes)
        if not 0 < len(reservation.sources) <= MAX_RESERVED_SLOTS:
            raise InvalidArgumentError(
                f"a reservation names 1 to {MAX_RESERVED_SLOTS} slots, got {len(reservation.sources)}"
            )
        if reservation.publisher not in self._reservations and len(self._reservations) >= MAX_RESERVATIONS:
            raise InvalidArgumentError(
                f"the registry holds {MAX_RESERVATIONS} reservations already; {reservation.publisher!r} cannot add one"
            )
        self._reservations[reservation.publisher] = reservation

    def reservations(self, *, by: Principal = ADMIN) -> tuple[Reservation, ...]:
        """Every live publisher's reservation, by publisher name."""
        self._enter(by, "reservations")
        return tuple(self._reservations[p] for p in sorted(self._reservations))

    def keepalive(self, names: tuple[str, ...] | list[str] = (), *, by: Principal = ADMIN) -> None:
        """Renew the liveness of `by` and of the names given (publisher or replica names it
        owns): what a client's heartbeat sends. Every other operation renews `by` too."""
        self._enter(by, "keepalive")
        for name in names:
            check_name("name", name)
            if not by.owns(name):
                self._refuse(by, "keepalive", f"{name!r}", "a principal keeps alive only its own names")
            self._touch(root(name))

    # -- what waits ask ----------------------------------------------------------------

    def waited_on(self, publisher: str | None) -> str | None:
        """The publisher a wait on `publisher`'s line (None: the default line) waits on:
        the one named (even before its first version), else the default line's owner;
        None while no line is there to follow."""
        if publisher is not None:
            return check_name("publisher", publisher)
        line = self._follow(None)
        return None if line is None else line.owner

    def lapsed(self, name: str) -> bool:
        """Whether `name`'s liveness lapsed (acted on now if due) and it was not heard from since."""
        self._sweep()
        return name in self._lapsed

    def lapses_at(self, name: str) -> float | None:
        """When `name`'s liveness lapses on the registry's clock, unless renewed: what a
        waiter on it sleeps until at most, so that the lapse ends its wait on time even
        where no timer sweeps. None: no liveness is judged, `name` was never heard from,
        or it lapsed already."""
        if self.liveness_ttl is None or name in self._lapsed:
            return None
        return self._alive.get(name)

    def status(self, *, by: Principal = ADMIN) -> RegistryStatus:
        self._enter(by, "status")
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
                    committed=record.committed if record.state is VersionState.STREAMING else None,
                    slots=tuple(record.slots()) if record.shards is not None else (),
                    step=record.manifest.step if record.manifest else None,
                    delta=_delta_of(record.manifest),
                )
            )
            leases += [LeaseInfo(x.id, x.version, x.holder, x.expires_at - now, x.source) for x in live]
        serving = dict(self._serving)
        alive = {name: expires - now for name, expires in sorted(self._alive.items())}
        self._sync_relays()
        offers = []
        for record in sorted(self._versions.values(), key=lambda r: r.version):
            total = len(record.manifest.layout.buckets) if record.manifest is not None else 0
            for o in sorted(self.relays.offers(record.version), key=lambda o: o.holder):
                landed = total if o.landed is None else o.landed
                leases_at = self.relays.leases_at(record.version, o.holder)
                offers.append(OfferInfo(record.version, o.holder, o.host, landed, total, leases_at, o.cap))
        default = self._follow(None)
        newest = None if default is None else default.newest
        pulls = {
            replica: PullInfo(v, now - at, pull.seconds, pull.nbytes, pull.source)
            for replica, (v, at, pull) in sorted(self._pulls.items())
        }
        lapsed = tuple(
            LapseInfo(name, now - at, ended) for name, at, ended in reversed(self._lapses) if now - at <= LAPSE_WINDOW
        )
        return RegistryStatus(newest, tuple(versions), tuple(leases), serving, alive, tuple(offers), pulls, lapsed)

    # -- authority -----------------------------------------------------------------------

    def _enter(self, by: Principal, op: str) -> None:
        """What every operation does first: act on lapsed liveness, then renew the asker's."""
        if not isinstance(by, Principal):
            raise InvalidArgumentError(f"{op}: `by` must be a Principal, got {by!r}")
        self._sweep()
        if not by.is_admin and not by.is_prefix:  # a prefix is no one: its replicas live by their names
            self._touch(by.name)

    def _touch_named(self, by: Principal, name: str) -> None:
        """A prefix principal's replica is alive by the name it acts under (`rollout-7`)."""
        if by.is_prefix:
            self._touch(root(name))

    def _refuse(self, by: Principal, op: str, what: str, rule: str) -> NoReturn:
        log.warning("refused %s of %s by %s: %s", op, what, by, rule)
        raise PermissionDeniedError(f"{by} may not {op} {what}: {rule}")

    def _check_publisher(self, by: Principal, op: str, publisher: str) -> str:
        """The owner of a version `by` writes under `publisher`."""
        if by.role is Role.READER:
            self._refuse(by, op, f"a version as {publisher!r}", "readers cannot begin or end versions")
        if not by.owns(publisher):
            self._refuse(by, op, f"a version as {publisher!r}", "a publisher writes only under its own name")
        return root(publisher) if by.is_admin else by.name

    def _check_owner(self, by: Principal, record: _Version, op: str) -> None:
        if by.is_admin:
            return
        if by.role is Role.READER:
            self._refuse(by, op, f"v{record.version}", "readers cannot begin or end versions")
        if record.owner != by.name:
            self._refuse(by, op, f"v{record.version}", f"it belongs to publisher {record.owner!r}")

    def _check_holder(self, by: Principal, lease: _Lease, op: str) -> None:
        if not by.owns(lease.holder):
            self._refuse(by, op, f"lease {lease.id}", f"it is held by {lease.holder!r}")
        self._touch_named(by, lease.holder)

    def _number(self, asked: int | None, by: Principal, owner: str) -> int:
        """The number a new version of `owner`'s line gets when `asked` for: the number
        asked, while it exceeds every version begun in that line and is free; else the
        next free one after it, or after the line's last (a restarted publisher asks again
        from its start; None asks for the next: of a new line's first version, the next
        after every number begun). Free: held by no version, and not among the numbers
        reclaimed last. Only the line's own begins move its numbers: another's take at
        most the numbers it holds (`MAX_HELD_VERSIONS`) and those just reclaimed, never a
        range."""
        line = self._lines.get(owner)
        if line is None and asked is None:  # a new line's first version: after every one begun anywhere
            following = max((x.highest_begun for x in self._lines.values()), default=-1) + 1
        else:
            following = (-1 if line is None else line.highest_begun) + 1
        if asked is not None and asked >= following and not by.is_admin and asked - following > MAX_VERSION_JUMP:
            raise InvalidArgumentError(
                f"version {asked} is more than {MAX_VERSION_JUMP} past the next, {following}: ask for a nearer one"
            )
        number = following if asked is None or asked < following else asked
        while number in self._versions or number in self._quarantined:  # another's, live or just reclaimed
            number += 1
        if number > MAX_VERSION:
            raise InvalidArgumentError(f"versions are at most {MAX_VERSION}; v{number} cannot be begun")
        return number

    def _find_sharded(self, owner: str | None, asked: int) -> _Version | None:
        """The sharded version of `owner` (None: an admin asks, of anyone) whose shards
        asked for `asked`, if any."""
        record = self._versions.get(asked)
        if record is not None and record.shards is not None and record.asked == asked and owner in (None, record.owner):
            return record  # given the number asked, as it mostly is
        for record in self._versions.values():
            if record.shards is not None and record.owner == owner and record.asked == asked:
                return record
        return None

    # -- liveness ------------------------------------------------------------------------

    def _touch(self, name: str) -> None:
        if self.liveness_ttl is None:
            return
        self._alive[name] = self.clock.now() + self.liveness_ttl
        if name in self._lapsed:  # back after a lapse (restarted): its old versions' slots are gone
            self._lapsed.discard(name)
            for record in [v for v in self._versions.values() if v.owner == name]:
                if record.state in (VersionState.ABORTED, VersionState.RETIRED) and not self._live_leases(record):
                    self._drop(record)

    def sweep(self) -> None:
        """Act on every liveness that lapsed by now. Each operation does so first; a
        served registry also calls it on a timer, so a dead publisher's versions end on
        time even when nobody asks anything."""
        self._sweep()

    def _sweep(self) -> None:
        """End what principals whose liveness lapsed leave behind."""
        if self.liveness_ttl is None:
            return
        now = self.clock.now()
        ended = False
        for name, expires in self._alive.items():
            if expires > now or name in self._lapsed:
                continue
            self._lapsed.add(name)
            what: list[str] = []
            if self.relays.lapse(name):  # its mirrors are gone with it: readers there choose again
                ended = True
                what.append("its relay offers ended")
            for replica in [r for r in self._serving if root(r) == name]:  # it serves nothing now
                what.append(f"replica {replica!r} stopped serving v{self._serving.pop(replica)}")
                self._pulls.pop(replica, None)
                ended = True  # a trainer waiting for its replicas to serve is told now
            for publisher in [p for p in self._reservations if root(p) == name]:  # its slots are gone
                del self._reservations[publisher]
            why = f"publisher {name!r} lapsed: not heard from for {self.liveness_ttl:g} s"
            for record in sorted(self._versions.values(), key=lambda r: r.version):
                if record.owner != name:
                    continue
                if record.state.being_written:
                    self._move(record, VersionEvent.ABORT)
                    record.reason = why
                    ended = True
                    what.append(f"aborted v{record.version}")
                elif record.state is VersionState.READY:
                    self._move(record, VersionEvent.RETIRE)
                    record.reason = f"withdrawn: {why}"
                    line = self._line_of(record)
                    if line.newest == record.version:
                        line.newest = None
                    log.warning("withdrew v%s: %s", record.version, why)
                    ended = True
                    what.append(f"withdrew v{record.version}")
            self._lapses.append((name, expires, tuple(what)))
            ended = ended or name in self._lines  # a line's waiters are told it lapsed
        if ended:  # readers waiting on an ended stream are told now, not at their long poll's end
            self._changed()

    def _why_none_ready(self, line: _Line | None, publisher: str | None) -> str:
        of = "" if publisher is None else f" of {publisher!r}"
        withdrawn = [
            v
            for v in self._versions.values()
            if v.state is VersionState.RETIRED and v.reason and line is not None and v.owner == line.owner
        ]
        if withdrawn:
            last = max(withdrawn, key=lambda v: v.version)
            return f"no version{of} is READY: v{last.version} was {last.reason}"
        return f"no version{of} is READY yet"

    # -- internals -----------------------------------------------------------------------

    def _record(self, version: int) -> _Version:
        check_int("version", version)
        try:
            return self._versions[version]
        except KeyError:
            raise VersionNotFoundError(f"version {version} is unknown (never begun, or reclaimed)") from None

    def _move(self, record: _Version, event: VersionEvent) -> None:
        record.state = VERSION.fire(record.state, event, f"v{record.version}")
        if event is VersionEvent.ABORT:  # a stream that ends unfinished: relays of it have nothing to serve
            self.relays.drop_offers(record.version)

    def _drop(self, record: _Version) -> None:
        self._move(record, VersionEvent.RECLAIM)
        if len(self._dropped) == self._dropped.maxlen:
            self._quarantined.discard(self._dropped[0])
        self._dropped.append(record.version)
        self._quarantined.add(record.version)
        self.relays.forget(record.version)
        for lease_id in record.leases:
            self._lease_index.pop(lease_id, None)
        del self._versions[record.version]

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
