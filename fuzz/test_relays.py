"""Relays as a Hypothesis state machine: sources that come and go under readers.

Rules interleave a trainer's publishes; a second trainer's streams, driven bucket by
bucket (begun, buckets landed and marked, committed with or without digests, or aborted
midway); replicas (each a principal of its own) that start pulls with `host=`, plain,
streaming, or streaming and relaying what they receive (`relay=True`: offered once a
bucket lands, the count held advanced as more do); replicas that offer their mirrors as
relays, die mid-serve (their transport closes and they fall silent, so their liveness
lapses), turn hostile (a byte of an offered mirror flipped), serve a delta of another base
than the publisher's, or lie about how many buckets they hold; and time, timer by timer.
The trainer records each version's delta from its last, so replicas that hold the base
patch it, from the trainer's slot or from a relay, while the base is retired and its slot
rewritten under them. Reads are slow (every read takes fake
time), so deaths land mid-read and mid-stream. A reader whose relay fails must choose
again. Invariants: every copy a pull hands on holds exactly one version's bytes, those its
trainer published (never two versions' or two sources'); the registry's book of relays
holds (no source over its cap, no lease at its own holder); no offer claims more buckets
than its version's publisher committed, nor outlives an aborted stream; and a replica
silent past its liveness TTL offers nothing.
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
from weightpull.delta import encode
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport
from weightpull.errors import VersionOrderError
from weightpull.layout import Layout, TensorSpec, plan_layout
from weightpull.manifest import Manifest, bucket_digest
from weightpull.relays import ORIGIN
from weightpull.states import VersionState
from weightpull.tensors import HostTensor

from .harness import Loop
from .profiles import event, example, fuzz

LIVENESS = 3.0
TTL = 2.0
SIZES = (700, 300, 1500)  # three buckets of 1 KiB at most: reads in several steps


def tensors(version: int) -> dict[str, HostTensor]:
    """Versions that differ from the one before in a tenth of their bytes (those at places
    that move with the version), so that the trainer's deltas are small; any two versions
    still differ in every tensor, so a mix shows."""
    return {
        f"t{i}": HostTensor(
            "uint8",
            (n,),
            bytes((version * 37 + k) % 253 if k % 20 == version % 20 else (i * 11 + k) % 251 for k in range(n)),
        )
        for i, n in enumerate(SIZES)
    }


def image(layout: Layout, data: dict[str, HostTensor]) -> bytes:
    """A version's bytes as its slot holds them."""
    out = bytearray(layout.total_bytes)
    for p in layout.placements:
        out[p.offset : p.end] = data[p.spec.name].data
    return bytes(out)


KINDS = ("plain", "stream", "relay")  # how a replica pulls: READY only, streamed, streamed and relayed


class Streamer:
    """A trainer whose streams the rules drive by hand: each bucket lands in its slot and
    is marked when a rule says, so readers and relays meet every interleaving."""

    name = "trainer/stream"  # below the trainer's name: the same line of versions as its publishes
    LAYOUT = plan_layout([TensorSpec(f"t{i}", "uint8", (n,)) for i, n in enumerate(SIZES)], bucket_bytes=1024)

    def __init__(self, registry: InProcessRegistry, fabric: FakeFabric, clock: FakeClock) -> None:
        self.registry = registry
        self.transport = FakeTransport(clock=clock, fabric=fabric)
        self.slots = 0
        self.version: int | None = None  # the stream in flight
        self.region = None
        self.landed = 0

    @property
    def buckets(self) -> int:
        return len(self.LAYOUT.buckets)

    async def begin(self) -> int:
        version = await self.registry.begin(publisher=self.name, slot=self.slots)
        self.region = self.transport.allocate(self.LAYOUT.total_bytes, "cpu")
        manifest = Manifest(version, self.LAYOUT, "fake", self.transport.export(self.region), self.slots, self.name)
        self.slots += 1
        await self.registry.stream(manifest)
        self.version, self.landed = version, 0
        return version

    async def land(self, count: int) -> None:
        """The next `count` buckets copied into the slot, then marked."""
        assert self.version is not None and self.region is not None
        view, data = self.region.host_view(), tensors(self.version)
        for bucket in self.LAYOUT.buckets[self.landed : self.landed + count]:
            for name in bucket.names:
                p = self.LAYOUT[name]
                view[p.offset : p.end] = data[name].data
        self.landed = min(self.buckets, self.landed + count)
        await self.registry.mark(self.version, self.landed)

    async def commit(self, digests: bool) -> None:
        assert self.version is not None and self.region is not None and self.landed == self.buckets
        view = self.region.host_view()
        found = [bucket_digest(view[b.offset : b.offset + b.nbytes]) for b in self.LAYOUT.buckets] if digests else None
        version, self.version = self.version, None
        await self.registry.commit_stream(version, found)

    async def abort(self) -> None:
        assert self.version is not None
        version, self.version = self.version, None
        await self.registry.abort(version, "injected: the streaming trainer died")


class Replica:
    def __init__(
        self, index: int, registry: InProcessRegistry, fabric: FakeFabric, clock: FakeClock, kind: str
    ) -> None:
        self.name = f"replica{index}"
        self.kind = kind
        self.principal = Principal.reader(self.name)
        self.registry = registry.as_principal(self.principal)
        self.faults = FakeFaults(delay=0.25)  # live: a program may slow one replica down
        self.transport = FakeTransport(clock=clock, fabric=fabric, faults=self.faults)
        self.puller = Puller(
            self.registry,
            self.transport,
            host="rack0",
            holder=self.name,
            ttl=TTL,
            clock=clock,
            stall_timeout=3.0,
            verify_digests=False,  # bytes from relays are checked regardless: what this fuzzes
            stream=kind != "plain",
            relay=kind == "relay",
            relay_cap=2 if kind == "relay" else None,
        )
        self.task: asyncio.Task | None = None
        self.dead = False
        self.died_at = 0.0
        self.spoiled = False  # it flipped a byte of its own mirror while pulling into it

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


class RelayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop: Loop | None = None

    @initialize(kinds=st.lists(st.sampled_from(KINDS), min_size=2, max_size=4))
    def start(self, kinds: list[str]) -> None:
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
            deltas=True,  # each version's changes from the last: readers holding it patch
            delta_room=0.5,
            num_slots=3,
            when_full=WhenFull.SKIP,
            name="trainer",
            clock=self.clock,
        )
        self.version = 0
        self.contents: dict[int, dict[str, HostTensor]] = {}  # version -> the bytes its trainer published
        self.streamer = Streamer(self.registry, self.fabric, self.clock)
        self.accepted: list[tuple[str, int]] = []  # (replica, version) of every copy handed on
        self.replicas = [Replica(i, self.registry, self.fabric, self.clock, k) for i, k in enumerate(kinds)]
        self.publish()

    # -- the trainer and the replicas ----------------------------------------------------

    @rule(draw=st.integers(0, 2))
    def publish(self, draw: int = 0) -> None:
        if self.streamer.version is not None and draw:  # mostly not over a stream: it could never commit
            return
        self.version += 1
        result = self.loop.run(self.publisher.publish, self.version, tensors(self.version))
        if not result.skipped:
            self.contents[result.version] = tensors(self.version)

    @rule()
    def begin_stream(self) -> None:
        if self.streamer.version is None:
            version = self.loop.run(self.streamer.begin)
            self.contents[version] = tensors(version)
            event("stream begun")

    @rule(count=st.integers(1, 2))
    def land(self, count: int) -> None:
        if self.streamer.version is not None and self.streamer.landed < self.streamer.buckets:
            self.loop.run(self.streamer.land, count)

    @rule(digests=st.booleans())
    def commit_stream(self, digests: bool) -> None:
        if self.streamer.version is not None and self.streamer.landed == self.streamer.buckets:
            version = self.streamer.version
            try:
                self.loop.run(self.streamer.commit, digests)
            except VersionOrderError:  # a newer version was announced meanwhile: this one can never be
                self.streamer.version = version
                self.loop.run(self.streamer.abort)
                event("stream overtaken")
                return
            event("stream committed" if digests else "stream committed without digests")

    @rule(draw=st.integers(0, 2))
    def abort_stream(self, draw: int) -> None:
        if self.streamer.version is not None and draw == 0:  # a third as often: most streams run on
            self.loop.run(self.streamer.abort)
            event("stream aborted")

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

    @rule(pick=st.integers(0, 3), relay=st.booleans(), draw=st.integers(0, 2))
    def die(self, pick: int, relay: bool, draw: int = 0) -> None:
        live = [r for r in self.replicas if not r.dead]
        if len(live) <= 1 or draw:  # a third as often: replicas mostly live long enough to relay
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
        self.collect()  # copies handed on before the flip are checked as they were handed on
        offering = [r for r in self.replicas if not r.dead and r.puller.offered is not None]
        if offering:
            hostile = offering[pick % len(offering)]
            hostile.puller.mirror.host_view()[at] ^= 0x5A
            hostile.spoiled |= hostile.busy  # a relay still pulling spoils its own copy too: its own affair
            event("hostile relay" if not hostile.busy else "hostile relay mid-stream")

    @rule(pick=st.integers(0, 3), back=st.integers(2, 3))
    def serve_another_base(self, pick: int, back: int) -> None:
        """A relay whose delta section is of another base than the publisher's (v-`back`,
        not v-1): a bug, or a relay that patched a version from the wrong copy. Its readers
        holding the right base must not keep a patch made of it."""
        offering = [r for r in self.replicas if not r.dead and not r.busy and r.puller.offered is not None]
        if not offering:
            return
        relay = offering[pick % len(offering)]
        version = relay.puller.offered
        try:
            manifest = self.registry.machine.get(version)
        except WeightpullError:  # reclaimed meanwhile: its offer is gone with it
            return
        if manifest.delta is None or version - back not in self.contents:
            return
        layout, room = manifest.layout, manifest.delta.room
        other = memoryview(bytearray(room))
        made = encode(
            memoryview(image(layout, self.contents[version - back])),
            memoryview(image(layout, self.contents[version])),
            manifest.delta.word,
            other,
        )
        if made is None:
            return
        relay.puller.mirror.host_view()[layout.total_bytes : layout.total_bytes + room] = other
        event("a relay serves a delta of another base")

    @rule(pick=st.integers(0, 3), extra=st.integers(1, 3))
    def lie(self, pick: int, extra: int) -> None:
        """A relay says it holds more buckets than it does (up to what its version's
        publisher committed: the registry refuses more)."""
        book = self.registry.machine.relays
        lying = [
            (r, o)
            for r in self.replicas
            if not r.dead
            for v in range(self.version + self.streamer.slots + 2)
            for o in book.offers(v)
            if o.holder == r.name and o.landed is not None
        ]
        if not lying:
            return
        replica, offer = lying[pick % len(lying)]
        committed = self.registry.machine.progress(offer.version).committed
        try:
            self.registry.machine.mark_offer(
                offer.version, min(committed, offer.landed + extra), holder=replica.name, by=replica.principal
            )
            event("a relay lied about its count")
        except WeightpullError:
            event("a lie refused")

    @rule(dt=st.integers(1, 8).map(lambda n: n / 4))
    def time_passes(self, dt: float) -> None:
        self.registry.machine.keepalive((self.publisher.name, self.streamer.name))  # the trainers are alive throughout
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
            spoiled, replica.spoiled = replica.spoiled, False
            exc = task.exception()
            if exc is not None:
                assert isinstance(exc, WeightpullError), repr(exc)
                event(type(exc).__name__)
                continue
            pulled = task.result()
            if spoiled:  # what it did to its own mirror is no reader's copy; its readers are checked
                event("a hostile relay's own copy")
                continue
            want = self.contents[pulled.version]
            assert all(bytes(pulled.view(n)) == t.data for n, t in want.items()), f"a mixed copy of v{pulled.version}"
            event("copy accepted" if replica.kind == "plain" else f"copy accepted ({replica.kind})")
            if pulled.base is not None:
                held = {v.version for v in self.registry.machine.status().versions}
                gone = ", its base reclaimed by then" if pulled.base not in held else ""
                event(
                    f"copy patched from its delta{' (read from a relay)' if replica.puller.last_pull().source else ''}{gone}"
                )
            self.accepted.append((replica.name, pulled.version))

    @invariant()
    def the_book_holds(self) -> None:
        if self.loop is None:
            return
        self.registry.machine.sweep()
        self.registry.machine.relays.check()
        book = self.registry.machine.relays
        if any(book.source_of(i) not in (None, ORIGIN) for i in book.placed()):
            event("a lease reads from a relay")
        for offer in self.registry.machine.status().offers:
            progress = self.registry.machine.progress(offer.version)
            assert progress.state is not VersionState.ABORTED, f"an aborted v{offer.version} is still offered"
            assert offer.landed <= progress.committed, f"{offer.holder} claims more of v{offer.version} than exists"
            if offer.landed < offer.buckets:
                event("a relay offers a version still arriving")
        now = self.clock.now()
        silent = {r.name for r in self.replicas if r.dead and now - r.died_at > LIVENESS}
        offered = {o.holder for o in self.registry.machine.status().offers}
        assert not offered & silent, f"lapsed replicas still offer: {offered & silent}"

    def teardown(self) -> None:
        if self.loop is None:
            return
        try:
            if self.streamer.version is not None:  # a stream left open would keep its readers waiting
                self.loop.run(self.streamer.abort)
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
        machine.start(kinds=["plain", "plain"])
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


def relayed_stream(monkeypatch, *, then) -> RelayMachine:
    """A program written out: replica0 relays a stream it is still receiving, replica1
    (same host) is handed replica0 while the stream runs; `then(machine)` does the rest."""
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline)
    machine = RelayMachine()
    machine.start(kinds=["relay", "stream"])
    machine.begin_stream()  # v2, after the trainer's v1
    machine.start_pull(0)
    machine.land(1)
    machine.time_passes(0.5)  # replica0 reads bucket 0, then offers its mirror
    assert machine.registry.machine.relays.offer_of(2, "replica0").landed == 1
    machine.start_pull(1)
    book = machine.registry.machine.relays
    assert sorted(book.source_of(i) for i in book.placed()) == [ORIGIN, "replica0"]
    then(machine)
    return machine


def finish_stream(machine: RelayMachine) -> None:
    for _ in range(4):
        machine.land(1)
        machine.time_passes(0.5)
    machine.commit_stream(True)
    for _ in range(6):
        machine.time_passes(1.0)


def test_replay_a_relay_forwards_a_stream_it_still_receives(monkeypatch) -> None:
    machine = relayed_stream(monkeypatch, then=finish_stream)
    try:
        assert sorted(machine.accepted) == [("replica0", 2), ("replica1", 2)]
        assert machine.replicas[1].puller.metrics()["pull/failed"] == 0  # from the relay, all of it
    finally:
        machine.teardown()


def test_replay_a_relay_that_dies_mid_stream_sends_its_reader_to_the_origin(monkeypatch) -> None:
    def die_then_finish(machine: RelayMachine) -> None:
        machine.land(1)
        machine.time_passes(0.5)
        machine.die(0, relay=True)
        finish_stream(machine)

    machine = relayed_stream(monkeypatch, then=die_then_finish)
    try:
        assert machine.accepted == [("replica1", 2)]
    finally:
        machine.teardown()


def test_replay_a_relay_that_lies_about_its_count_yields_no_copy_of_it(monkeypatch, caplog) -> None:
    def lie_then_finish(machine: RelayMachine) -> None:
        machine.replicas[0].faults.delay = 3.0  # the relay's own reads lag far behind its word
        machine.land(2)  # the publisher committed every bucket; replica0 holds one so far
        machine.lie(0, 2)
        assert machine.registry.machine.relays.offer_of(2, "replica0").landed == 3
        finish_stream(machine)

    machine = relayed_stream(monkeypatch, then=lie_then_finish)
    try:
        assert "relay 'replica0' failed v2" in caplog.text and "digest" in caplog.text  # it read the lie
        assert ("replica1", 2) in machine.accepted  # then a copy from the origin alone
        assert machine.replicas[1].puller.metrics()["pull/failed"] == 0
    finally:
        machine.teardown()


def test_replay_a_relays_delta_of_another_base_is_never_patched_in(monkeypatch, caplog) -> None:
    """A program written out: replica1 holds v2; replica0 pulls v3, offers it, and its
    delta section turns into v1's changes to v3, not v2's; replica1, handed that relay,
    finds the section wrong before patching anything, and patches v3 from the trainer's."""
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline)
    machine = RelayMachine()
    try:
        machine.start(kinds=["plain", "plain"])  # v1
        machine.publish()  # v2
        machine.start_pull(1)
        machine.time_passes(2.0)
        machine.publish()  # v3: its delta is against v2
        machine.start_pull(0)
        machine.time_passes(2.0)
        machine.time_passes(2.0)
        machine.offer(0, None)
        assert machine.replicas[0].puller.offered == 3
        machine.serve_another_base(0, back=2)
        machine.start_pull(1)
        book = machine.registry.machine.relays
        assert [book.source_of(i) for i in book.placed()] == ["replica0"]  # handed the relay
        machine.time_passes(2.0)
        machine.time_passes(2.0)
        assert ("replica1", 3) in machine.accepted
        assert "piece 0 of its delta read from 'replica0' does not match" in caplog.text
        assert machine.replicas[1].puller.metrics()["pull/patched"] == 1  # from the trainer's slot
    finally:
        machine.teardown()
