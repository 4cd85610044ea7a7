"""What the fuzzers hold weightpull to: a model of the protocol, and observers that check
the real registry, publisher and pullers against it as they run. Test code only.

`World` wires one registry, one or more publishers and any number of reader processes on
one fake clock. The model learns of every lease through each reader's `ReaderLink`, of
every reclaim through each publisher's `PublisherLink` and of every slot write through
its `ObservedAdapter`, and asserts at once when a write lands on a slot whose version a
live lease still holds.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import io
import itertools
import math
from collections.abc import Callable

import anyio
import attrs
from hypothesis import currently_in_test_context, event

from weightpull import (
    FakeClock,
    HostTensor,
    InProcessRegistry,
    Lease,
    NoProgressError,
    NoReadyVersionError,
    Publisher,
    PublishError,
    PublishResult,
    Pulled,
    Puller,
    Registry,
    SlotState,
    TornReadError,
    Transport,
    TransportError,
    VersionState,
    WeightpullError,
    WhenFull,
)
from weightpull.clock import ScaledClock
from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.drivers.faulty import Faults, FaultyTransport
from weightpull.errors import (
    NoFreeSlotError,
    PeerGoneError,
    RegionNotRegisteredError,
    SlotWaitTimeoutError,
    VersionOrderError,
)
from weightpull.principals import Principal
from weightpull.registry_machine import QUARANTINED_NUMBERS
from weightpull.tensors import HostTensorAdapter

from . import profiles

TTL = 6.0  # every reader's lease TTL; renewed every TTL / 3 while a read runs
STALL = 30.0  # a pull in which no read lands this long ends with NoProgressError
# The watchdog judges on the registry's clock, from its grants' stamps: never early, and at
# most a renewal interval late (TTL / 3; 1.25 times that for a clock slower than 1/8).
STALL_LATE = TTL / 2
# Local seconds per registry second of a reader's clock: a host whose clock runs slow or fast.
READER_RATES = (0.1, 0.25, 1.0, 1.0, 4.0, 10.0)
WAIT_TIMEOUT = 4.0  # the publisher's bound on waiting for a free slot (policy WAIT)
POLL = 0.5
# Fake time is a sum of floats: a wait begun at 10.999999999999998, or a 2 s copy taken in
# thirds, ends a few ulps (~1e-14 s) off the exact figure. The model allows this much when
# it holds a duration to a bound; every real step here lasts tens of milliseconds or more.
# (Lease expiry is not such a bound: the model judges it exactly as the registry does.)
EPS = 1e-6
BUCKET_BYTES = 1024
LAYOUTS: dict[str, tuple[tuple[str, int], ...]] = {
    "base": (("a", 300), ("b", 700), ("c", 1200)),
    "grown": (("a", 300), ("b", 700), ("c", 5000)),  # outgrows the slot: re-registered
    "renamed": (("x", 2000), ("y", 100)),
}
FAULTS = (None, "fail", "tear", "slow")  # what a reader's next pull suffers

# Core defects the fuzzers steer around until their fix lands, each shown by a strict-xfail
# test (tests/test_stream_regressions.py) of the same name: drop the name once it passes.
# - stream-publish-error-groups: a streamed publish that fails raises PublishError chained
#   to `_stream`'s task groups' ExceptionGroups, not to the cause (the model unwraps them).
# - stream-retired-after-ready: a streamed pull whose version turned READY, then RETIRED
#   (withdrawn, or retired by a newer announcement) before the reader looked again, is
#   rejected as torn though its lease held and its copy is whole (the model lets it pass).
AWAITING_FIX: set[str] = set()  # known core defects the world steers around until fixed: none now


def leaves(exc: BaseException | None) -> list[BaseException]:
    """The exceptions inside (nested) exception groups."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [] if exc is None else [exc]


def cause(exc: BaseException) -> BaseException | None:
    """What a `PublishError` is chained to (unwrapped, while stream-publish-error-groups waits)."""
    found = exc.__cause__
    if "stream-publish-error-groups" in AWAITING_FIX and isinstance(found, BaseExceptionGroup):
        (found,) = leaves(found)
    return found


def tensors(version: int, layout: str) -> dict[str, bytes]:
    """Each version's bytes differ in every tensor, so any mix of versions shows."""
    return {name: (f"v{version}/{name}/".encode() * n)[:n] for name, n in LAYOUTS[layout]}


def note(what: str) -> None:
    """Count `what` in Hypothesis' statistics (pytest --hypothesis-show-statistics)."""
    if currently_in_test_context():
        event(what)
    profiles.event(what)


def faults(kind: str | None) -> Faults:
    if kind == "fail":
        return Faults(fail_reads=1)
    if kind == "tear":  # frozen a whole TTL: the lease lapses while the bytes change
        return Faults(tear_reads=1, freeze=TTL)
    if kind == "slow":  # reads outlast the lease: only renewal keeps it
        return Faults(delay=TTL * 1.5)
    return Faults()


# -- running the event loop by hand ------------------------------------------------------------


class Hang(AssertionError):
    """Every task waits and nothing would ever wake one: something waits forever."""


async def settle(max_rounds: int = 10_000) -> None:
    """Return once every other task is blocked and no callback is due. (anyio's
    wait_all_tasks_blocked polls every 0.1 s on asyncio: far too slow for thousands of
    steps, and blind to callbacks such as a cancellation still being delivered.)"""
    loop = asyncio.get_running_loop()
    for _ in range(max_rounds):
        await asyncio.sleep(0)
        if not loop._ready:  # every runnable task has a callback queued there
            return
    raise Hang(f"the event loop was still busy after {max_rounds} rounds: a busy loop")


async def autojump(clock: FakeClock) -> None:
    """`FakeClock.autojump`, over `settle`; and where that would wait for a new sleeper,
    this raises `Hang`: every task of a fuzzing run is ours, so nobody would come."""
    while True:
        await settle()
        deadline = clock.next_deadline()
        if deadline is None:
            raise Hang("every task is blocked and no timer is pending")
        clock.advance(deadline - clock.now())


class Loop:
    """An asyncio loop that a state machine steps by hand: a task started in one rule
    stays where it blocked until a later rule runs the loop again. Single-threaded and
    FIFO, so a run replays exactly."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.loop = asyncio.new_event_loop()

    def run(self, fn: Callable, *args):
        """`await fn(*args)`, then let every task run until all are blocked."""

        async def body():
            result = await fn(*args)
            await settle()
            return result

        return self.loop.run_until_complete(body())

    def spawn(self, fn: Callable, *args) -> asyncio.Task:
        task = self.loop.create_task(fn(*args))
        self.run(settle)
        return task

    def advance(self, seconds: float) -> None:
        """Move time at once: no task runs in between, as if every process stalled."""

        async def jump() -> None:
            self.clock.advance(seconds)

        self.run(jump)

    def pass_time(self, seconds: float, until: asyncio.Task | None = None) -> None:
        """Let `seconds` pass timer by timer, every task running at each (or stop early
        once `until` is done)."""
        end = self.clock.now() + seconds
        while until is None or not until.done():
            deadline = self.clock.next_deadline()
            if deadline is None or deadline > end:
                self.advance(end - self.clock.now())
                return
            self.advance(deadline - self.clock.now())

    def finish(self, task: asyncio.Task, limit: float) -> None:
        """Run until `task` is done; it must be within `limit` seconds of fake time."""
        self.run(settle)
        self.pass_time(limit + EPS, until=task)
        if not task.done():
            where = io.StringIO()
            task.print_stack(file=where)
            raise Hang(f"still waiting after {limit} s of fake time:\n{where.getvalue()}")

    def close(self) -> None:
        tasks = asyncio.all_tasks(self.loop)
        for task in tasks:
            task.cancel()
        if tasks:
            self.loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        self.loop.close()


# -- the model ------------------------------------------------------------------------------


@attrs.define
class LeaseRecord:
    lease: Lease  # as last granted or renewed
    granted_at: float
    released_at: float | None = None

    def live(self, now: float) -> bool:
        return self.released_at is None and now < self.lease.expires_at

    def lapsed(self, now: float) -> bool:
        """It ran out before it was released (a lapsed lease never comes back)."""
        return (now if self.released_at is None else self.released_at) >= self.lease.expires_at


@attrs.define
class Line:
    """One publisher's line of versions, as the model keeps it (registry_machine's rule)."""

    newest: int | None = None  # its newest READY version
    announced: list[int] = attrs.Factory(list)
    highest_begun: int = 0
    order: tuple[int, int] = (0, 0)  # (its last announcement, its last begin), counted


@attrs.define
class Model:
    """What the registry and the slots must hold, kept apart from the code under test.
    Each publisher (a principal of its own) writes a line of its own; a reader that
    names none follows the default line, the READY line that announced last."""

    clock: FakeClock
    slots: dict[str, list[int | None]]  # the version each publisher's slot holds, or None
    states: dict[int, VersionState] = attrs.Factory(dict)  # versions not yet reclaimed
    contents: dict[int, dict[str, bytes]] = attrs.Factory(dict)
    lines: dict[str, Line] = attrs.Factory(dict)  # by publisher
    owner: dict[int, str] = attrs.Factory(dict)  # the publisher of each version begun
    leases: dict[str, LeaseRecord] = attrs.Factory(dict)
    versions: itertools.count = attrs.Factory(lambda: itertools.count(1))
    buckets: dict[int, int] = attrs.Factory(dict)  # a streamed version's bucket count
    marks: dict[int, int] = attrs.Factory(dict)  # a streamed version's buckets marked so far
    aborted: set[int] = attrs.Factory(set)  # versions whose publish failed once begun
    delta_bases: dict[int, int] = attrs.Factory(dict)  # each version announced with a delta: its base
    gone: set[int] = attrs.Factory(set)  # versions whose slot's memory died with their publisher's process
    # The numbers reclaimed last, which no line may take yet.
    quarantined: collections.deque[int] = attrs.Factory(lambda: collections.deque(maxlen=QUARANTINED_NUMBERS))
    _count: itertools.count = attrs.Factory(lambda: itertools.count(1))

    def line(self, publisher: str) -> Line:
        return self.lines.setdefault(publisher, Line())

    def default(self) -> str | None:
        """The line a reader that names none follows."""
        ready = [p for p, line in self.lines.items() if line.newest is not None]
        return max(ready or self.lines, key=lambda p: self.lines[p].order, default=None)

    @property
    def newest(self) -> int | None:
        """The default line's newest READY version."""
        default = self.default()
        return None if default is None else self.lines[default].newest

    @property
    def announced(self) -> set[int]:
        return {v for line in self.lines.values() for v in line.announced}

    def live(self, version: int | None) -> list[LeaseRecord]:
        now = self.clock.now()
        return [r for r in self.leases.values() if r.lease.version == version and r.live(now)]

    def free_slots(self, publisher: str) -> list[int]:
        """Slots a publisher may write: never its line's newest READY, never one leased."""
        held, newest = self.slots[publisher], self.line(publisher).newest
        return [i for i, v in enumerate(held) if v is None or (v != newest and not self.live(v))]

    def holds(self, version: int) -> bool:
        return any(version in held for held in self.slots.values())

    def holds_newest(self, publisher: str) -> bool:
        newest = self.line(publisher).newest
        return newest is not None and newest in self.slots[publisher]

    def streaming(self, publisher: str | None = None) -> list[int]:
        """STREAMING versions (of `publisher`'s line, if named)."""
        return [
            v
            for v, state in self.states.items()
            if state is VersionState.STREAMING and (publisher is None or self.owner.get(v) == publisher)
        ]

    # Each of these is told what the code under test just did, and checks it.

    def granted(self, lease: Lease, asked: int | None, streaming: bool = False) -> LeaseRecord:
        """A plain acquire gets the default line's newest READY version, never a
        STREAMING one; a streaming acquire that line's newest READY or STREAMING one."""
        state = self.states.get(lease.version)
        default = self.default()
        if streaming:
            newest = max([*(self.streaming(default) if default else []), -1 if self.newest is None else self.newest])
            if asked is None:
                assert lease.version == newest, (
                    f"streaming, leased v{lease.version}, but the newest readable is v{newest} (of {default})"
                )
            assert state in (VersionState.READY, VersionState.STREAMING), f"streaming, leased v{lease.version}: {state}"
            note(f"lease streaming: a {state} version")
        else:
            if asked is None:
                assert lease.version == self.newest, f"leased v{lease.version}, but the newest READY is v{self.newest}"
            assert state is VersionState.READY, f"leased v{lease.version}, which is {state}, not READY"
        record = self.leases[lease.id] = LeaseRecord(lease, self.clock.now())
        return record

    def renewed(self, lease: Lease) -> None:
        record = self.leases[lease.id]
        assert record.live(self.clock.now()), f"the registry renewed lease {lease.id}, which had ended"
        record.lease = lease

    def released(self, lease: Lease) -> None:
        record = self.leases[lease.id]
        if record.released_at is None:
            record.released_at = self.clock.now()

    def reclaimed(self, version: int) -> None:
        owner = self.owner.get(version)
        assert owner is None or version != self.line(owner).newest, f"v{version}, {owner}'s newest READY, was reclaimed"
        live = self.live(version)
        assert not live, f"v{version} was reclaimed while live leases hold it: {live}"
        del self.states[version]
        self.quarantined.append(version)
        for held in self.slots.values():  # its slot holds nothing anyone may read now
            held[:] = [None if v == version else v for v in held]

    def begun(self, publisher: str, slot: int, asked: int | None, given: int) -> None:
        """The registry gave `given` for a version asked as `asked` into `slot`: above
        every number its line began before; the one asked whenever that was free (held
        by no version, and not one just reclaimed), else the next free one after it."""
        line = self.line(publisher)
        first = line.order[1] == 0  # its line never began a version
        assert given > line.highest_begun, f"{publisher} was given v{given}, not above v{line.highest_begun}"
        start = line.highest_begun + 1 if asked is None or asked <= line.highest_begun else asked
        if first and asked is None:  # a new line's first "next": after every number begun anywhere
            start = max(x.highest_begun for x in self.lines.values()) + 1
        expected = start
        while expected in self.states or expected in self.quarantined:
            expected += 1
        assert given == expected, f"{publisher} asked for v{asked} and was given v{given}, not v{expected}"
        held = self.slots[publisher][slot]
        where = f"slot {slot} of {publisher}"
        if held is not None:
            assert held != line.newest, f"{where} was begun again while it held v{held}, the newest READY"
            live = self.live(held)
            assert not live, f"{where} was begun again while live leases hold its v{held}: {live}"
            assert held not in self.states, f"{where} was begun again while the registry still has its v{held}"
        self.slots[publisher][slot] = given
        self.states[given] = VersionState.WRITING
        self.owner[given] = publisher
        line.highest_begun = given
        line.order = (line.order[0], next(self._count))

    def slot_written(self, publisher: str, slot: int, version: int) -> None:
        held = self.slots[publisher][slot]
        assert held == version, f"slot {slot} of {publisher} was written for v{version}, but it was begun for v{held}"
        assert self.states.get(version) in (VersionState.WRITING, VersionState.STREAMING), (
            f"v{version} was written while {self.states.get(version)}"
        )

    def streamed(self, version: int, buckets: int) -> None:
        assert self.states.get(version) is VersionState.WRITING, f"v{version} streamed while {self.states.get(version)}"
        self.states[version] = VersionState.STREAMING
        self.buckets[version] = buckets
        self.marks[version] = 0

    def marked(self, version: int, count: int, landed: Callable[[int], bool]) -> None:
        """Marks only grow, never past the buckets, and never ahead of the copy:
        `landed(b)` says whether every byte of bucket `b` was written."""
        assert self.states.get(version) is VersionState.STREAMING, f"v{version} marked while {self.states.get(version)}"
        assert self.marks[version] < count <= self.buckets[version], (
            f"v{version} marked {count} after {self.marks[version]}, of {self.buckets[version]} buckets"
        )
        unwritten = [b for b in range(count) if not landed(b)]
        assert not unwritten, f"v{version} marked {count} buckets, but buckets {unwritten} are not written yet"
        self.marks[version] = count

    def committed(self, version: int, publisher: str, slot: int) -> None:
        held = self.slots[publisher][slot]
        assert held == version, f"v{version} announced in slot {slot} of {publisher}, which holds v{held}"
        line = self.line(publisher)
        last = line.announced[-1] if line.announced else None
        assert last is None or version > last, f"{publisher}'s v{version} announced after its v{last}"
        state = self.states.get(version)
        assert state in (VersionState.WRITING, VersionState.STREAMING), f"v{version} announced while {state}"
        # A streamed version's last buckets may go unmarked (marks are batched): its commit,
        # sent once every copy landed (the publish returned), says the rest.
        if line.newest is not None:  # its own line's alone: another's newest stays READY
            self.states[line.newest] = VersionState.RETIRED
        self.states[version] = VersionState.READY
        line.newest = version
        line.announced.append(version)
        line.order = (next(self._count), line.order[1])

    def withdrawn(self) -> None:
        """The default line's newest READY version was retired."""
        default = self.default()
        assert default is not None and self.lines[default].newest is not None
        self.states[self.lines[default].newest] = VersionState.RETIRED
        self.lines[default].newest = None


# -- observers -----------------------------------------------------------------------------


class ObservedAdapter(HostTensorAdapter):
    """A publisher's copy into a slot, watched: the model checks every write before a
    byte lands. The copy takes `seconds` of fake time; `crash` makes the next one fail
    after its first tensor, as a lost device would."""

    def __init__(self, model: Model, clock: FakeClock) -> None:
        self.model = model
        self.clock = clock
        self.publisher: Publisher | None = None
        self.writing: int | None = None  # the version being published (the number the registry gave)
        self.seconds = 0.0
        self.crash = False
        self.tensors = 1  # how many the publish in flight copies (a stream, a bucket per write)
        self.written: set[str] = set()  # the tensors of the publish in flight written whole

    def start(self, tensors: int, crash: bool) -> None:
        """Ready the copy of the next publish."""
        self.writing = None
        self.crash = crash
        self.tensors = tensors
        self.written = set()

    def landed(self, layout, bucket: int) -> bool:
        return set(layout.buckets[bucket].names) <= self.written

    async def write(self, items, region) -> None:
        slot = next(s.index for s in self.publisher.slots if s.region is region)
        self.model.slot_written(self.publisher.name, slot, self.writing)
        for item in items:
            if self.crash and len(self.written) == 1:
                raise RuntimeError("injected: the device was lost mid-copy")
            await super().write([item], region)
            self.written.add(item[1].spec.name)
            await self.clock.sleep(self.seconds / self.tensors)


class PublisherLink:
    """A publisher's line to the registry: the model hears of every reclaim (a slot is
    reclaimed before its publish begins, which may still fail) and of every number the
    registry gives a begin, which its adapter then writes."""

    def __init__(self, registry: Registry, model: Model, adapter: ObservedAdapter | None = None) -> None:
        self.registry = registry
        self.model = model
        self.adapter = adapter
        self.data: dict[str, bytes] = {}  # what the publish in flight copies
        self.layout = None  # the layout of the version it streams

    def __getattr__(self, name: str):
        return getattr(self.registry, name)

    async def begin(self, version: int | None = None, *, publisher: str, slot: int, **shard) -> int:
        given = await self.registry.begin(version, publisher=publisher, slot=slot, **shard)
        self.model.begun(publisher, slot, version, given)
        self.model.contents[given] = self.data
        if self.adapter is not None:
            self.adapter.writing = given
        return given

    async def reclaim(self, version: int) -> None:
        await self.registry.reclaim(version)
        self.model.reclaimed(version)

    async def commit(self, manifest) -> None:
        await self.registry.commit(manifest)
        if manifest.delta is not None:
            assert not manifest.shards and manifest.delta.base < manifest.version
            self.model.delta_bases[manifest.version] = manifest.delta.base

    async def stream(self, manifest) -> None:
        await self.registry.stream(manifest)
        self.layout = manifest.layout
        self.model.streamed(manifest.version, len(manifest.layout.buckets))

    async def mark(self, version: int, committed: int) -> None:
        await self.registry.mark(version, committed)
        self.model.marked(version, committed, lambda b: self.adapter.landed(self.layout, b))


_GRANTS: contextvars.ContextVar[list[LeaseRecord]] = contextvars.ContextVar("grants")


class ReaderLink:
    """A reader process's line to the registry. It tells the model of every lease (and
    the pull running in this task of the lease it got); once the process is dead it
    sends nothing more, not even the release."""

    def __init__(self, registry: Registry, model: Model) -> None:
        self.registry = registry
        self.model = model
        self.dead = False

    async def _alive(self) -> None:
        if self.dead:  # a call already under way as the process died never arrives
            await anyio.sleep_forever()

    def __getattr__(self, name: str):  # what a reader never calls, so that it is a StreamingRegistry
        return getattr(self.registry, name)

    async def acquire(self, version: int | None = None, *, ttl: float, holder: str, streaming: bool = False) -> Lease:
        await self._alive()
        lease = await self.registry.acquire(version, ttl=ttl, holder=holder, streaming=streaming)
        _GRANTS.get([]).append(self.model.granted(lease, version, streaming))
        return lease

    async def progress(self, version: int):
        await self._alive()
        return await self.registry.progress(version)

    async def wait_for_buckets(self, version: int, at_least: int, timeout: float | None = None):
        await self._alive()
        return await self.registry.wait_for_buckets(version, at_least, timeout)

    async def renew(self, lease: Lease) -> Lease:
        await self._alive()
        renewed = await self.registry.renew(lease)
        self.model.renewed(renewed)
        return renewed

    async def release(self, lease: Lease) -> None:
        if not self.dead:
            await self.registry.release(lease)
            self.model.released(lease)

    async def is_valid(self, lease: Lease) -> bool:
        await self._alive()
        return await self.registry.is_valid(lease)

    async def release_checked(self, lease: Lease) -> bool | None:
        if self.dead:  # nothing arrives; said so, a puller asks is_valid, which never answers
            return None
        held = await self.registry.release_checked(lease)
        self.model.released(lease)
        return held

    async def get(self, version: int):
        await self._alive()
        return await self.registry.get(version)


class WorldClock(FakeClock):
    """The shared fake clock, counting stalls: jumps past a timer that did not get to
    run first. Only a stall may make a lease lapse that its reader kept renewing."""

    def __init__(self) -> None:
        super().__init__()
        self.stalls = 0

    def advance(self, seconds: float) -> None:
        deadline = self.next_deadline()
        if deadline is not None and deadline < self.now() + seconds - EPS:  # not a jump that rounded over it
            self.stalls += 1
        super().advance(seconds)


class ProcessClock:
    """A reader process's view of the shared clock. While the process is frozen its
    timers do not fire (a stopped process runs nothing), though time goes on."""

    def __init__(self, clock: WorldClock) -> None:
        self.clock = clock
        self.froze = False  # since its pull began
        self._thawed: anyio.Event | None = None

    def now(self) -> float:
        return self.clock.now()

    def advance(self, seconds: float) -> None:  # a torn read's freeze
        self.clock.advance(seconds)

    async def sleep(self, seconds: float) -> None:
        await self.clock.sleep(seconds)
        while self._thawed is not None:
            await self._thawed.wait()

    @property
    def frozen(self) -> bool:
        return self._thawed is not None

    def freeze(self) -> None:
        self.froze = True
        self._thawed = self._thawed or anyio.Event()

    def thaw(self) -> None:
        if self._thawed is not None:
            self._thawed.set()
            self._thawed = None


class SteppedTransport(FaultyTransport):
    """A faulty transport whose reads start only as the state machine allows, so that a
    pull can stand mid-read, some buckets copied and some not, across rules."""

    def __init__(self, inner: Transport, clock: ProcessClock) -> None:
        super().__init__(inner, clock=clock)
        self.credits = math.inf
        self._moved: anyio.Event | None = None
        self.landings: list[float] = []  # when each read landed

    def allow(self, reads: float) -> None:
        self.credits = reads
        if self._moved is not None:
            self._moved.set()
            self._moved = None

    async def read(self, *args) -> None:
        while self.credits < 1:
            self._moved = self._moved or anyio.Event()
            await self._moved.wait()
        self.credits -= 1
        await super().read(*args)
        self.landings.append(self.clock.now())


@attrs.define
class Pull:
    """One pull as it ended: its outcome, the lease it got, and (if whole) the bytes
    its mirror held the moment it returned."""

    outcome: Pulled | Exception | None = None  # None: cancelled (its process died)
    granted: list[LeaseRecord] = attrs.Factory(list)
    tensors: dict[str, bytes] | None = None
    ended: float = 0.0
    mirror: int | None = None  # the version its puller's mirror counts as holding, as it ended
    kept: dict[str, bytes] | None = None  # a failed pull's: what the mirror holds of the version it still counts


@attrs.define(eq=False)
class Reader:
    """One replica process: its clock, transport, registry link and puller."""

    name: str
    clock: ProcessClock
    transport: SteppedTransport
    link: ReaderLink
    puller: Puller
    fault: str | None = None  # what its pulls since `World.arm` suffer
    rate: float = 1.0  # its puller's clock: local seconds per second of the world's
    stalls: int = 0  # the world's stalls at `World.arm`
    applied: dict[str, int] = attrs.Factory(dict)  # per line, the newest version it pulled whole: they only go up
    held: Pulled | None = None  # its last good pull (a later delta's base, while the mirror counts it)
    task: asyncio.Task | None = None  # the state machine's pull in flight
    scope: anyio.CancelScope | None = None

    @property
    def busy(self) -> bool:
        return self.task is not None

    async def pull(self) -> Pull:
        run = Pull()
        _GRANTS.set(run.granted)
        with anyio.CancelScope() as self.scope:
            try:
                pulled = await self.puller.pull()
            except AssertionError:  # the model caught something: fail the test
                raise
            except Exception as exc:  # judged by World.check_pull
                run.outcome = exc
            else:  # the copy is the caller's only until its next pull starts
                run.outcome = self.held = pulled
                run.tensors = {p.spec.name: bytes(pulled.view(p.spec.name)) for p in pulled.layout.placements}
            run.mirror = self.puller.mirror_version
            if not isinstance(run.outcome, Pulled) and run.mirror is not None:  # failed, yet holding a version
                assert self.held is not None and self.held.version == run.mirror and self.puller.mirror is not None
                view = self.puller.mirror.host_view()
                run.kept = {p.spec.name: bytes(view[p.offset : p.end]) for p in self.held.layout.placements}
        run.ended = self.clock.now()
        return run


class World:
    """A registry, publishers and reader processes on one fake clock, with the model.

    Seams: `transport()` makes each process's transport endpoint (here the fake driver;
    another driver between real processes later) and `make_registry()` the registry (a
    served one, which a `restart_registry` rule would restart, later)."""

    def __init__(self, num_slots: int, publishers: int = 1, deltas: bool = False) -> None:
        self.deltas = deltas  # publishers record each version's delta from their last (and digests)
        self.clock = WorldClock()
        self.fabric = FakeFabric()
        self.registry = self.make_registry()
        names = [f"trainer-{i}" for i in range(publishers)]
        self.model = Model(self.clock, {name: [None] * num_slots for name in names})
        self.publishers = [self._publisher(name, num_slots) for name in names]
        self.publisher = self.publishers[0]
        self._names = itertools.count()

    def _publisher(self, name: str, num_slots: int) -> Publisher:
        adapter = ObservedAdapter(self.model, self.clock)
        adapter.publisher = Publisher(
            PublisherLink(self.as_principal(Principal.publisher(name)), self.model, adapter),
            self.transport(self.clock),
            num_slots=num_slots,
            rollout_dtype=None,
            bucket_bytes=BUCKET_BYTES,
            wait_timeout=WAIT_TIMEOUT,
            poll_interval=POLL,
            name=name,
            clock=self.clock,
            adapter=adapter,
            # Deltas as large as the version: the test data changes about a sixth of its bytes a version.
            **({"deltas": True, "digests": "wsum64", "delta_room": 1.0} if self.deltas else {}),
        )
        return adapter.publisher

    def make_registry(self) -> Registry:
        """The registry, as seen by an admin (the world's own checks act as one)."""
        return InProcessRegistry(self.clock)

    def as_principal(self, principal: Principal) -> Registry:
        """The registry as `principal` sees it: each publisher and reader acts as itself, so
        every operation the protocol makes passes the registry's authority checks."""
        return self.registry.as_principal(principal)

    def link(self, name: str) -> ReaderLink:
        """A reader process's line to the registry, as the reader principal `name`."""
        return ReaderLink(self.as_principal(Principal.reader(name)), self.model)

    def transport(self, clock) -> Transport:
        return FakeTransport(clock=clock, fabric=self.fabric, offload=False)  # no threads: replayable

    def reader(self, stream: bool = False, rate: float = 1.0) -> Reader:
        """A new reader process; with `stream`, its pulls take STREAMING versions too. Its
        puller's clock runs at `rate` local seconds per second of the world's (the
        registry's and the transports'); its process clock keeps the world's time."""
        name = f"reader-{next(self._names)}"
        clock = ProcessClock(self.clock)
        transport = SteppedTransport(self.transport(clock), clock)
        link = self.link(name)
        puller = Puller(
            link,
            transport,
            holder=name,
            ttl=TTL,
            verify_digests=False,
            stall_timeout=STALL,
            stream=stream,
            clock=clock if rate == 1.0 else ScaledClock(clock, rate),
        )
        return Reader(name, clock, transport, link, puller, rate=rate)

    # -- publishing ------------------------------------------------------------------------

    async def restart(self, publisher: Publisher) -> Publisher:
        """The trainer's process dies between publishes and comes back under its name, well
        within any liveness TTL: its slots' memory is gone (readers of its versions now
        fail), and the new process must take up the slots the registry still records in
        its name (reclaiming each before writing it again) and go on publishing."""
        await publisher.aclose()  # its memory, deregistered
        self.model.gone |= {v for v in self.model.slots[publisher.name] if v is not None}
        restarted = self._publisher(publisher.name, len(publisher.slots))
        restarted.adapter.seconds, restarted.stream = publisher.adapter.seconds, publisher.stream
        self.publishers[self.publishers.index(publisher)] = restarted
        if self.publisher is publisher:
            self.publisher = restarted
        note("trainer restarted")
        return restarted

    async def publish(
        self, layout: str, when_full: WhenFull, crash: bool = False, publisher: Publisher | None = None
    ) -> PublishResult | WeightpullError:
        """Publish the next version and check the outcome against the model. The version
        asked for comes from one counter for every publisher (they race to begin and to be
        announced); the registry gives it, or the next free number when another took it."""
        publisher = publisher or self.publisher
        link = publisher.registry
        asked = next(self.model.versions)
        link.data = data = tensors(asked, layout)  # unique to the number asked: any mix shows
        publisher.adapter.start(len(data), crash)
        publisher.when_full = when_full
        started = self.clock.now()
        try:
            outcome = await publisher.publish(asked, {n: HostTensor("uint8", (len(b),), b) for n, b in data.items()})
        except WeightpullError as exc:
            for leaf in leaves(exc.__cause__):  # the observer caught a bad write, or a stream's bad mark
                if isinstance(leaf, AssertionError):
                    raise leaf from None
            outcome = exc
        given = publisher.adapter.writing  # None: nothing was begun
        waited = self.clock.now() - started
        free = self.model.free_slots(publisher.name)
        full = not free  # as the publisher saw it: nothing yielded since
        what = "skipped" if isinstance(outcome, PublishResult) and outcome.skipped else type(outcome).__name__
        why = f" ({type(cause(outcome)).__name__})" if isinstance(outcome, PublishError) else ""
        raced = "" if given is None or given == asked else ", raced to another number"
        streamed = " streamed" if given is not None and given in self.model.buckets else ""
        note(f"publish{streamed}: {what}{why}{' after waiting' if waited else ''}{raced}")
        if isinstance(outcome, PublishResult) and not outcome.skipped:
            assert not crash, "a publish whose copy failed was announced"
            assert outcome.version == given, f"published as v{outcome.version}, but the registry gave v{given}"
            assert outcome.manifest.step == asked, f"v{given}'s manifest records step {outcome.manifest.step}"
            bound = WAIT_TIMEOUT + publisher.adapter.seconds
            assert waited <= bound + EPS, f"publish blocked {waited} s, over its {WAIT_TIMEOUT} s bound and the copy"
            self.model.committed(given, publisher.name, outcome.slot)
        elif isinstance(outcome, PublishResult):
            assert given is None, f"a skipped publish began v{given}"
            assert when_full in (WhenFull.SKIP, WhenFull.WAIT_THEN_SKIP) and full, f"skipped with slots {free} free"
            if when_full is WhenFull.WAIT_THEN_SKIP:  # skipped only once its bound passed
                assert abs(waited - WAIT_TIMEOUT) <= EPS, f"skipped after {waited} s, not its {WAIT_TIMEOUT} s bound"
        elif isinstance(outcome, SlotWaitTimeoutError):
            assert given is None, f"{outcome!r}, but v{given} was begun"
            assert when_full is WhenFull.WAIT and full, f"{outcome!r} with slots {free} free"
            assert abs(waited - WAIT_TIMEOUT) <= EPS, f"gave up after {waited} s, not its {WAIT_TIMEOUT} s bound"
        elif isinstance(outcome, NoFreeSlotError):
            assert given is None, f"{outcome!r}, but v{given} was begun"
            assert when_full is WhenFull.FAIL and full, f"{outcome!r} with slots {free} free"
        elif isinstance(outcome, PublishError) and given is not None:
            # Once begun, a failure leaves an ABORTED record: the injected crash, or a
            # commit refused because another publisher announced a newer version meanwhile.
            if isinstance(cause(outcome), VersionOrderError):  # its own line announced a newer one meanwhile
                announced = self.model.line(publisher.name).announced
                assert announced and announced[-1] > given, f"{outcome!r}"
            else:
                assert crash and isinstance(cause(outcome), RuntimeError) and "injected" in str(cause(outcome)), (
                    f"publish of v{given} raised {outcome!r}"
                )
            assert self.model.states[given] in (VersionState.WRITING, VersionState.STREAMING)
            self.model.states[given] = VersionState.ABORTED
            self.model.aborted.add(given)
        else:
            raise AssertionError(f"publish asking v{asked} (given v{given}) raised {outcome!r}")
        return outcome

    async def withdraw(self) -> None:
        await self.registry.retire(self.model.newest)
        self.model.withdrawn()

    # -- pulling ---------------------------------------------------------------------------

    def arm(self, reader: Reader, fault: str | None, bandwidth: float | None = None) -> None:
        """Ready `reader` for its next pull, which suffers `fault` over a link of
        `bandwidth` bytes per second (None: copies take no time)."""
        reader.fault = fault
        reader.transport.faults = faults(fault)
        reader.transport.faults.bandwidth = bandwidth
        reader.stalls = self.clock.stalls
        reader.clock.froze = reader.clock.frozen

    def check_pull(self, reader: Reader, run: Pull) -> None:
        """A pull yields exactly the bytes of the version it leased, or a typed error
        that its faults explain; its lease ends with it."""
        outcome, now = run.outcome, self.clock.now()
        if not run.granted:
            assert isinstance(outcome, NoReadyVersionError), f"{reader.name}: {outcome!r} before any lease"
            return
        (record,) = run.granted
        assert not record.live(now), f"{reader.name}: the pull ended but its lease {record.lease.id} lives on"
        f = reader.transport.faults
        failed = reader.fault == "fail" and f.fail_reads == 0
        torn = reader.fault == "tear" and f.tear_reads == 0
        lapsed = record.lapsed(now)
        stalled = reader.clock.froze or self.clock.stalls != reader.stalls
        # The longest its pull went with no read landing, from the lease on (as the puller counts).
        times = [
            record.granted_at,
            *(t for t in reader.transport.landings if record.granted_at <= t <= run.ended),
            run.ended,
        ]
        idle = max(b - a for a, b in itertools.pairwise(times))
        streamed = reader.puller.stream
        ended_ready = record.lease.version in self.model.announced
        aborted = record.lease.version in self.model.aborted
        if not isinstance(outcome, Pulled) and run.mirror is not None:
            # Whatever the failure, the mirror counts as holding no version, or one it holds
            # exactly: a delta's base, when the read failed before the patch began (only the
            # section past the version was written).
            assert run.kept == self.model.contents[run.mirror], (
                f"{reader.name}: {outcome!r}, and its mirror counts as v{run.mirror} but holds other bytes"
            )
            of_delta = self.model.delta_bases.get(record.lease.version) == run.mirror
            note(f"pull{' of a delta' if of_delta else ''}: {type(outcome).__name__}, what the mirror held kept whole")
        if isinstance(outcome, Pulled):
            note(f"pull{' streamed' if streamed else ''}: whole")
            if outcome.base is not None:
                assert self.model.delta_bases.get(outcome.version) == outcome.base, (
                    f"{reader.name}: v{outcome.version} patched from v{outcome.base}, not the base it was published with"
                )
                gone = outcome.base not in self.model.states
                note(f"pull: patched from its delta{', its base reclaimed by then' if gone else ''}")
            assert ended_ready, f"{reader.name}: handed on v{outcome.version}, which never turned READY"
            assert run.mirror == outcome.version, f"{reader.name}: pulled v{outcome.version}, mirror v{run.mirror}"
            assert not (lapsed or failed or torn), (
                f"{reader.name}: handed on a pull that was lapsed={lapsed} failed={failed} torn={torn}"
            )
            # A frozen process, or time jumping, lets its reads land before its watchdog runs.
            assert stalled or idle <= STALL + STALL_LATE + EPS, (
                f"{reader.name}: no read landed for {idle} s, yet the pull went on (its clock at x{reader.rate:g})"
            )
            assert outcome.version == record.lease.version
            assert run.tensors == self.model.contents[outcome.version], (
                f"{reader.name}: the copy of v{outcome.version} is not its bytes"
            )
            line = self.model.owner[outcome.version]
            assert outcome.version >= reader.applied.get(line, 0), (
                f"{reader.name}: went back from {line}'s v{reader.applied[line]} to v{outcome.version}"
            )
            reader.applied[line] = outcome.version
        elif streamed and aborted:  # a stream that ended ABORTED under the read (or after it failed)
            note(f"pull streamed: aborted under it -> {type(outcome).__name__}")
            explained = (
                isinstance(outcome, TornReadError)
                or (isinstance(outcome, NoProgressError) and idle >= STALL - EPS)
                or (failed and isinstance(outcome, TransportError) and "injected" in str(outcome))
                or (lapsed and isinstance(outcome, TransportError))
            )
            assert explained, f"{reader.name}: the stream of v{record.lease.version} was aborted; it gave {outcome!r}"
        elif (
            "stream-retired-after-ready" in AWAITING_FIX
            and streamed
            and ended_ready
            and isinstance(outcome, TornReadError)
            and "ended RETIRED" in str(outcome)
        ):
            note("pull streamed: READY then RETIRED, rejected (stream-retired-after-ready)")
        elif lapsed:  # the slot may have been rewritten or re-registered under the read
            assert stalled, f"{reader.name}: its lease lapsed though it never stalled: renewal failed"
            rewritten = not self.model.holds(record.lease.version)
            note(f"pull: lapsed{', slot rewritten' if rewritten else ''} -> {type(outcome).__name__}")
            # If its watchdog ran before its renewal did, the stall is what it reports.
            no_progress = isinstance(outcome, NoProgressError) and idle >= STALL - EPS
            assert no_progress or isinstance(outcome, (TornReadError, TransportError)), (
                f"{reader.name}: lapsed lease gave {outcome!r}"
            )
        elif isinstance(outcome, NoProgressError):
            note("pull: no progress")
            assert idle >= STALL - EPS, (
                f"{reader.name}: {outcome!r}, though reads landed at most {idle} s apart (its clock at x{reader.rate:g})"
            )
        elif failed and isinstance(outcome, TransportError) and "injected" in str(outcome):
            note("pull: failed read")
        elif record.lease.version in self.model.gone:  # its publisher restarted: the slot's memory went with it
            note(f"pull: its publisher restarted -> {type(outcome).__name__}")
            assert isinstance(outcome, (RegionNotRegisteredError, PeerGoneError)), f"{reader.name}: {outcome!r}"
        else:
            raise AssertionError(f"{reader.name}: a pull whose lease held and met no fault failed: {outcome!r}")

    # -- invariants ------------------------------------------------------------------------

    async def check(self, publishing: bool = False) -> None:
        """The registry agrees with the model on versions, slots and live leases."""
        status = await self.registry.status()
        now = self.clock.now()
        assert status.newest_ready == self.model.newest
        assert {v.version: v.state for v in status.versions} == self.model.states
        for v in status.versions:
            held = self.model.slots[v.publisher][v.slot]
            assert held == v.version, (
                f"the registry places v{v.version} in slot {v.slot} of {v.publisher}, which holds v{held}"
            )
        live = {i for i, r in self.model.leases.items() if r.live(now)}
        assert {x.id for x in status.leases} == live, "the registry and the readers disagree on live leases"
        if not publishing:
            for publisher in self.publishers:
                for slot in publisher.slots:
                    assert slot.state is not SlotState.WRITING, f"slot {slot.index} of {publisher.name} stuck WRITING"
                    assert slot.version == self.model.slots[publisher.name][slot.index]

    async def check_no_leak(self) -> None:
        """Once every reader stopped and every TTL passed, nothing is leased, every slot
        but the newest READY one is reclaimable, and publishing reuses them all."""
        assert (await self.registry.status()).leases == ()
        newest = {line.newest for line in self.model.lines.values()}
        for version in sorted(self.model.states):
            if version not in newest:
                await PublisherLink(self.registry, self.model).reclaim(version)
        for publisher in self.publishers:
            free = self.model.free_slots(publisher.name)
            assert len(free) == len(publisher.slots) - self.model.holds_newest(publisher.name)
            for _ in publisher.slots:
                outcome = await self.publish("base", WhenFull.FAIL, publisher=publisher)
                assert isinstance(outcome, PublishResult), f"a slot of {publisher.name} leaked: {outcome!r}"
