"""The lease client: how a reader holds a lease on the version it reads. It acquires
(by mode: the newest READY, one still streamed, or placed at a source with `host=`),
renews on the registry's clock while the read runs (`Pacer`), ends a read in which no
bytes land (`Silence`, judged by the grants' stamps), and checks the lease held
throughout before the copy is handed on (`Renewal`). `LeaseClient` is the small face of
it that `Puller` and `SlicePuller` share.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import NoReturn, TypedDict, cast

import anyio

from .clock import Clock
from .errors import (
    InvalidArgumentError,
    InvalidTransitionError,
    LeaseExpiredError,
    LeaseNotFoundError,
    NoProgressError,
    TornReadError,
    WeightpullError,
    first_error,
)
from .principals import Principal
from .registry import Lease, Registry, RelayingRegistry, as_streaming
from .settings import DEFAULT_STALL_TIMEOUT, MIN_TTL_ROUND_TRIPS, LeaseSettings

__all__ = [
    "DEFAULT_STALL_TIMEOUT",
    "FlatLeaseArgs",
    "LeaseClient",
    "LeaseSettings",
    "LineArgs",
    "MIN_TTL_ROUND_TRIPS",
    "Pacer",
    "Renewal",
    "Silence",
    "check_lease_settings",
    "check_line",
    "default_holder",
    "line_args",
    "read_under_lease",
    "release_quietly",
]

log = logging.getLogger(__name__)

_LEASE_LOST = (LeaseExpiredError, LeaseNotFoundError, InvalidTransitionError)

# The rates (local seconds per registry second) the renewal pacing believes. The slowest
# is also assumed before a pull has measured its rate; a clock even faster than the
# fastest renews more often than it needs to, never too late.
_RATE_MIN, _RATE_MAX = 1 / 8, 8.0
# Round trips timed, beside the acquire's own, before a TTL is refused as too short: the
# least of them is the round trip, so one slow answer does not refuse a good TTL.
_RTT_PROBES = 3


class Pacer:
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


def default_holder(registry: Registry) -> str:
    """A holder name for a puller that gives none: below its registry's principal's own
    name, where a served registry lets a reader hold leases; else a fresh one."""
    principal = getattr(registry, "principal", None)
    suffix = f"puller-{uuid.uuid4().hex[:8]}"
    if isinstance(principal, Principal) and not principal.is_admin:
        return f"{principal.name}/{suffix}"
    return suffix


def check_lease_settings(ttl: float, renew_every: float | None, stall_timeout: float | None) -> float:
    """What a reader's lease settings must be (`LeaseSettings`); the renewal interval
    (default, and at most, a third of the TTL)."""
    return LeaseSettings(ttl, renew_every, stall_timeout).renew_interval


def check_line(publisher: object) -> str | None:
    """A reader's `publisher=`: the name of the principal whose line of versions it follows, or None."""
    if publisher is not None and (not isinstance(publisher, str) or not publisher or "/" in publisher):
        raise InvalidArgumentError(
            f"publisher names the principal whose versions to follow (its name, as `keys new --name` gave it), "
            f"got {publisher!r}"
        )
    return publisher


class FlatLeaseArgs(TypedDict, total=False):
    """The `LeaseSettings` a reader also takes one by one, as keyword arguments (the form
    it has always had): each is the field of the same name."""

    ttl: float
    renew_every: float | None
    stall_timeout: float | None


class LineArgs(TypedDict, total=False):
    publisher: str


def line_args(publisher: str | None) -> LineArgs:
    """`publisher=` as a registry call takes it: only when a line is named."""
    return {} if publisher is None else {"publisher": publisher}


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
    pacer: Pacer,
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
    renewal = Renewal(registry, lease, pacer, clock, holder)
    silence = None if stall_timeout is None else Silence(pacer, clock.now())
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

    async def watchdog(timeout: float, silence: Silence) -> None:
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


class Silence:
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

    def __init__(self, pacer: Pacer, now: float) -> None:
        self.pacer = pacer
        self.newest, self.newest_asked = pacer.last  # the newest grant's stamp, and the local time it was asked
        self.stamped = math.isfinite(self.newest)
        self.last_landed = now  # local time
        self.mark = self._date(now)  # the registry's time of the last landing, at most

    def _date(self, local: float) -> float:
        slowest = self.pacer.measured or _RATE_MIN  # local seconds per registry second, at least
        return self.newest + max(0.0, local - self.newest_asked) / slowest

    def landed(self, now: float) -> None:
        """A read landed at local time `now`."""
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
        """The silence at local time `now`, in the registry's seconds (`answering`: the
        last renewal was granted; else the local clock counts too)."""
        local = now - self.last_landed
        if not self.stamped:
            return local
        registry = max(0.0, self.newest - self.mark)
        return registry if answering else max(registry, local / _RATE_MAX)


class Renewal:
    """A lease renewed when `pacer` says, until cancelled, and checked at the end: what a
    read under a lease and a borrowed slot share."""

    def __init__(self, registry: Registry, lease: Lease, pacer: Pacer, clock: Clock, holder: str) -> None:
        self.registry, self.lease, self.pacer, self.clock, self.holder = registry, lease, pacer, clock, holder
        self.renewals = 0
        self.lost: list[BaseException] = []  # why the registry ended the lease, if it did
        self.answering = True  # whether the last renewal was granted
        self.on_grant: Callable[[Lease, float], None] | None = None  # each grant, and the local time it was asked
        self._on_lost: Callable[[], object] = lambda: None

    async def run(self, on_lost: Callable[[], object]) -> None:
        """Renew when the pacer says, until cancelled or the registry ends the lease
        (then `on_lost()`)."""
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
        raise TornReadError(f"{self.holder}: the lease on v{self.lease.version} lapsed {what}{self.cause()}") from (
            self.lost[0] if self.lost else None
        )

    def cause(self) -> str:
        """Why the lease lapsed, as far as this reader can tell: for want of a renewal in
        time (the registry said it expired, or more than its TTL passed since the last
        grant), whose fix is a longer TTL; or ended by the registry while renewed in
        time (forgotten by a restart, or released elsewhere), which no TTL fixes."""
        ttl = self.lease.ttl
        last = getattr(self.pacer, "last", None)  # (registry stamp, local time asked) of the newest grant
        since = math.inf if last is None else self.clock.now() - last[1]
        expired = bool(self.lost) and isinstance(self.lost[0], LeaseExpiredError)
        if expired or (not self.lost and math.isfinite(ttl) and since >= ttl):
            passed = "" if last is None else f"{since:.3g} s passed since its last grant, against "
            return (
                f"; it lapsed for want of a renewal in time: {passed}"
                f"its ttl={ttl:g} s (a renewal came too late: a TTL too short for the registry's "
                f"round trips, or a paused process or event loop). Pass a longer ttl= (the default is 10 s)"
            )
        said = f" ({self.lost[0]})" if self.lost else ""
        return (
            f"; the registry ended it{said} though it was renewed in time (a registry restarted, or the lease "
            "released by another reader under the same holder name): a longer ttl would not help"
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


class LeaseClient:
    """One reader's leases: acquired by mode, renewed on the registry's clock while a read
    runs, watched for stalls, checked before a copy is handed on, and released. What a
    `Puller` and a `SlicePuller` share.

    Args:
        registry: The registry leases are asked of.
        settings: The TTL, renewal and stall rules (`LeaseSettings`).
        holder: The name leases are held under (`default_holder` of the registry if None).
        clock: The local clock (it may run at another rate than the registry's).
        publisher: The line of versions followed (its publisher principal's name), or
            None for the registry's default line.

    Raises:
        InvalidArgumentError: `publisher` is not a principal's name.
    """

    def __init__(
        self,
        registry: Registry,
        settings: LeaseSettings,
        *,
        holder: str | None,
        clock: Clock,
        publisher: str | None = None,
    ) -> None:
        self.registry, self.settings, self.clock = registry, settings, clock
        self.holder = holder or default_holder(registry)
        self.publisher = check_line(publisher)
        self.round_trip: float | None = None  # the registry's round trip, once the TTL was checked against it

    @property
    def line(self) -> LineArgs:
        """`publisher=` of the registry calls that pick a version: only when one is named
        (a registry of an earlier release takes none)."""
        return line_args(self.publisher)

    async def acquire(
        self,
        version: int | None,
        *,
        streaming: bool = False,
        host: str | None = None,
        exclude: Sequence[str] = (),
        part: str | None = None,
    ) -> tuple[Lease, Pacer]:
        """A lease on `version` (None: the newest READY one; with `streaming`, READY or
        STREAMING), placed at a source the registry picks when `host` is given (but none
        of `exclude`; of slice layout `part`, if named), and the pacer of its renewals."""
        ttl, holder, sent = self.settings.ttl, self.holder, self.clock.now()
        if host is not None:
            relaying = cast(RelayingRegistry, self.registry)
            if part is None:  # named only for a slice: a registry of an earlier release takes no part
                lease = await relaying.acquire(
                    version, ttl=ttl, holder=holder, streaming=streaming, host=host, exclude=tuple(exclude), **self.line
                )
            else:
                lease = await relaying.acquire(
                    version,
                    ttl=ttl,
                    holder=holder,
                    streaming=streaming,
                    host=host,
                    exclude=tuple(exclude),
                    part=part,
                    **self.line,
                )
        elif streaming:
            lease = await as_streaming(self.registry).acquire(
                version, ttl=ttl, holder=holder, streaming=True, **self.line
            )
        else:
            lease = await self.registry.acquire(version, ttl=ttl, holder=holder, **self.line)
        received = self.clock.now()
        pacer = Pacer(self.settings.renew_interval, ttl, lease, sent, received)
        if self.round_trip is None:
            await self._check_ttl(lease, received - sent)
        return lease, pacer

    async def _check_ttl(self, lease: Lease, first: float) -> None:
        """At the first acquire: refuse a TTL below `MIN_TTL_ROUND_TRIPS` round trips to
        the registry (timed on the local clock: the acquire's, and when that one is too
        slow for the TTL, a few `is_valid` calls, the least of them counting), for its
        renewals could not reach the registry in time and every read would be torn. The
        lease just granted is released first."""
        ttl, samples = self.settings.ttl, [first]
        while ttl < MIN_TTL_ROUND_TRIPS * min(samples) and len(samples) <= _RTT_PROBES:
            sent = self.clock.now()
            await self.registry.is_valid(lease)
            samples.append(self.clock.now() - sent)
        rtt = min(samples)
        if ttl >= MIN_TTL_ROUND_TRIPS * rtt:
            self.round_trip = rtt
            return
        await self.release(lease)
        least = MIN_TTL_ROUND_TRIPS * rtt
        raise InvalidArgumentError(
            f"ttl={ttl:g} s is below {MIN_TTL_ROUND_TRIPS} round trips to the registry (one took {rtt * 1e3:.3g} ms "
            f"here, the least of {len(samples)}): renewals could not reach it before the lease lapsed, and reads "
            f"would be torn ('the copy may mix versions'). Pass ttl= of at least {least:.2g} s; the default, 10 s, "
            "suits any registry that answers within a second"
        )

    async def read(
        self,
        lease: Lease,
        pacer: Pacer,
        read_all: Callable[[Callable[[int], None]], Awaitable[None]] | None,
        *,
        what: str,
        total: int,
        source: str = "",
        copy: str = "copy",
    ) -> tuple[Lease, int]:
        """`read_under_lease` with this client's clock, holder and stall timeout."""
        return await read_under_lease(
            self.registry,
            lease,
            pacer,
            read_all,
            clock=self.clock,
            holder=self.holder,
            stall_timeout=self.settings.stall_timeout,
            what=what,
            total=total,
            source=source,
            copy=copy,
        )

    def renewal(self, lease: Lease, pacer: Pacer) -> Renewal:
        """The renewal of `lease` for a block that holds it (a borrow): run it, then `finish`."""
        return Renewal(self.registry, lease, pacer, self.clock, self.holder)

    async def release(self, lease: Lease) -> None:
        """Release `lease`, even while cancelled; a failure is logged (it ends by TTL anyway)."""
        await release_quietly(self.registry, lease, self.holder)
