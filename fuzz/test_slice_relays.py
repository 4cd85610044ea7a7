"""Sliced relays as a Hypothesis state machine: tensor-parallel ranks of replicas pull
their slices (`SlicePuller(host=...)`), the relays among them offering their mirrors to
ranks of the same layout, while sources come and go under them.

Rules interleave a trainer's publishes (streamed: its copy takes fake time, so streaming
ranks read behind it); replicas of rank 0 or 1 of TP=2, or rank 1 of TP=4 (a layout no
TP=2 relay holds), each a principal of its own, that pull plain, streaming, or relaying;
relays that die mid-serve (their transport closes and they fall silent, so their
liveness lapses) or turn hostile (a byte of an offered mirror flipped); and time, timer
by timer. Reads are slow (every read takes fake time), so deaths land mid-read.
Invariants: every slice a pull hands on is exactly its rank's share of one version the
trainer published (checked against a numpy oracle of the pieces' boxes, not the plan);
the registry's book holds (no source over its cap, no lease at its own holder, no lease
of a layout at an offer of another); every offer of a slice has digests recorded; and a
replica silent past its liveness TTL offers nothing.
"""

from __future__ import annotations

import asyncio

import anyio
import anyio.to_thread
import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from weightpull import FakeClock, InProcessRegistry, Principal, Publisher, WeightpullError, WhenFull
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport
from weightpull.layout import TensorSpec
from weightpull.relays import ORIGIN
from weightpull.slice_puller import SlicePuller
from weightpull.slices import RankSlice, fuse, replicated, sharded, vocab
from weightpull.tensors import HostTensor, HostTensorAdapter

from .harness import Loop
from .profiles import event, example, fuzz

LIVENESS = 3.0
TTL = 2.0
BUCKET = 256  # a rank's mirror and the trainer's slot, in small buckets: reads in several steps
SPECS = [
    TensorSpec("embed", "int32", (10, 8)),
    TensorSpec("norm", "int32", (8,)),
    TensorSpec("q", "int32", (8, 8)),
    TensorSpec("k", "int32", (4, 8)),
    TensorSpec("o", "int32", (8, 8)),
]
RANKS = ((0, 2), (1, 2), (1, 4))  # (rank, of ranks): the TP=4 rank's layout no TP=2 relay holds
KINDS = ("plain", "stream", "relay")


def rank_slice(rank: int, ranks: int) -> RankSlice:
    by = {s.name: s for s in SPECS}
    return RankSlice(
        rank,
        ranks,
        [
            vocab(by["embed"], rank, ranks, pad_to=4),
            replicated(by["norm"]),
            fuse("qk", [sharded(by[n], 0, rank, ranks) for n in ("q", "k")]),
            sharded(by["o"], 1, rank, ranks),
        ],
    )


def full(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {s.name: rng.integers(-(2**31), 2**31 - 1, size=s.shape, dtype=np.int32) for s in SPECS}


def want(version: int, sliced: RankSlice) -> dict[str, bytes]:
    """Each parameter's bytes by the pieces' boxes, on the full tensors (the oracle)."""
    tensors, out = full(version), {}
    for p in sliced.params:
        param = np.zeros(p.shape, dtype=np.int32)
        for piece in p.pieces:
            src = tensors[piece.source][tuple(slice(a, b) for a, b in piece.box)]
            lead = len(p.shape) - src.ndim
            at = tuple(slice(a, a + 1) for a in piece.at[:lead]) + tuple(
                slice(a, a + e) for a, e in zip(piece.at[lead:], src.shape, strict=True)
            )
            param[at] = src.reshape(param[at].shape)
        out[p.name] = param.tobytes()
    return out


class SlowCopy(HostTensorAdapter):
    """The trainer's copy into its slot at `rate` bytes a second of fake time."""

    def __init__(self, clock: FakeClock, rate: float) -> None:
        self.clock, self.rate = clock, rate

    async def write(self, items, region) -> None:
        await self.clock.sleep(sum(p.spec.nbytes for _, p in items) / self.rate)
        await super().write(items, region)


class Replica:
    def __init__(self, index: int, machine: SliceRelayMachine, rank: tuple[int, int], kind: str) -> None:
        self.name, self.kind, self.rank = f"replica{index}", kind, rank
        self.principal = Principal.reader(self.name)
        self.transport = FakeTransport(clock=machine.clock, fabric=machine.fabric, faults=FakeFaults(delay=0.25))
        self.slice = rank_slice(*rank)
        self.puller = SlicePuller(
            machine.registry.as_principal(self.principal),
            self.transport,
            self.slice,
            holder=self.name,
            host="rack0",
            bucket_bytes=BUCKET,
            clock=machine.clock,
            ttl=TTL,
            stall_timeout=3.0,
            stream=kind == "stream",
            relay=kind == "relay",
            relay_cap=2 if kind == "relay" else None,
        )
        self.task: asyncio.Task | None = None
        self.dead = self.hostile = False
        self.died_at = 0.0

    @property
    def busy(self) -> bool:
        return self.task is not None and not self.task.done()


class SliceRelayMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.loop: Loop | None = None

    @initialize(
        replicas=st.lists(st.tuples(st.sampled_from(RANKS), st.sampled_from(KINDS)), min_size=2, max_size=5),
    )
    def start(self, replicas: list[tuple[tuple[int, int], str]]) -> None:
        example()
        self.clock = FakeClock()
        self.loop = Loop(self.clock)
        self.registry = InProcessRegistry(self.clock, liveness_ttl=LIVENESS)
        self.fabric = FakeFabric()
        self.publisher = Publisher(
            self.registry,
            FakeTransport(clock=self.clock, fabric=self.fabric),
            rollout_dtype=None,
            bucket_bytes=BUCKET,
            num_slots=3,
            when_full=WhenFull.SKIP,
            stream=True,
            adapter=SlowCopy(self.clock, 4 * BUCKET),
            name="trainer",
            clock=self.clock,
        )
        self.version = 0
        self.publishing: asyncio.Task | None = None
        self.accepted: list[tuple[str, int, str]] = []  # (replica, version, source) of every slice handed on
        self.replicas = [Replica(i, self, rank, kind) for i, (rank, kind) in enumerate(replicas)]
        self.publish()

    # -- the trainer and the replicas ----------------------------------------------------

    @rule()
    def publish(self) -> None:
        if self.publishing is not None and not self.publishing.done():
            return
        self.version += 1
        tensors = {n: HostTensor("int32", a.shape, a.tobytes()) for n, a in full(self.version).items()}
        self.publishing = self.loop.spawn(self.publisher.publish, self.version, tensors)

    def _alive_idle(self, pick: int) -> Replica | None:
        live = [r for r in self.replicas if not r.dead and not r.busy and not r.hostile]
        return live[pick % len(live)] if live else None

    @rule(pick=st.integers(0, 4))
    def start_pull(self, pick: int) -> None:
        replica = self._alive_idle(pick)
        if replica is not None:
            replica.task = self.loop.spawn(replica.puller.pull)

    @rule(lead=st.integers(1, 4).map(lambda n: n / 2))
    def pull_every_idle(self, lead: float) -> None:
        """Every live idle relay pulls, then `lead` seconds later every other replica: so
        that readers meet the relays' offers of the version they lease."""
        for relays in (True, False):
            for replica in self.replicas:
                idle = not replica.dead and not replica.busy and not replica.hostile
                if idle and (replica.kind == "relay") == relays:
                    replica.task = self.loop.spawn(replica.puller.pull)
            if relays:
                self.time_passes(lead)

    @rule(pick=st.integers(0, 4), relay=st.booleans(), draw=st.integers(0, 3))
    def die(self, pick: int, relay: bool, draw: int) -> None:
        live = [r for r in self.replicas if not r.dead]
        if len(live) <= 2 or draw:  # a quarter as often: replicas mostly live long enough to relay
            return
        relays = [r for r in live if r.puller.offered is not None]
        replica = (relays if relay and relays else live)[pick % len(relays if relay and relays else live)]
        replica.dead, replica.died_at = True, self.clock.now()
        if replica.task is not None:
            replica.task.cancel()
        self.loop.run(replica.transport.aclose)
        event("relay died" if replica.puller.offered is not None else "replica died")

    @rule(pick=st.integers(0, 4), at=st.integers(0, 1023))
    def turn_hostile(self, pick: int, at: int) -> None:
        self.collect()  # slices handed on before the flip are checked as they were handed on
        offering = [r for r in self.replicas if not r.dead and not r.busy and r.puller.offered is not None]
        if offering:
            hostile = offering[pick % len(offering)]
            assert hostile.puller.mirror is not None
            view = hostile.puller.mirror.host_view()
            view[at % len(view)] ^= 0x5A
            # From now on it only serves what it offers (it pulls no more): a relay vouches
            # for the digests it gives, so one that spoils its own copies is out of scope.
            hostile.hostile = True
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
            expected = want(pulled.version, replica.slice)
            assert all(bytes(pulled.view(n)) == b for n, b in expected.items()), (
                f"{replica.name}: a wrong slice of v{pulled.version} from {pulled.source or 'the trainer'}"
            )
            event(f"slice accepted ({replica.kind}, from {'a relay' if pulled.source else 'the trainer'})")
            self.accepted.append((replica.name, pulled.version, pulled.source))

    @invariant()
    def the_book_holds(self) -> None:
        if self.loop is None:
            return
        machine = self.registry.machine
        machine.sweep()
        book = machine.relays
        book.check()
        if any(book.source_of(i) not in (None, ORIGIN) for i in book.placed()):
            event("a rank reads from a relay")
        for offer in (o for v in range(self.version + 1) for o in book.offers(v)):
            assert offer.part is not None, "a whole version offered by a rank"
            assert book.attested(offer.version, offer.part) is not None, f"{offer.holder} offers unvouched bytes"
        now = self.clock.now()
        silent = {r.name for r in self.replicas if r.dead and now - r.died_at > LIVENESS}
        offered = {o.holder for o in machine.status().offers}
        assert not offered & silent, f"lapsed replicas still offer: {offered & silent}"

    def teardown(self) -> None:
        if self.loop is None:
            return
        try:
            if self.publishing is not None and not self.publishing.done():
                self.loop.finish(self.publishing, 60.0)
            for replica in self.replicas:
                if replica.busy:
                    self.loop.finish(replica.task, 60.0)  # every pull ends, one way or another
            self.collect()
        finally:
            self.loop.close()


async def _inline(fn, *args, **_):
    """`anyio.to_thread.run_sync`, run in the loop: the state machine steps its loop by
    hand and fake time jumps, so a real thread's result could land after its deadline."""
    return fn(*args)


def test_slice_relays(monkeypatch) -> None:
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline)

    def run(profile: settings) -> None:  # a few seconds in CI: a sliced pull is a few steps
        budget = settings(profile, max_examples=min(profile.max_examples, 100), stateful_step_count=30)
        run_state_machine_as_test(SliceRelayMachine, settings=budget)

    fuzz("test_slice_relays", run)


def test_replay_a_rank_reads_the_same_layouts_relay_and_a_dead_one_sends_it_back(monkeypatch, caplog) -> None:
    """A program written out: replica0 (rank 0, relaying) pulls and offers; replica1 (rank 0)
    is placed at it and reads it exactly; replica2 (rank 1) reads the trainer; then
    replica0 dies, and replica1's next pull, handed it before its offer lapsed, ends from
    the trainer."""
    monkeypatch.setattr(anyio.to_thread, "run_sync", _inline)
    machine = SliceRelayMachine()
    try:
        machine.start(replicas=[((0, 2), "relay"), ((0, 2), "plain"), ((1, 2), "plain")])
        machine.time_passes(2.0)  # v1 published
        machine.start_pull(0)
        machine.time_passes(2.0)
        assert machine.replicas[0].puller.offered == 1
        machine.start_pull(1)  # replica1 (of the idle ones), placed at replica0
        machine.start_pull(1)  # replica2 (replica1 is busy now)
        for _ in range(4):
            machine.time_passes(1.0)
        assert sorted(machine.accepted) == [("replica0", 1, ""), ("replica1", 1, "replica0"), ("replica2", 1, "")]
        machine.die(0, relay=True, draw=0)  # its process gone; its offer lapses only after LIVENESS
        machine.start_pull(0)  # replica1 again (of the live idle ones)
        assert "relay 'replica0' failed v1's slice" in caplog.text  # handed the dead relay first
        for _ in range(8):
            machine.time_passes(1.0)
        assert machine.accepted[-1] == ("replica1", 1, "")  # from the trainer, exactly
        machine.the_book_holds()
    finally:
        machine.teardown()
