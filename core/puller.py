"""The puller: a replica's side. Leases a version, reads every bucket into a local
registered mirror, and hands the copy on only if the lease held throughout.

Why the final lease check is enough: a publisher rewrites a slot only after the registry
reclaims its version, and the registry refuses while any lease on it is alive. A lease,
once lapsed, never becomes valid again. So a lease still valid after the last byte
landed proves no write touched the slot during the read; a lapsed one means the copy
may be torn, and it is rejected.
"""

from __future__ import annotations

import bisect
import functools
import logging
import math
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, NoReturn, Self, TypedDict, cast

import anyio
import attrs

from . import transports
from .clock import Clock, MonotonicClock
from .digests import WSUM64, kind_of, matches
from .errors import (
    DigestMismatchError,
    InvalidArgumentError,
    InvalidTransitionError,
    LeaseExpiredError,
    LeaseNotFoundError,
    NoProgressError,
    NoSourceError,
    PeerGoneError,
    RegionNotRegisteredError,
    TornReadError,
    TransportError,
    VersionStateError,
    WeightpullError,
    first_error,
)
from .layout import Layout
from .manifest import Manifest
from .principals import Principal
from .records import Progress
from .registry import Lease, Registry, RelayingRegistry, ReservingRegistry, as_streaming
from .states import VersionState
from .transport import Region, Remote, Transport, fault_in

if TYPE_CHECKING:
    from .publisher import Digester

log = logging.getLogger(__name__)

_LEASE_LOST = (LeaseExpiredError, LeaseNotFoundError, InvalidTransitionError)
_MAX_REMOTES = 16
DEFAULT_STALL_TIMEOUT = 30.0
MAX_SOURCE_TRIES = 3  # sources a pull with host= tries before it fails
_TORCH_DIGESTER = "weightpull.integrations.torch_digests.wsum64_digests"
# Reads a relaying pull keeps in flight, taken in bucket order. Reads asked together share
# the link and land together (NIXL over UCX's tcp interleaves them: 16 buckets asked at once
# all landed within 1 ms of each other, at the end); one at a time, each lands, and is
# offered to the relay's readers, as early as it can.
RELAY_READS_IN_FLIGHT = 1


class _Forwarder:
    """A relay's offer of the version it is still pulling (`Puller(relay=True)`): made
    once its first bucket lands, then advanced as buckets land. Only a prefix of whole
    buckets counts (reads land in any order); one offer or mark is in flight at a time,
    carrying the newest count, so marks batch themselves to the registry's pace."""

    def __init__(
        self, puller: Puller, registry: RelayingRegistry, version: int, layout: Layout, descriptor: bytes
    ) -> None:
        self.puller, self.registry, self.version, self.descriptor = puller, registry, version, descriptor
        self.starts = [b.offset for b in layout.buckets]
        self.sizes = [b.nbytes for b in layout.buckets]
        self.filled = [0] * len(self.sizes)
        self.landed = 0  # buckets held, a prefix
        self.sent: int | None = None  # the count the registry has; None: not offered yet
        self.busy = self.failed = False

    def note(self, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of the mirror landed."""
        i = bisect.bisect_right(self.starts, offset) - 1
        while nbytes > 0 and 0 <= i < len(self.sizes):
            take = min(nbytes, self.starts[i] + self.sizes[i] - offset)
            self.filled[i] += take
            offset, nbytes, i = offset + take, nbytes - take, i + 1
        while self.landed < len(self.sizes) and self.filled[self.landed] >= self.sizes[self.landed]:
            self.landed += 1

    async def send(self) -> None:
        """Tell the registry the newest count, unless a send is under way (it sends the
        newest after its own). A failure stops forwarding; the relay's own pull goes on."""
        if self.busy or self.failed:
            return
        self.busy = True
        p = self.puller
        assert p.host is not None
        try:
            while self.landed > (self.sent or 0):
                count = self.landed
                if self.sent is None:
                    await self.registry.offer(
                        self.version,
                        holder=p.holder,
                        host=p.host,
                        descriptor=self.descriptor,
                        cap=p.relay_cap,
                        landed=count,
                    )
                    p.offered = self.version  # from now on, its next pull waits for its readers
                else:
                    await self.registry.mark_offer(self.version, count, holder=p.holder)
                self.sent = count
        except WeightpullError as exc:
            log.warning("%s: forwarding v%s as a relay stopped: %s", p.holder, self.version, exc)
            self.failed = True
        finally:
            self.busy = False


_Read = tuple[Remote, int, Region, int, int]  # (remote, its offset, the mirror, the mirror's offset, bytes)


class _SourceFailed(Exception):
    """A relay failed a pull (its cause says how): read the version afresh elsewhere."""

    def __init__(self, source: str, version: int) -> None:
        super().__init__(f"relay {source!r} failed v{version}")
        self.source, self.version = source, version


# The rates (local seconds per registry second) the renewal pacing believes. The slowest
# is also assumed before a pull has measured its rate; a clock even faster than the
# fastest renews more often than it needs to, never too late.
_RATE_MIN, _RATE_MAX = 1 / 8, 8.0


class _Pacer:
    """When to renew one pull's lease, in local time, so that each renewal reaches the
    registry well within the time the registry gave: at most `renew_every`, and at most
    a third of the granted TTL, of the registry's seconds after the one before.

    The local clock may run at another rate than the registry's, and only the
    registry's judges the lease. Each grant says when the registry made it, on its own
    clock (`expires_at - ttl`), so two grants against the local times around them
    measure the local clock's rate. The measure is a lower bound (the local time from
    the earlier reply to the later request), so latency can only shorten the sleeps.
    Until a pull has two grants the pacer assumes the slowest rate it believes. Rates
    are bounded, so no reply makes it wait longer than `nominal` times the fastest rate,
    nor renew more often than once per `floor` local seconds."""

    def __init__(self, renew_every: float, ttl: float, lease: Lease, sent: float, received: float) -> None:
        self.nominal = min(renew_every, ttl / 3)  # registry seconds between renewals
        self.floor = self.nominal * _RATE_MIN  # local seconds between renewals, at least
        self.rate: float | None = None  # local seconds per registry second, once measured
        self.measured: float | None = None  # the same, unbounded: the last measure
        self._base: tuple[float, float] | None = None  # (local reply time, registry time) of a grant
        self.due = 0.0  # the local time of the next renewal
        self.granted(lease, sent, received)

    def granted(self, lease: Lease, sent: float, received: float) -> None:
        """The acquire's or a renewal's grant, asked at local time `sent` and answered at `received`."""
        at = lease.expires_at - lease.ttl
        self.last = (at, sent)  # the registry's time of the newest grant, and the local time it was asked
        if math.isfinite(at):
            if self._base is None:
                self._base = (received, at)
            elif (registry := at - self._base[1]) <= 0:  # an odd reply, or the last one was: measure from here
                self._base = (received, at)
            elif (local := sent - self._base[0]) > 0:  # else too close to the last grant: measure a longer span
                self.measured = local / registry
                self.rate = min(max(self.measured, _RATE_MIN), _RATE_MAX)
                self._base = (received, at)
        interval = self.nominal
        if math.isfinite(lease.ttl) and lease.ttl > 0:
            interval = min(interval, lease.ttl / 3)
        self._schedule(sent, interval)

    def failed(self, sent: float) -> None:
        """A renewal asked at `sent` failed, though the lease may hold: try again as soon."""
        self._schedule(sent, self.nominal)

    def _schedule(self, sent: float, interval: float) -> None:
        rate = _RATE_MIN if self.rate is None else self.rate
        self.due = sent + max(interval * rate, self.floor)


@attrs.frozen
class _VersionBytes:
    """One version's bytes in `region`, laid out as its manifest says."""

    version: int
    manifest: Manifest
    region: Region

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    def view(self, name: str) -> memoryview:
        """The bytes of tensor `name`, where they are in host memory."""
        p = self.manifest.layout[name]
        return self.region.host_view()[p.offset : p.end]


@attrs.frozen
class Pulled(_VersionBytes):
    """A complete, verified copy of one version, in the puller's mirror. It stays valid
    until the next `pull` into the same mirror starts."""

    seconds: float
    renewals: int


@attrs.frozen
class Borrowed(_VersionBytes):
    """A version read in place: `region` is the publisher's slot itself, mapped into this
    process, as the puller's device reads it (`Puller.borrow`). Valid only inside the
    block that borrowed it; read it, never write it. READY, unless lent while still
    written (`borrow(whole=False)`): then read only the tensors `landed()` has named."""

    # Waits until at least n buckets may be read (a stream's progress); None: lent whole.
    _wait: Callable[[int], Awaitable[Progress]] | None = attrs.field(default=None, repr=False, alias="wait")
    _seen: list[Progress] = attrs.field(factory=list, repr=False, init=False)  # the last progress landed() saw

    async def landed(self) -> AsyncIterator[tuple[str, ...]]:
        """The names of the tensors whose bytes are all in the slot, in batches as the
        publisher commits them (one batch, every tensor, when lent whole): read each batch
        as it comes. A stream that ends otherwise raises `TornReadError`."""
        layout = self.manifest.layout
        total, done = len(layout.buckets), 0
        if self._wait is None or total == 0:
            yield tuple(p.spec.name for p in layout.placements)
            return
        while done < total:
            progress = await self._wait(done + 1)
            self._seen[:] = [progress]
            ready = progress.state in (VersionState.READY, VersionState.RETIRED)
            upto = total if ready else min(progress.committed, total)
            yield tuple(p.spec.name for p in layout.placements if done <= p.bucket < upto)
            done = upto


def _default_holder(registry: Registry) -> str:
    """A holder name for a puller that gives none: below its registry's principal's own
    name, where a served registry lets a reader hold leases; else a fresh one."""
    principal = getattr(registry, "principal", None)
    suffix = f"puller-{uuid.uuid4().hex[:8]}"
    if isinstance(principal, Principal) and not principal.is_admin:
        return f"{principal.name}/{suffix}"
    return suffix


def check_lease_settings(ttl: float, renew_every: float | None, stall_timeout: float | None) -> float:
    """What a puller's lease settings must be; the renewal interval (default, and at most,
    a third of the TTL)."""
    if ttl <= 0:
        raise InvalidArgumentError(f"ttl must be positive, got {ttl!r}")
    if stall_timeout is not None and not stall_timeout > 0:
        raise InvalidArgumentError(f"stall_timeout must be positive or None, got {stall_timeout!r}")
    every = renew_every or ttl / 3
    if not 0 < every < ttl:  # else every read longer than the TTL is torn
        raise InvalidArgumentError(f"renew_every must be in (0, ttl={ttl}), got {renew_every!r}")
    return every


def check_line(publisher: object) -> str | None:
    """A reader's `publisher=`: the name of the principal whose line of versions it follows, or None."""
    if publisher is not None and (not isinstance(publisher, str) or not publisher or "/" in publisher):
        raise InvalidArgumentError(
            f"publisher names the principal whose versions to follow (its name, as `keys new --name` gave it), "
            f"got {publisher!r}"
        )
    return publisher


class LineArgs(TypedDict, total=False):
    publisher: str


def line_args(publisher: str | None) -> LineArgs:
    """`publisher=` as a registry call takes it: only when a line is named."""
    return {} if publisher is None else {"publisher": publisher}


def check_transport(manifest: Manifest, transport: Transport) -> None:
    if manifest.transport != transport.name:
        raise InvalidArgumentError(
            f"v{manifest.version} was published over {manifest.transport!r}; this puller reads over {transport.name!r}"
        )


async def release_quietly(registry: Registry, lease: Lease, holder: str) -> None:
    """Release `lease`, even while cancelled; a failure is logged (the lease ends by TTL anyway)."""
    with anyio.CancelScope(shield=True):
        try:
            await registry.release(lease)
        except WeightpullError as exc:
            log.warning("%s: could not release lease %s: %s", holder, lease.id, exc)


async def read_under_lease(
    registry: Registry,
    lease: Lease,
    pacer: _Pacer,
    read_all: Callable[[Callable[[int], None]], Awaitable[None]] | None,
    *,
    clock: Clock,
    holder: str,
    stall_timeout: float | None,
    what: str,
    total: int,
    source: str = "",
    copy: str = "copy",
) -> tuple[Lease, int]:
    """Run `read_all(note)`, which calls `note(nbytes)` as each read lands, while renewing
    `lease` when `pacer` says and watching that reads land; then check the lease. What
    a whole pull and a rank's sliced pull share. Returns the lease as last renewed and
    the renewals; raises `NoProgressError` when no read landed for `stall_timeout`, and
    `TornReadError` when the lease lapsed (`what` names the version read, `copy` what
    was read of it, `source` where from)."""
    renewal = _Renewal(registry, lease, pacer, clock, holder)
    silence = None if stall_timeout is None else _Silence(pacer, clock.now())
    if silence is not None:
        renewal.on_grant = silence.granted
    landed, stalled = 0, False

    def note(nbytes: int) -> None:
        nonlocal landed
        landed += nbytes
        if silence is not None:
            silence.landed(clock.now())

    async def reads(read_all: Callable[[Callable[[int], None]], Awaitable[None]]) -> None:
        await read_all(note)
        tg.cancel_scope.cancel()  # every byte landed: stop renewing

    async def watchdog(timeout: float, silence: _Silence) -> None:
        nonlocal stalled
        # Only the registry's time is judged (its grants' stamps), so a local clock at any
        # rate ends a read neither early nor late. The watchdog wakes at least once a
        # renewal interval, and at the deadline as far as the evidence goes asks for a
        # grant now (a probe), so that a stall ends on time. (No wait here is cancelled
        # by another task: under a fake clock's autojump each such cancel costs 0.1 s.)
        while (left := timeout - silence.seconds(clock.now(), renewal.answering)) > 0:
            rate = min(pacer.measured or _RATE_MIN, _RATE_MAX)  # local seconds per registry second, at most
            if renewal.answering:  # the time since the newest grant, estimated for the sleep alone
                left = max(0.0, left - silence.since_grant(clock.now()) / rate)
            step = min(left, pacer.nominal)  # the registry's seconds
            # At least a microsecond: a fake clock must move past a deadline rounding left short of.
            await clock.sleep(max(step * rate, 1e-6))
            if step == left:
                await renewal.probe()
        stalled = True
        tg.cancel_scope.cancel()

    try:
        async with anyio.create_task_group() as tg:
            if read_all is not None:
                tg.start_soon(renewal.run, tg.cancel_scope.cancel)
                tg.start_soon(reads, read_all)
                if stall_timeout is not None and silence is not None:
                    tg.start_soon(watchdog, stall_timeout, silence)
    except BaseExceptionGroup as group:
        raise first_error(group) from None
    if stalled and not renewal.lost:
        raise NoProgressError(
            f"{holder}: no read of {what} landed in {stall_timeout:g} s ({landed} of {total} bytes read){source}"
        )
    await renewal.check(f"during the read; the {copy} may mix versions and was rejected")
    return renewal.lease, renewal.renewals


class _Silence:
    """How long no read has landed, in seconds of the registry's clock: what a stall is
    judged by, whatever rate the local clock runs at.

    Each grant of the lease is stamped with the registry's time it was made
    (`expires_at - ttl`). A landing (and the read's start, which counts as one) is dated
    no later than the newest grant's stamp plus the local time since it was asked,
    counted at the slowest rate the local clock may run at (the pacer's measure, a lower
    bound; until it has one, the slowest it believes), and no later than the first grant
    asked after it. The silence since runs to the newest grant's stamp. Both bounds lean
    one way, so no read is ended early; on clocks of one rate the date is exact. A
    registry whose grants carry no finite time, or one that does not answer, leaves only
    the local clock, taken as running at most `_RATE_MAX` times the registry's."""

    def __init__(self, pacer: _Pacer, now: float) -> None:
        self.pacer = pacer
        self.newest, self.newest_asked = pacer.last  # the newest grant's stamp, and the local time it was asked
        self.stamped = math.isfinite(self.newest)
        self.last_landed = now  # local time
        self.mark = self._date(now)  # the registry's time of the last landing, at most

    def _date(self, local: float) -> float:
        slowest = self.pacer.measured or _RATE_MIN  # local seconds per registry second, at least
        return self.newest + max(0.0, local - self.newest_asked) / slowest

    def landed(self, now: float) -> None:
        self.last_landed = now
        self.mark = self._date(now)

    def granted(self, lease: Lease, sent: float) -> None:
        """A grant asked at local time `sent`."""
        at = lease.expires_at - lease.ttl
        if not (self.stamped and math.isfinite(at)):
            self.stamped = False
            return
        if sent >= self.last_landed:
            self.mark = min(self.mark, at)
        if at >= self.newest:
            self.newest, self.newest_asked = at, sent

    def since_grant(self, now: float) -> float:
        """Local seconds since the newest grant was asked."""
        return max(0.0, now - self.newest_asked)

    def seconds(self, now: float, answering: bool) -> float:
        local = now - self.last_landed
        if not self.stamped:
            return local
        registry = max(0.0, self.newest - self.mark)
        return registry if answering else max(registry, local / _RATE_MAX)


class _Renewal:
    """A lease renewed when `pacer` says, until cancelled, and checked at the end: what a
    read under a lease and a borrowed slot share."""

    def __init__(self, registry: Registry, lease: Lease, pacer: _Pacer, clock: Clock, holder: str) -> None:
        self.registry, self.lease, self.pacer, self.clock, self.holder = registry, lease, pacer, clock, holder
        self.renewals = 0
        self.lost: list[BaseException] = []  # why the registry ended the lease, if it did
        self.answering = True  # whether the last renewal was granted
        self.on_grant: Callable[[Lease, float], None] | None = None  # each grant, and the local time it was asked
        self._on_lost: Callable[[], object] = lambda: None

    async def run(self, on_lost: Callable[[], object]) -> None:
        self._on_lost = on_lost
        while not self.lost:
            await self.clock.sleep(self.pacer.due - self.clock.now())
            await self.probe()

    async def probe(self) -> None:
        """Renew now (what `run` does when the pacer says): a fresh grant, stamped with
        the registry's time."""
        sent = self.clock.now()
        try:
            self.lease = await self.registry.renew(self.lease)
        except _LEASE_LOST as exc:
            self.lost.append(exc)
            self._on_lost()
            return
        except WeightpullError as exc:  # transient: the final check decides
            log.warning("%s: renewing lease %s failed: %s", self.holder, self.lease.id, exc)
            self.pacer.failed(sent)
            self.answering = False
            return
        self.renewals += 1
        self.answering = True
        self.pacer.granted(self.lease, sent, self.clock.now())
        if self.on_grant is not None:
            self.on_grant(self.lease, sent)

    async def check(self, what: str) -> None:
        """`TornReadError` unless the lease held throughout (`what`: when it lapsed, and so what)."""
        if self.lost or not await self.registry.is_valid(self.lease):
            self.torn(what)

    def torn(self, what: str) -> NoReturn:
        raise TornReadError(f"{self.holder}: the lease on v{self.lease.version} lapsed {what}") from (
            self.lost[0] if self.lost else None
        )

    async def finish(self, what: str) -> None:
        """Release the lease, then `TornReadError` unless it held throughout: one round
        trip where the registry says so as it releases (`release_checked`), else `check`
        then release. A registry that cannot be reached raises as `check` would (the lease
        then ends by its TTL)."""
        checked = getattr(self.registry, "release_checked", None)
        valid = None
        if checked is not None and not self.lost:
            with anyio.CancelScope(shield=True):
                valid = await checked(self.lease)
        if valid is None:  # a registry that cannot say: asked first
            try:
                await self.check(what)
            finally:
                await release_quietly(self.registry, self.lease, self.holder)
        elif not valid:
            self.torn(what)


class Puller:
    def __init__(
        self,
        registry: Registry,
        transport: Transport,
        *,
        holder: str | None = None,
        ttl: float = 10.0,
        renew_every: float | None = None,
        device: str = "cpu",
        staging: bool | None = None,
        verify_digests: bool | None = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        stream: bool = False,
        clock: Clock | None = None,
        host: str | None = None,
        relay: bool = False,
        relay_cap: int | None = None,
        spare_mirror: bool = False,
        digester: Digester | None = None,
        publisher: str | None = None,
    ) -> None:
        """`device` holds the mirror: "cpu", or a GPU ("cuda:0"). A GPU mirror of a driver
        that lands bytes in host memory is fed through pinned host memory, bucket by bucket
        (`staging=None` decides by `transport.reads_into_gpu`; True or False forces it).

        Digests a publisher recorded are checked on the host mirror's bytes, or, where they
        are `wsum64` and `digester` is given, by it, where the mirror lies (a `Digester`,
        as a publisher's: `weightpull.integrations.torch_digests.wsum64_digests` computes
        them on a GPU). `verify_digests=None` checks what can be checked where the mirror
        is: every kind on a host mirror, wsum64 with `digester` on a GPU, nothing on a GPU
        without it; True insists (a GPU mirror needs `digester`, and a version whose
        digests it cannot check, BLAKE2b's, is refused with `InvalidArgumentError`).
        A pull in which no read lands for `stall_timeout` seconds of the registry's clock
        ends with `NoProgressError` (None waits forever), whatever rate `clock` runs at:
        the lease's grants, stamped by the registry, date each landing (never early; at
        most a renewal interval late, and a renewal is asked at the deadline). Progress is
        counted per read, and a read is at most a bucket, so the bound must exceed the
        time one bucket takes.

        While a read runs the lease is renewed every `renew_every` seconds of the
        registry's clock (default, and at most, a third of the TTL), whatever the rate of
        `clock`: the registry's grants measure it (see `_Pacer`), and until they have,
        the first renewal comes early, after an eighth of that interval.

        With `stream`, a pull of the newest version also takes one still being written
        (STREAMING, from a publisher with `stream=True`): it reads each bucket once the
        publisher marks it committed, waits for the rest, and keeps the copy only if
        the version turns READY while the lease holds; a stream that ends otherwise is a
        `TornReadError`. The registry must be a `StreamingRegistry`.

        With `host` (this replica's host name), each lease is placed at the source the
        registry picks (a `RelayingRegistry`): the version's own slot, or the mirror of a
        replica that offered it (a relay; `offer`), the same host's first. Bytes read from
        a relay are checked bucket by bucket against the publisher's digests, always: a
        mirror on a GPU needs `digester`, and refuses a version whose digests are not
        wsum64 (`InvalidArgumentError`, before reading) wherever it is placed. When a relay fails mid-read (gone, stalled, or bytes that do not
        match), the whole copy is dropped and read again from another source, excluding
        that one, up to `MAX_SOURCE_TRIES` sources: a copy never mixes two sources.

        `publisher` names the line of versions this puller follows (its publisher
        principal's name): the newest is that line's newest, whatever another principal
        publishes, and a version of another line is refused (`VersionNotFoundError`).
        None follows the registry's default line: where one principal publishes, every
        version; else the line that announced last, whoever's it is: name the publisher
        wherever another may publish (docs/guides/registry-service.md#threat-model).

        With `relay` (needs `host` and `stream`), each pull offers the mirror to other
        replicas while it is still filling (`offer` with `relay_cap`): once its first
        bucket lands, then advancing the count of buckets it holds, so that streaming
        readers of this relay read each bucket once it landed here. A pull that fails
        withdraws the offer; one that succeeds leaves it standing until the next pull.

        A pull never overwrites a mirror that leases still read: it first withdraws the
        offer and waits for them (each ends within its TTL). With `spare_mirror`, a
        relay keeps a second mirror instead: a pull while the mirror is offered goes
        into the other one (withdrawing that one's older offer first), so readers of a
        relay never hold up its next prefetch. The cost: one more buffer the size of a
        version, on `device` (a replica then holds its weights and two mirrors)."""
        if verify_digests and device != "cpu" and digester is None:
            raise InvalidArgumentError(
                f"digests are verified on host mirrors, or on {device!r} by digester= "
                f"({_TORCH_DIGESTER}); leave verify_digests unset to skip them there"
            )
        self.renew_every = check_lease_settings(ttl, renew_every, stall_timeout)
        if host is not None:
            if not isinstance(registry, RelayingRegistry):
                raise InvalidArgumentError(f"{type(registry).__name__} hands out no sources (host=)")
            if not isinstance(host, str) or not host:
                raise InvalidArgumentError(f"host must be a non-empty string, got {host!r}")
            if device != "cpu" and digester is None:
                raise InvalidArgumentError(
                    f"reading from relays (host=) checks every bucket against the publisher's digests: a mirror "
                    f"on {device!r} checks them with digester={_TORCH_DIGESTER}"
                )
        self.registry = registry
        self.transport = transports.for_device(transport, device, staging)
        if relay and self.transport is not transport:
            raise InvalidArgumentError(
                f"a relay offers its mirror to other replicas, and a mirror on {device!r} fed through host staging "
                f"cannot be exported: relay from a host mirror, or over a driver that reads into {device!r} "
                "(staging=False)"
            )
        self.holder = holder or _default_holder(registry)
        self.ttl = ttl
        self.device = device
        self.digester = digester
        self.publisher = check_line(publisher)
        self.verify_digests = (device == "cpu" or digester is not None) if verify_digests is None else verify_digests
        self._insist = bool(verify_digests)  # digests that cannot be checked here refuse the version
        self.stall_timeout = stall_timeout
        self.stream = stream
        self.host = host
        self.offered: int | None = None  # the version this mirror is offered for, as a relay
        if relay and (host is None or not stream):
            raise InvalidArgumentError(
                "a puller relays a version while pulling it (relay=True) with host= and stream=True"
            )
        self.relay, self.relay_cap = relay, relay_cap
        if spare_mirror and host is None:
            raise InvalidArgumentError("a spare mirror is for a relay's readers: it needs host=")
        self.spare_mirror = spare_mirror
        self._spare: tuple[Region | None, int | None, int | None] = (None, None, None)  # (mirror, version, offered)
        self._forwarding: _Forwarder | None = None  # the pull under way's offer, with relay
        self._reading_from = ""  # the relay the pull under way reads from ("": the slot)
        if stream:  # refused now, not at the first pull
            as_streaming(registry)
        self.clock = clock or MonotonicClock()
        self.mirror: Region | None = None
        self.mirror_version: int | None = None  # what the mirror holds, verified
        self.layout_signature: str | None = None
        self.layout_changes = 0
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._remotes: OrderedDict[bytes, Remote] = OrderedDict()
        self._lock: anyio.Lock | None = None  # made lazily: needs a running event loop
        self._last: Pulled | None = None
        self._behind: int | None = None  # versions the mirror lagged when the last pull began
        self._counts = {"pulls": 0, "failed": 0, "torn_reads": 0, "stalls": 0, "borrows": 0}

    async def pull(self, version: int | None = None) -> Pulled:
        """Copy the newest READY version (or `version`, if READY) into the mirror; with
        `stream`, the newest READY or STREAMING one (or `version`, if either).

        Raises `TornReadError` if the lease lapsed during the read, `DigestMismatchError`
        if the publisher recorded digests and a bucket disagrees, `NoProgressError` if no
        read landed for `stall_timeout`, or the transport's error after cancelling the
        other reads. The lease is released on every path. Pulls run one at a time (a
        prefetch and a forced load may overlap): two at once would write the one mirror
        together and hand on a mix."""
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            before = self._last.version if self._last else None
            try:
                pulled = await self._pull_from_sources(version)
            except Exception as exc:
                self._counts["failed"] += 1
                self._counts["torn_reads"] += isinstance(exc, TornReadError)
                self._counts["stalls"] += isinstance(exc, NoProgressError)
                raise
            self._counts["pulls"] += 1
            # Known only for a pull of the newest: then the version pulled was the newest.
            self._behind = pulled.version - before if version is None and before is not None else None
            self._last = pulled
            return pulled

    @asynccontextmanager
    async def borrow(
        self, version: int | None = None, *, wait: float = 0.0, whole: bool = True
    ) -> AsyncIterator[Borrowed]:
        """Lend the newest READY version (or `version`, if READY) in place, for the block:
        the publisher's slot itself, mapped into this process, under a lease renewed
        until the block ends and then released. No mirror and no copy: an apply reads
        straight from the slot into the model, one copy where `pull` then apply make two
        (a GPU slot on this GPU or an NVLink peer over `cuda_ipc`; a host slot for a
        host `device`, over `cuda_ipc` or the in-process `fake`).

        The block only reads. If it ends normally but the lease lapsed meanwhile (a stall
        past the TTL), leaving it raises `TornReadError`: what it read may mix versions,
        so whatever it applied must be undone. Digests are checked, before the block, as
        a pull checks them (a host slot with `verify_digests`). Raises
        `InvalidArgumentError` where the driver cannot lend the slot to `device` (it only
        copies: `pull` instead) or the version is sharded over several slots.

        With `wait` (seconds), it first waits for `version` (without one, any version) to
        turn READY, as the trainer finishes writing it: notified, not polled, and
        `VersionWaitTimeoutError` after `wait`.

        A puller made with `stream=True` leases a version still being written (streamed by
        its publisher), maps its slot and fetches its manifest meanwhile, and lends it the
        moment it turns READY: the READY notice is then all that stands between the
        trainer's last copy and the apply. With `wait` and a `version`, it waits for that
        version to begin streaming (or be READY), even before the trainer begins it. A
        stream that ends otherwise raises `TornReadError` before the block.

        With `whole=False` too, the block is entered at once, while the trainer still
        writes: `lent.landed()` names the tensors as their buckets are committed, so an
        apply runs behind the trainer's copy. Leaving the block then waits for the version
        to turn READY and checks the lease (and a host slot's digests): a stream that ends
        otherwise raises `TornReadError` (from `landed()`, or on leaving), and whatever the
        block applied must be undone, as for a lapsed lease."""
        if not (isinstance(wait, (int, float)) and 0 <= wait < math.inf):
            raise InvalidArgumentError(f"wait must be a finite number of seconds >= 0, got {wait!r}")
        if not whole and not self.stream:
            raise InvalidArgumentError(
                "borrow(whole=False) lends a version still being written: make the Puller with stream=True"
            )
        streaming = as_streaming(self.registry) if self.stream else None
        if wait and streaming is not None and version is not None:  # leasable once its first bucket is marked
            await streaming.wait_for_buckets(version, 1, timeout=wait, **self._line)
        elif wait:  # the manifest comes with the answer: no second fetch
            self._keep_manifest(await self.registry.wait_for_version(version or 0, timeout=wait, **self._line))
        started = self.clock.now()
        if streaming is not None:
            lease = await streaming.acquire(version, ttl=self.ttl, holder=self.holder, streaming=True, **self._line)
        else:
            lease = await self.registry.acquire(version, ttl=self.ttl, holder=self.holder, **self._line)
        renewal, released = None, False
        try:
            manifest = await self._manifest(lease.version)
            check_transport(manifest, self.transport)
            if manifest.shards:
                raise InvalidArgumentError(
                    f"v{manifest.version} is sharded over {len(manifest.shards)} slots; pull() it into a mirror"
                )
            try:
                region = await self._view(manifest)
            except (RegionNotRegisteredError, PeerGoneError):
                self._forget(manifest)  # connect afresh next time
                raise
            if region is None:
                raise InvalidArgumentError(
                    f"the {self.transport.name} driver cannot lend v{manifest.version}'s slot to {self.device} in "
                    "place (it copies): pull() it into a mirror instead"
                )
            renewal = _Renewal(
                self.registry,
                lease,
                _Pacer(self.renew_every, self.ttl, lease, started, self.clock.now()),
                self.clock,
                self.holder,
            )
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(renewal.run, lambda: None)  # a lapse is told when the block ends
                    if whole:
                        manifest = await self._whole(manifest, region, streamed=streaming is not None)
                        lent = Borrowed(manifest.version, manifest, region)
                    else:
                        wait_for = functools.partial(self._wait_for_buckets, manifest, source="")
                        lent = Borrowed(manifest.version, manifest, region, wait=wait_for)
                    try:
                        yield lent
                        if not whole:  # read while written: what it read is good once whole
                            seen = lent._seen[-1].state if lent._seen else None
                            ready = seen in (VersionState.READY, VersionState.RETIRED)
                            await self._whole(manifest, region, streamed=not ready)
                    finally:
                        tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            released = True  # finish() releases it, whatever it says
            await renewal.finish("while it was borrowed; what was read of it may mix versions")
            self._counts["borrows"] += 1
        finally:
            self._manifests.pop(lease.version, None)  # a manifest is trusted for one lease's span
            if not released:
                await release_quietly(self.registry, renewal.lease if renewal else lease, self.holder)

    @property
    def _line(self) -> LineArgs:
        """`publisher=` of the registry calls that pick a version: only when one is named
        (a registry of an earlier release takes none)."""
        return line_args(self.publisher)

    async def _whole(self, manifest: Manifest, region: Region, *, streamed: bool) -> Manifest:
        """A borrowed version once READY (`streamed`: waited for, torn if it ends
        otherwise), its host slot checked against its digests; its manifest, with them."""
        if streamed:  # else seen READY already
            await self._until_ready(manifest, source="")
        if manifest.digests is None and self.stream and self.verify_digests and region.view is not None:
            manifest = await self._manifest(manifest.version)  # the READY one's digests, if any
        if manifest.digests is not None and self.verify_digests and region.view is not None:
            await self._verify(manifest, region)
        return manifest

    async def prepare(self, *, mirror: bool = True) -> int:
        """Do now what the first pull would do first, from the slots publishers registered
        ahead (`Publisher.reserve`): register the mirror at the size their versions take
        (unless `mirror=False`: a replica that only `borrow`s keeps none), connect to each
        slot and map it (page-locking a host slot takes seconds for gigabytes). It runs
        in worker threads, so the event loop keeps renewing leases, and pulls wait for it.
        Returns the slots mapped: 0 while no publisher over this transport has reserved
        any (or the registry takes no reservations). Calling it again maps slots reserved
        since; a slot it cannot map is logged and left to the first pull, which fails on
        it as it would have anyway."""
        if not isinstance(self.registry, ReservingRegistry):
            return 0
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            found = [r for r in await self.registry.reservations() if r.transport == self.transport.name]
            nbytes = max((r.nbytes for r in found), default=0)
            if mirror and nbytes:
                if self.mirror is None:  # only a first mirror: a later one may be being applied
                    self.mirror = await self._allocate(nbytes)
                if self.spare_mirror and self._spare[0] is None:
                    self._spare = (await self._allocate(nbytes), None, None)
            sources = [source for r in found for source in r.sources]
            mapped = 0
            for source in sources:
                try:
                    remote = self._remote(source, keep=len(sources))
                    await anyio.to_thread.run_sync(self.transport.prepare, remote, self.device)
                except WeightpullError as exc:
                    log.warning("%s: could not map a reserved slot ahead: %s", self.holder, exc)
                    continue
                mapped += 1
            return mapped

    def metrics(self) -> dict[str, int | float]:
        """This puller's figures, flat, for a trainer's or a replica's logger: the last
        good pull's version, seconds, bytes, GB/s and lease renewals; how many versions
        the mirror lagged when it began (pulls of the newest after a first one only); and
        counts since this puller was made: good pulls, failed ones, torn reads among
        them, stalls (`NoProgressError`), and versions borrowed in place whose lease held
        (`borrow`)."""
        out: dict[str, int | float] = {f"pull/{k}": v for k, v in self._counts.items()}
        last = self._last
        if last is not None:
            out.update(
                {
                    "pull/version": last.version,
                    "pull/seconds": last.seconds,
                    "pull/bytes": last.nbytes,
                    "pull/gbps": last.nbytes / last.seconds / 1e9 if last.seconds > 0 else 0.0,
                    "pull/lease_renewals": last.renewals,
                }
            )
        if self._behind is not None:
            out["pull/versions_behind"] = self._behind
        return out

    async def _pull_from_sources(self, version: int | None) -> Pulled:
        """`_pull`, again from another source each time a relay fails it (host= only)."""
        failed: list[str] = []
        while True:
            try:
                pulled = await self._pull(version, exclude=failed)
            except _SourceFailed as exc:
                await self._stop_forwarding(pulled=False)
                failed.append(exc.source)
                version = exc.version  # the same version, from elsewhere: never a mix
                if len(failed) >= MAX_SOURCE_TRIES:
                    raise exc.__cause__ or exc from None
                log.warning(
                    "%s: relay %r failed v%s (%s); reading it afresh elsewhere",
                    self.holder,
                    exc.source,
                    exc.version,
                    exc.__cause__,
                )
            except BaseException:
                await self._stop_forwarding(pulled=False)
                raise
            else:
                await self._stop_forwarding(pulled=True)
                return pulled

    async def _stop_forwarding(self, *, pulled: bool) -> None:
        """The end of a relay's pull: a copy pulled stays offered whole; one that failed
        is withdrawn at once, so its readers choose again (the next pull still waits for
        them to end their leases)."""
        forwarding, self._forwarding, self._reading_from = self._forwarding, None, ""
        if forwarding is None or forwarding.sent is None:
            return
        registry, version = forwarding.registry, forwarding.version
        with anyio.CancelScope(shield=True):
            try:
                if not pulled:
                    await registry.withdraw(version, holder=self.holder)
                elif forwarding.sent < len(forwarding.sizes):  # its marks stopped short: say it is whole
                    assert self.host is not None and self.mirror is not None
                    await registry.offer(
                        version,
                        holder=self.holder,
                        host=self.host,
                        descriptor=forwarding.descriptor,
                        cap=self.relay_cap,
                    )
            except WeightpullError as exc:
                log.warning("%s: could not end forwarding v%s: %s", self.holder, version, exc)

    async def _pull(self, version: int | None, exclude: list[str] | None = None) -> Pulled:
        started = self.clock.now()
        if not self.spare_mirror:
            await self._keep_for_readers()
        if self.host is not None:
            lease = await cast(RelayingRegistry, self.registry).acquire(
                version,
                ttl=self.ttl,
                holder=self.holder,
                streaming=self.stream,
                host=self.host,
                exclude=tuple(exclude or ()),
                **self._line,
            )
        elif self.stream:
            lease = await as_streaming(self.registry).acquire(
                version, ttl=self.ttl, holder=self.holder, streaming=True, **self._line
            )
        else:
            lease = await self.registry.acquire(version, ttl=self.ttl, holder=self.holder, **self._line)
        pacer = _Pacer(self.renew_every, self.ttl, lease, started, self.clock.now())
        try:
            manifest = await self._manifest(lease.version)
            check_transport(manifest, self.transport)
            self._checkable(manifest, must=self.host is not None or self._insist)  # refused before any read
            if self.spare_mirror and self.offered is not None:
                await self._take_spare()
            mirror = self._mirror_for(manifest.layout)
            source = lease.source  # as the acquire placed it: "" for the slot, else a relay
            relayed = attrs.evolve(manifest, source=lease.descriptor) if source else manifest
            self._reading_from, self._forwarding = source, self._forwarder(lease.version, manifest, mirror)
            try:
                reads = self._reads(relayed)  # connects to the source
            except TransportError as exc:
                if source:  # a relay gone before the first read: read it elsewhere
                    raise _SourceFailed(source, lease.version) from exc
                raise
            self.mirror_version = None  # overwritten from here on
            try:
                lease, renewals = await self._read_all(lease, pacer, manifest, reads, mirror)
                if source:  # bytes no lease vouches for: each bucket against the publisher's digest
                    manifest = await self._verify_relayed(manifest, mirror, source)
            except (TransportError, NoProgressError, DigestMismatchError) as exc:
                if source:  # the relay failed this copy: all of it is dropped, read elsewhere
                    self._forget(relayed)
                    raise _SourceFailed(source, lease.version) from exc
                if isinstance(exc, (RegionNotRegisteredError, PeerGoneError, NoProgressError)):
                    self._forget(
                        manifest
                    )  # the memory or peer behind those connections is gone or stuck: connect afresh
                raise
            if not source:  # a relayed copy was checked above, every bucket, once
                if self.stream and manifest.digests is None and self.verify_digests:
                    manifest = await self._manifest(manifest.version)  # streamed without: the READY one may have them
                must = self.host is not None or self._insist
                if manifest.digests is not None and self.verify_digests and self._checkable(manifest, must=must):
                    await self._verify(manifest, mirror)
            self.mirror_version = manifest.version
            return Pulled(manifest.version, manifest, mirror, self.clock.now() - started, renewals)
        finally:
            self._manifests.pop(lease.version, None)  # a manifest is trusted for one lease's span
            await release_quietly(self.registry, lease, self.holder)

    def _reads(self, manifest: Manifest) -> list[tuple[Remote, int, int, int]]:
        """(remote, its offset, the mirror's offset, bytes) of each read a pull makes:
        each bucket of the slot; or, of a sharded version, each shard's rows of each
        tensor, straight into their place in the full tensor."""
        if not manifest.shards:
            remote = self._remote(manifest.source)
            return [(remote, b.offset, b.offset, b.nbytes) for b in manifest.layout.buckets]
        reads = []
        for shard in manifest.shards:
            remote = self._remote(shard.source, keep=len(manifest.shards))
            reads += [(remote, *read) for read in shard.reads(manifest.layout)]
        return reads

    async def _read_all(
        self,
        lease: Lease,
        pacer: _Pacer,
        manifest: Manifest,
        reads: list[tuple[Remote, int, int, int]],
        mirror: Region,
    ) -> tuple[Lease, int]:
        """Make every read (concurrently, as the transport sees fit) under the lease."""

        async def read_all(note: Callable[[int], None]) -> None:
            ended: list[Progress] = []  # how the stream ended, if it did before its last batch
            async with anyio.create_task_group() as readers:
                if self._forwarding is not None:  # a relay: in order, each read as early as it can land
                    send, receive = anyio.create_memory_object_stream[_Read](math.inf)
                    with receive:
                        for _ in range(RELAY_READS_IN_FLIGHT):
                            readers.start_soon(self._read_in_order, receive.clone(), note, readers)
                    async with send:
                        async for batch in self._batches(manifest, reads, note, ended):
                            for remote, off, local_off, n in batch:
                                send.send_nowait((remote, off, mirror, local_off, n))
                else:
                    async for batch in self._batches(manifest, reads, note, ended):
                        todo = [(remote, off, mirror, local_off, n) for remote, off, local_off, n in batch]
                        readers.start_soon(self._read_many, todo, note)
            if self.stream and not (ended and ended[-1].state in (VersionState.READY, VersionState.RETIRED)):
                await self._until_ready(manifest)  # READY already seen needs no second word

        return await read_under_lease(
            self.registry,
            lease,
            pacer,
            read_all if reads or self.stream else None,  # else nothing to wait for (every tensor is empty)
            clock=self.clock,
            holder=self.holder,
            stall_timeout=self.stall_timeout,
            what=f"v{manifest.version}",
            total=sum(read[3] for read in reads),
            source=f" from {manifest.publisher!r} over {manifest.transport}; is its publisher alive, and serving "
            "its transport's progress (`async with Publisher(...)`, or `publisher.serve()`)?",
        )

    async def _batches(
        self,
        manifest: Manifest,
        reads: list[tuple[Remote, int, int, int]],
        note: Callable[[int], None],
        ended: list[Progress],
    ) -> AsyncIterator[list[tuple[Remote, int, int, int]]]:
        """The reads, in batches as they may be made: all at once, or of a version still
        STREAMING, each bucket's once the publisher marked it (an unsharded version's
        reads are its buckets, in order). A stream seen ended goes into `ended`."""
        if not self.stream or manifest.shards:
            yield reads
            return
        issued = 0
        while issued < len(reads):
            progress = await self._wait_for_buckets(manifest, issued + 1)
            if progress.state is not VersionState.STREAMING:
                ended.append(progress)
            upto = len(reads) if progress.state is not VersionState.STREAMING else min(progress.committed, len(reads))
            note(0)  # the publisher moved: not a stall
            yield reads[issued:upto]
            issued = upto

    async def _wait_for_buckets(self, manifest: Manifest, at_least: int, source: str | None = None) -> Progress:
        """The stream's progress once `at_least` buckets may be read, or it ended; one
        that ended unfinished is a torn copy. Read from a relay (`source`, by default the
        pull's): the relay's progress, and a relay that offers it no longer is a peer gone
        (read afresh elsewhere)."""
        source = self._reading_from if source is None else source
        try:
            if source:
                relaying = cast(RelayingRegistry, self.registry)
                return await relaying.wait_for_buckets(manifest.version, at_least, source=source)
            return await as_streaming(self.registry).wait_for_buckets(manifest.version, at_least)
        except NoSourceError as exc:
            raise PeerGoneError(f"{self.holder}: {exc}") from exc
        except VersionStateError as exc:
            raise TornReadError(f"{self.holder}: {exc}; the copy was rejected") from exc

    async def _until_ready(self, manifest: Manifest, source: str | None = None) -> None:
        """Return once the version is READY; a stream that ends otherwise is torn."""
        progress = await self._wait_for_buckets(
            manifest, len(manifest.layout.buckets) + 1, source
        )  # more: only its end answers
        if progress.state not in (VersionState.READY, VersionState.RETIRED):  # RETIRED only from READY
            why = f" ({progress.reason})" if progress.reason else ""
            raise TornReadError(
                f"{self.holder}: v{manifest.version} ended {progress.state}{why} while streamed; the copy was rejected"
            )

    async def _read_many(self, reads: list[_Read], landed: Callable[[int], None]) -> None:
        """`transport.read_many(reads)`, calling `landed(nbytes)` as each read lands. A
        driver with a `read_many` of its own (one that batches device copies) is left to
        it, and its reads count as landed together."""
        if self._own_read_many():
            await self.transport.read_many(reads)
            landed(sum(read[4] for read in reads))
            return

        async def read(remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
            await self.transport.read(remote, remote_offset, local, local_offset, nbytes)
            landed(nbytes)

        async with anyio.create_task_group() as tg:
            for r in reads:
                tg.start_soon(read, *r)

    async def _read_in_order(
        self,
        reads: anyio.abc.ObjectReceiveStream[_Read],
        landed: Callable[[int], None],
        tg: anyio.abc.TaskGroup,
    ) -> None:
        """A relay's reads, as they come (bucket order), one at a time: each lands as early
        as it can, and its readers are told at once (`_Forwarder`), in a task of `tg` so
        that the next read need not wait for the registry's answer."""
        forwarding = self._forwarding
        assert forwarding is not None
        async with reads:
            async for read in reads:
                if self._own_read_many():
                    await self.transport.read_many([read])
                else:
                    await self.transport.read(*read)
                landed(read[4])
                forwarding.note(read[3], read[4])
                if not forwarding.busy:  # else the send under way sends the newest count next
                    tg.start_soon(forwarding.send)

    def _own_read_many(self) -> bool:
        """The driver has a `read_many` of its own (one that batches device copies)."""
        return type(self.transport).read_many is not Transport.read_many

    def _forwarder(self, version: int, manifest: Manifest, mirror: Region) -> _Forwarder | None:
        if not self.relay or manifest.shards:
            return None
        registry = cast(RelayingRegistry, self.registry)
        return _Forwarder(self, registry, version, manifest.layout, self.transport.export(mirror))

    async def _verify_relayed(self, manifest: Manifest, mirror: Region, source: str) -> Manifest:
        """Check every bucket of a copy read from relay `source` against the publisher's
        digests (`DigestMismatchError` naming the first that differs); the manifest they
        came in (a stream's, once committed)."""
        if manifest.digests is None and self.stream:  # streamed: the digests came with its commit
            manifest = await self._manifest(manifest.version)
        if manifest.digests is None:  # a registry refuses offers without them; a copy without is no copy
            raise DigestMismatchError(f"v{manifest.version} came from relay {source!r} with no digests to check")
        if len(manifest.digests) != len(manifest.layout.buckets):
            raise DigestMismatchError(
                f"v{manifest.version} came from relay {source!r} with {len(manifest.digests)} digests for "
                f"{len(manifest.layout.buckets)} buckets"
            )
        self._checkable(manifest, must=True)
        await self._verify(manifest, mirror, source)
        return manifest

    def _checkable(self, manifest: Manifest, *, must: bool) -> bool:
        """Whether this puller can check the version's digests where its mirror lies: any
        kind on a host mirror, wsum64 with `digester` on a device. One it must check
        (`must`: it reads from relays, or insists) but cannot is refused, naming the fix."""
        digests = manifest.digests
        if digests is None or self.device == "cpu":
            return True
        kinds = sorted({kind_of(d) for d in digests})
        if self.digester is not None and kinds == [WSUM64]:
            return True
        if must:
            why = "" if self.digester is not None else f", with digester={_TORCH_DIGESTER}"
            raise InvalidArgumentError(
                f"v{manifest.version} records {'/'.join(kinds)} digests, which a mirror on {self.device!r} cannot "
                f"check (only wsum64{why}): publish with digests='wsum64' to read it into a GPU mirror from relays "
                "(or with verify_digests=True), or keep this mirror on the host (device='cpu')"
            )
        return False

    async def offer(self, *, cap: int | None = None) -> int:
        """Offer the version this mirror holds (the last pull's) to other replicas, as a
        relay. Needs `host`. Until the next pull, the mirror is theirs to read too: that
        pull first withdraws the offer and waits until no lease reads from it (the same
        rule as a trainer's slot), so a replica that relays and keeps pulling should give
        its relay a buffer of its own (docs/guides/fanout.md). Returns the version offered."""
        if self.host is None:
            raise InvalidArgumentError("only a puller made with host= offers its mirror as a relay")
        if self.mirror is None or self.mirror_version is None:
            raise InvalidArgumentError("nothing to offer: no pull has completed into this mirror")
        registry = cast(RelayingRegistry, self.registry)
        descriptor = self.transport.export(self.mirror)
        await registry.offer(self.mirror_version, holder=self.holder, host=self.host, descriptor=descriptor, cap=cap)
        self.offered = self.mirror_version
        return self.offered

    async def _take_spare(self) -> None:
        """The mirror is offered: leave it to its readers and pull into the spare one,
        once the spare's own (older) offer is withdrawn and its readers are done. The
        mirrors swap only then: a pull cancelled (or failed) meanwhile leaves both as
        they were, the spare still offered, so the next pull waits for its readers too."""
        spare, spare_version, spare_offered = self._spare
        if spare_offered is not None:
            await self._wait_for_readers(spare_offered)
        self._spare = (self.mirror, self.mirror_version, self.offered)
        self.mirror, self.mirror_version, self.offered = spare, spare_version, None

    async def _keep_for_readers(self) -> None:
        """Before the mirror is overwritten: withdraw its offer, then wait while leases
        still read from it (each ends within its TTL). The offer is forgotten only then:
        a pull cancelled mid-wait, or a withdraw that failed, leaves it to the next pull
        to wait for."""
        if self.offered is not None:
            await self._wait_for_readers(self.offered)
            self.offered = None

    async def _wait_for_readers(self, version: int) -> None:
        """Withdraw this holder's offer of `version` (idempotent), then wait until no lease
        reads it."""
        registry = cast(RelayingRegistry, self.registry)
        await registry.withdraw(version, holder=self.holder)
        while await registry.readers_at(version, self.holder):
            await self.clock.sleep(min(0.05, self.ttl / 10))

    async def _verify(self, manifest: Manifest, mirror: Region, source: str = "") -> None:
        """Every bucket of the copy in `mirror` against the publisher's digests: by
        `digester` where they are wsum64 (where the mirror lies, a GPU's too), else over
        the host's bytes, any kind. `DigestMismatchError` names the first that differs,
        and `source`, the relay it was read from (if any)."""
        buckets, digests = manifest.layout.buckets, manifest.digests or ()  # no digests: nothing to check
        digester = self.digester if digests and all(kind_of(d) == WSUM64 for d in digests) else None

        def check() -> int | None:
            """The position of the first bucket that does not match, if one does not."""
            if digester is not None:
                got = list(digester(mirror, [(b.offset, b.nbytes) for b in buckets]))
                if len(got) != len(buckets):
                    raise InvalidArgumentError(f"the digester gave {len(got)} digests for {len(buckets)} buckets")
                return next((i for i, (want, have) in enumerate(zip(digests, got, strict=False)) if have != want), None)
            view = mirror.host_view()
            for i, (b, want) in enumerate(zip(buckets, digests, strict=False)):
                if not matches(view[b.offset : b.offset + b.nbytes], want):  # any kind the publisher recorded
                    return i
            return None

        bad = await anyio.to_thread.run_sync(check)
        if bad is None:
            return
        index, kind = buckets[bad].index, kind_of(digests[bad])
        if source:
            raise DigestMismatchError(
                f"v{manifest.version}: bucket {index} read from {source!r} does not match the publisher's {kind} digest"
            )
        raise DigestMismatchError(f"v{manifest.version}: bucket {index} does not match its digest")

    async def _manifest(self, version: int) -> Manifest:
        """A version's manifest, fetched once for the lease read under it (a stream's,
        whose digests come at its commit, each time). Kept no longer than that lease: a
        number reclaimed may, much later, be another publisher's (each line numbers its own)."""
        if version in self._manifests:
            return self._manifests[version]
        manifest = await self.registry.get(version)
        if self.stream and manifest.digests is None:  # maybe a stream's, whose digests may come yet
            return manifest
        self._keep_manifest(manifest)
        return manifest

    def _keep_manifest(self, manifest: Manifest) -> None:
        self._manifests[manifest.version] = manifest
        while len(self._manifests) > 4:
            self._manifests.popitem(last=False)

    def _mirror_for(self, layout: Layout) -> Region:
        """The registered mirror. A new layout signature means the model changed shape;
        the mirror is re-registered only if the new layout needs more room."""
        if layout.signature != self.layout_signature:
            if self.layout_signature is not None:
                self.layout_changes += 1
                log.info("%s: layout changed to %s", self.holder, layout.signature[:8])
            self.layout_signature = layout.signature
        if self.mirror is not None and self.mirror.nbytes >= layout.total_bytes:
            return self.mirror
        if self.mirror is not None:
            self.transport.deregister(self.mirror)
            self.mirror = None
        self.mirror = self.transport.allocate(layout.total_bytes, self.device)
        return self.mirror

    async def _view(self, manifest: Manifest) -> Region | None:
        """The slot lent in place; in a worker thread where the driver's mapping may take
        seconds (page-locking a host slot), as `_allocate` does."""
        view = functools.partial(self.transport.view, self._remote(manifest.source), self.device)
        return await anyio.to_thread.run_sync(view) if self.transport.slow_allocate else view()

    async def _allocate(self, nbytes: int) -> Region:
        """A mirror made ahead, its pages touched: the first pull then runs as the rest."""

        def allocate() -> Region:
            region = self.transport.allocate(nbytes, self.device)
            fault_in(region)
            return region

        return await anyio.to_thread.run_sync(allocate) if self.transport.slow_allocate else allocate()

    def _remote(self, descriptor: bytes, keep: int = 1) -> Remote:
        """Connect once per slot descriptor, not once per pull; never drop one of the
        `keep` used last (a sharded pull uses one per shard)."""
        remote = self._remotes.get(descriptor)
        if remote is None:
            remote = self._remotes[descriptor] = self.transport.connect(descriptor)
            if len(self._remotes) > max(_MAX_REMOTES, keep):
                self.transport.disconnect(self._remotes.popitem(last=False)[1])
        self._remotes.move_to_end(descriptor)
        return remote

    def _forget(self, manifest: Manifest) -> None:
        for descriptor in [manifest.source] + [shard.source for shard in manifest.shards or ()]:
            remote = self._remotes.pop(descriptor, None)
            if remote is not None:
                self.transport.disconnect(remote)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):  # the block's cancellation must not leave the mirror registered
            await self.aclose()

    async def aclose(self) -> None:
        """Disconnect from every slot and deregister the mirror. The registry and the
        transport are the caller's: they stay open. Closing twice is harmless; a later
        `pull` registers a mirror afresh."""
        for remote in self._remotes.values():
            self.transport.disconnect(remote)
        self._remotes.clear()
        if self.mirror is not None:
            self.transport.deregister(self.mirror)
            self.mirror = None
            self.mirror_version = None
        if self._spare[0] is not None:
            self.transport.deregister(self._spare[0])
        self._spare = (None, None, None)
