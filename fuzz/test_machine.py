"""The pull protocol as a Hypothesis state machine.

Rules interleave a trainer's publishes (any layout, any when-full policy, a copy that
fails), reads that begin and stand mid-read across rules, readers that freeze or die,
raw leases taken, renewed and released by hand, a withdrawn version, and time: passing
timer by timer (so reads renew their leases) or jumping past every TTL at once. After
each step the registry must agree with the model (`harness.World.check`); every slot
write and every lease is checked as it happens; teardown checks that nothing leaked.

Seam: a served registry will add a `restart_registry` rule in a subclass that overrides
`World.make_registry`; leases the old registry granted must then read as lapsed.
"""

from __future__ import annotations

import math

from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
    run_state_machine_as_test,
)

from weightpull import LeaseExpiredError, NoReadyVersionError, WhenFull
from weightpull.errors import InvalidTransitionError, LeaseNotFoundError

from .harness import FAULTS, LAYOUTS, POLL, READER_RATES, TTL, WAIT_TIMEOUT, Loop, Reader, World
from .profiles import example, fuzz

# Time in half seconds, so that leases often run out exactly on a renewal or a poll.
seconds = st.integers(1, 4 * int(TTL)).map(lambda n: n / 2)


class ProtocolMachine(RuleBasedStateMachine):
    leases = Bundle("leases")

    def __init__(self) -> None:
        super().__init__()
        self.world: World | None = None
        self.loop: Loop | None = None
        self.readers: list[Reader] = []

    @initialize(
        num_slots=st.integers(2, 3),
        readers=st.integers(1, 3),
        rates=st.lists(st.sampled_from(READER_RATES), min_size=3, max_size=3),
    )
    def start(self, num_slots: int, readers: int, rates: list[float] | None = None) -> None:
        """Each reader's clock runs at a rate of its own against the registry's (1: as fast)."""
        example()
        self.world = World(num_slots)
        self.loop = Loop(self.world.clock)
        self.readers = [self.world.reader(rate=rate) for rate in (rates or [1.0] * readers)[:readers]]
        self.by_hand = self.world.link("by-hand")  # the reader principal by-hand
        self.loop.run(self.world.publish, "base", WhenFull.FAIL)  # a version to read from the start

    # -- helpers ---------------------------------------------------------------------------

    def reading(self) -> list[Reader]:
        return [r for r in self.readers if r.busy]

    def idle(self) -> list[Reader]:
        return [r for r in self.readers if not r.busy]

    def collect(self) -> None:
        """Judge every pull that ended."""
        for reader in self.readers:
            if reader.task is not None and reader.task.done():
                self.world.check_pull(reader, reader.task.result())  # the model's own assertions surface here
                reader.task = None

    def now(self, fn, *args) -> None:
        """Run a synchronous poke (which may set anyio events) inside the loop."""

        async def call() -> None:
            fn(*args)

        self.loop.run(call)

    # -- the trainer -----------------------------------------------------------------------

    @rule(layout=st.sampled_from(sorted(LAYOUTS)), when_full=st.sampled_from(WhenFull))
    def publish(self, layout: str, when_full: WhenFull) -> None:
        """Also: a publish while every slot is leased, and a layout change."""
        task = self.loop.spawn(self.world.publish, layout, when_full)
        self.loop.finish(task, WAIT_TIMEOUT + POLL)  # nothing waits forever
        task.result()
        self.collect()

    @rule(layout=st.sampled_from(sorted(LAYOUTS)))
    def publish_whose_copy_fails(self, layout: str) -> None:
        self.loop.run(self.world.publish, layout, WhenFull.FAIL, True)

    @precondition(lambda self: self.world.model.newest is not None)
    @rule()
    def withdraw_newest(self) -> None:
        self.loop.run(self.world.withdraw)

    # -- readers ---------------------------------------------------------------------------

    @precondition(lambda self: self.idle())
    @rule(pick=st.integers(0, 2), fault=st.sampled_from(FAULTS), reads=st.integers(0, 4))
    def begin_read(self, pick: int, fault: str | None, reads: int) -> None:
        """Lease the newest version and let `reads` bucket reads through; the rest wait."""
        reader = self.idle()[pick % len(self.idle())]
        self.world.arm(reader, fault)
        self.now(reader.transport.allow, reads)
        reader.task = self.loop.spawn(reader.pull)
        self.collect()

    @precondition(lambda self: self.reading())
    @rule(pick=st.integers(0, 2), reads_first=st.booleans())
    def finish_read(self, pick: int, reads_first: bool) -> None:
        """Let the rest of the reads through. A frozen reader resumes too, and whether
        its reads or its timers run first is a race either may win."""
        reader = self.reading()[pick % len(self.reading())]
        if reads_first:
            self.now(reader.transport.allow, math.inf)
            self.now(reader.clock.thaw)
        else:
            self.now(reader.clock.thaw)
            self.now(reader.transport.allow, math.inf)
        self.loop.finish(reader.task, 3 * TTL)
        self.collect()

    @precondition(lambda self: any(not r.clock.frozen for r in self.reading()))
    @rule(pick=st.integers(0, 2))
    def freeze_reader(self, pick: int) -> None:
        """A reader process stops mid-read (a GC pause, a debugger): no renewals."""
        running = [r for r in self.reading() if not r.clock.frozen]
        self.now(running[pick % len(running)].clock.freeze)

    @precondition(lambda self: self.reading())
    @rule(pick=st.integers(0, 2))
    def kill_reader(self, pick: int) -> None:
        """A reader dies mid-read without releasing its lease; a new process replaces it."""
        reader = self.reading()[pick % len(self.reading())]
        reader.link.dead = True
        self.now(reader.scope.cancel)
        assert reader.task.result().outcome is None
        self.loop.run(reader.transport.aclose)
        self.readers[self.readers.index(reader)] = self.world.reader(rate=reader.rate)
        self.collect()

    # -- leases by hand --------------------------------------------------------------------

    @rule(target=leases, ttl=st.sampled_from([1.0, TTL, 4 * TTL]))
    def acquire_lease(self, ttl: float):
        async def acquire():
            try:
                return await self.by_hand.acquire(ttl=ttl, holder="by-hand")
            except NoReadyVersionError:
                assert self.world.model.newest is None
                return None

        lease = self.loop.run(acquire)
        return multiple() if lease is None else lease

    @rule(lease=leases)
    def renew_lease(self, lease) -> None:
        record = self.world.model.leases[lease.id]
        now = self.world.clock.now()
        # Lapsed: expired. Released: an illegal transition. Either: gone with its version.
        expect = None if record.live(now) else LeaseExpiredError if record.lapsed(now) else InvalidTransitionError
        if expect is not None and lease.version not in self.world.model.states:
            expect = LeaseNotFoundError

        async def renew() -> None:
            try:
                await self.by_hand.renew(record.lease)
            except (LeaseExpiredError, LeaseNotFoundError, InvalidTransitionError) as exc:
                assert expect is type(exc), f"renewing lease {lease.id} raised {exc!r}, not {expect}"
            else:
                assert expect is None, f"lease {lease.id} was renewed after it ended"

        self.loop.run(renew)

    @rule(lease=leases)
    def release_lease(self, lease) -> None:
        self.loop.run(self.by_hand.release, lease)

    # -- time ------------------------------------------------------------------------------

    @rule(dt=seconds)
    def time_passes(self, dt: float) -> None:
        """Time passes timer by timer: reads in progress renew their leases."""
        self.loop.pass_time(dt)
        self.collect()

    @rule(dt=seconds.map(lambda s: TTL + s))
    def everyone_stalls_past_the_ttl(self, dt: float) -> None:
        """Time jumps past every TTL before anyone runs: every lease lapses."""
        self.loop.advance(dt)
        self.collect()

    # -- invariants ------------------------------------------------------------------------

    @invariant()
    def registry_agrees_with_the_model(self) -> None:
        if self.world is not None:
            self.loop.run(self.world.check)

    def teardown(self) -> None:
        if self.loop is None:
            return
        try:
            while self.reading():
                self.finish_read(0, True)
            self.loop.advance(4 * TTL)  # past every lease, by-hand ones included
            self.loop.run(self.world.check)
            self.loop.run(self.world.check_no_leak)
        finally:
            self.loop.close()


def test_protocol() -> None:
    fuzz("test_protocol", lambda profile: run_state_machine_as_test(ProtocolMachine, settings=profile))


# Programs the machine failed on, written out (a state machine takes no @example).


def replay(steps) -> None:
    """Run `steps` (each a call on the machine) as Hypothesis would: the invariant after
    each, then the teardown."""
    machine = ProtocolMachine()
    try:
        for step in steps:
            step(machine)
            machine.registry_agrees_with_the_model()
    finally:
        machine.teardown()


def test_replay_reads_held_past_the_stall_timeout() -> None:
    """A read held back for 30 s must end the pull with NoProgressError (the puller's
    stall_timeout), which the model first took for an unexplained failure."""
    replay(
        [
            lambda m: m.start(num_slots=2, readers=2),
            lambda m: m.begin_read(fault=None, pick=0, reads=0),
            lambda m: m.withdraw_newest(),
            lambda m: m.time_passes(dt=6.5),
            lambda m: m.time_passes(dt=12.0),
            lambda m: m.time_passes(dt=11.5),
        ]
    )
