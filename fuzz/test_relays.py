"""Relays as a Hypothesis state machine: sources that come and go under readers.

Rules interleave a trainer's publishes; replicas (each a principal of its own, on one of
two hosts) that start pulls with `host=`, offer their mirrors as relays, die mid-serve
(their transport closes and they fall silent, so their liveness lapses), or turn hostile
(a byte of an offered mirror flipped); and time, timer by timer. Reads are slow (every
read takes fake time), so deaths land mid-read. A reader whose relay fails must choose
again. Invariants: every copy a pull hands on holds exactly one version's bytes, those the
trainer published (never two versions' or two sources'); the registry's book of relays
holds (no source over its cap, no lease at its own holder); and a replica silent past its
liveness TTL offers nothing.
"""

from __future__ import annotations

import asyncio

import anyio
import anyio.to_thread
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)

from weightpull import FakeClock, InProcessRegistry, Principal, Publisher, Puller, WeightpullError, WhenFull
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport
from weightpull.relays import ORIGIN
from weightpull.tensors import HostTensor

from .harness import Loop
from .profiles import event, example, fuzz

LIVENESS = 3.0
TTL = 2.0
SIZES = (700, 300, 1500)  # three buckets of 1 KiB at most: reads in several steps


def tensors(version: int) -> dict[str, HostTensor]:
    return {
        f"t{i}": HostTensor("uint8", (n,), bytes((version * 37 + i * 11 + k) % 253 for k in range(n)))
        for i, n in enumerate(SIZES)
    }


class Replica:
    def __init__(self, index: int, registry: InProcessRegistry, fabric: FakeFabric, clock: FakeClock) -> None:
        self.name = f"replica{index}"
        self.principal = Principal.reader(self.name)
        self.registry = registry.as_principal(self.principal)
        self.transport = FakeTransport(clock=clock, fabric=fabric, faults=FakeFaults(delay=0.25))
        self.puller = Puller(
            self.registry,
            self.transport,
            host="rack0",
            holder=self.name,
            ttl=TTL,
            clock=clock,
            stall_timeout=3.0,
            verify_digests=False,  # bytes from relays are checked regardless: what this fuzzes
        )
        self.task: asyncio.Task | None = None
        self.dead = False
        self.died_at = 0.0

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


class RelayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop: Loop | None = None

    @initialize(replicas=st.integers(2, 4))
    def start(self, replicas: int) -> None:
        example()
        self.clock = FakeClock()
        self.loop = Loop(self.clock)
        self.registry = InProcessRegistry(self.clock, liveness_ttl=LIVENESS)
        self.fabric = FakeFabric()
        self.publisher = Publisher(
            self.registry,
            FakeTransport(clock=self.clock, fabric=self.fabric),
            rollout_dtype=None,
            bucket_bytes=1024,
            digests=True,
            num_slots=3,
            when_full=WhenFull.SKIP,
            clock=self.clock,
        )
        self.version = 0
        self.replicas = [Replica(i, self.registry, self.fabric, self.clock) for i in range(replicas)]
        self.publish()

    # -- the trainer and the replicas ----------------------------------------------------

    @rule()
    def publish(self) -> None:
        self.version += 1
        self.loop.run(self.publisher.publish, self.version, tensors(self.version))

    def _alive_idle(self, pick: int) -> Replica | None:
        live = [r for r in self.replicas if not r.dead and not r.busy]
        return live[pick % len(live)] if live else None

    @rule(pick=st.integers(0, 3))
    def start_pull(self, pick: int) -> None:
        replica = self._alive_idle(pick)
        if replica is not None:
            replica.task = self.loop.spawn(replica.puller.pull)

    @rule(pick=st.integers(0, 3), cap=st.none() | st.integers(1, 2))
    def offer(self, pick: int, cap: int | None) -> None:
        replica = self._alive_idle(pick)
        if replica is None or replica.puller.mirror_version is None:
            return
        try:
            self.loop.run(lambda: replica.puller.offer(cap=cap))
            event("offered")
        except WeightpullError:  # its version was retired meanwhile: not offerable
            event("offer refused")

    @rule(pick=st.integers(0, 3), relay=st.booleans())
    def die(self, pick: int, relay: bool) -> None:
        live = [r for r in self.replicas if not r.dead]
        if len(live) <= 1:
            return
        relays = [r for r in live if r.puller.offered is not None]
        live = relays if relay and relays else live
        replica = live[pick % len(live)]
        replica.dead, replica.died_at = True, self.clock.now()
        if replica.task is not None:
            replica.task.cancel()
        self.loop.run(replica.transport.aclose)
        event("relay died" if replica.puller.offered is not None else "replica died")

    @rule(pick=st.integers(0, 3), at=st.integers(0, sum(SIZES) - 1))
    def turn_hostile(self, pick: int, at: int) -> None:
        offering = [r for r in self.replicas if not r.dead and r.puller.offered is not None]
        if offering:
            mirror = offering[pick % len(offering)].puller.mirror
            mirror.host_view()[at] ^= 0x5A
            event("hostile relay")

    @rule(dt=st.integers(1, 8).map(lambda n: n / 4))
    def time_passes(self, dt: float) -> None:
        self.registry.machine.keepalive((self.publisher.name,))  # the trainer is alive throughout
        for replica in self.replicas:  # a live client's heartbeat
            if not replica.dead:
                self.registry.machine.keepalive((), by=replica.principal)
        self.loop.pass_time(dt)
        self.collect()

    # -- checks --------------------------------------------------------------------------

    def collect(self) -> None:
        for replica in self.replicas:
            task = replica.task
            if task is None or not task.done() or task.cancelled():
                continue
            replica.task = None
            exc = task.exception()
            if exc is not None:
                assert isinstance(exc, WeightpullError), repr(exc)
                event(type(exc).__name__)
                continue
            pulled = task.result()
            want = tensors(pulled.version)
            assert all(bytes(pulled.view(n)) == t.data for n, t in want.items()), f"a mixed copy of v{pulled.version}"
            event("copy accepted")

    @invariant()
    def the_book_holds(self) -> None:
        if self.loop is None:
            return
        self.registry.machine.sweep()
        self.registry.machine.relays.check()
        book = self.registry.machine.relays
        if any(book.source_of(i) not in (None, ORIGIN) for i in book.placed()):
            event("a lease reads from a relay")
        now = self.clock.now()
        silent = {r.name for r in self.replicas if r.dead and now - r.died_at > LIVENESS}
        offered = {o.holder for v in range(1, self.version + 1) for o in self.registry.machine.relays.offers(v)}
        assert not offered & silent, f"lapsed replicas still offer: {offered & silent}"

    def teardown(self) -> None:
        if self.loop is None:
            return
        try:
            for replica in self.replicas:
                if replica.busy:
                    self.loop.finish(replica.task, 60.0)  # every pull ends, one way or another
            self.collect()
        finally:
            self.loop.close()


async def _inline(fn, *args, **_):
    """`anyio.to_thread.run_sync`, run in the loop: the state machine steps its loop by
    hand and fake time jumps, so a real thread's result could land after its deadline.
    (The work, digests of a few KiB, is tiny.)"""
    return fn(*args)


def test_relays(monkeypatch) -> None:
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline)

    def run(profile: settings) -> None:
        budget = settings(profile, max_examples=min(profile.max_examples, 150), stateful_step_count=40)
        run_state_machine_as_test(RelayMachine, settings=budget)

    fuzz("test_relays", run)


def test_replay_a_hostile_relays_bytes_are_never_accepted(monkeypatch) -> None:
    """A program written out: a replica pulls, offers its mirror, flips a byte of it; the
    next reader, on the same host, is handed that relay and must not keep its bytes."""
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline)
    machine = RelayMachine()
    try:
        machine.start(replicas=2)
        machine.start_pull(0)
        machine.time_passes(2.0)
        machine.offer(0, None)
        assert machine.replicas[0].puller.offered == 1
        machine.turn_hostile(0, 5)
        machine.start_pull(1)
        book = machine.registry.machine.relays
        assert [book.source_of(i) for i in book.placed()] == ["replica0"]  # handed the relay
        machine.time_passes(2.0)
        machine.time_passes(2.0)
        machine.the_book_holds()
    finally:
        machine.teardown()
