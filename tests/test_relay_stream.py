"""Relays that forward a version while it still arrives: a relay offers its mirror once
its first bucket lands and advances the count it holds (`mark_offer`); streaming readers
placed there wait on that count; a relay that goes mid-stream sends its readers back to
choose again, and no copy ever mixes sources."""

from __future__ import annotations

import anyio
import pytest

from weightpull import FakeClock, InProcessRegistry, Manifest, Principal, VersionState
from weightpull.drivers.fake import FakeFaults
from weightpull.errors import InvalidArgumentError, NoSourceError, PermissionDeniedError, VersionStateError
from weightpull.layout import TensorSpec, plan_layout
from weightpull.transport import WrappedTransport

from .conftest import SlowCopy, autojump, host_tensors

pytestmark = pytest.mark.anyio

LAYOUT = plan_layout([TensorSpec(f"w{i}", "uint8", (1000,)) for i in range(4)], bucket_bytes=1024)
SIZES = (1500,) * 8  # eight buckets of 2048 bytes
RATE = 1500.0  # bytes per second: one bucket a second, copied and read alike


def manifest(version: int = 1, digests=None) -> Manifest:
    return Manifest(version, LAYOUT, "fake", b"src", 0, "pub", digests)


async def streaming(registry: InProcessRegistry, marked: int = 2) -> None:
    await registry.begin(1, publisher="pub", slot=0)
    await registry.stream(manifest())
    await registry.mark(1, marked)


# -- the registry ------------------------------------------------------------------------


async def test_a_relay_offers_a_streaming_version_and_its_readers_wait_on_its_count():
    registry = InProcessRegistry(FakeClock())
    await streaming(registry)
    with pytest.raises(VersionStateError, match="only a READY version"):
        await registry.offer(1, holder="relay", host="h1", descriptor=b"m")  # not whole: it must say what it holds
    await registry.offer(1, holder="relay", host="h1", descriptor=b"m", landed=1)
    lease = await registry.acquire(ttl=5.0, holder="reader", host="h1", streaming=True)
    assert lease.source == "relay"
    progress = await registry.progress(1, source="relay")
    assert (progress.committed, progress.state, progress.source) == (1, VersionState.STREAMING, "relay")

    woken: list[int] = []

    async def reader() -> None:
        woken.append((await registry.wait_for_buckets(1, 2, timeout=5.0, source="relay")).committed)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await anyio.wait_all_tasks_blocked()
        assert woken == []  # the publisher's 2 are not the relay's 1
        await registry.mark_offer(1, 2, holder="relay")
    assert woken == [2]


async def test_a_relays_copy_is_whole_only_once_it_holds_every_bucket_of_a_ready_version():
    registry = InProcessRegistry(FakeClock())
    await streaming(registry, marked=4)
    await registry.offer(1, holder="relay", host="h1", descriptor=b"m", landed=4)
    assert (await registry.progress(1, source="relay")).state is VersionState.STREAMING  # the version is not READY
    await registry.commit_stream(1, ["00" * 16] * 4)
    await registry.offer(1, holder="late", host="h1", descriptor=b"m2", landed=3)
    assert (await registry.progress(1)).state is VersionState.READY
    assert (await registry.progress(1, source="relay")).state is VersionState.READY
    late = await registry.progress(1, source="late")
    assert (late.state, late.committed) == (VersionState.STREAMING, 3)  # READY, but not yet there
    # A reader that reads every bucket at once is handed only relays that hold it whole.
    lease = await registry.acquire(1, ttl=5.0, holder="plain", host="h1", exclude=["relay"])
    assert lease.source == ""
    status = await registry.status()
    assert [(o.holder, o.landed, o.buckets, o.leases) for o in status.offers] == [("late", 3, 4, 0), ("relay", 4, 4, 0)]
    assert status.to_dict()["offers"][0] == {
        "version": 1,
        "holder": "late",
        "host": "h1",
        "landed": 3,
        "buckets": 4,
        "leases": 0,
        "cap": None,
    }
    assert "offers" not in (await InProcessRegistry(FakeClock()).status()).to_dict()  # as before when none


async def test_counts_only_grow_within_the_publishers_marks_and_only_under_ones_own_name():
    registry = InProcessRegistry(FakeClock())
    await streaming(registry, marked=2)
    relay = registry.as_principal(Principal.reader("relay"))
    with pytest.raises(InvalidArgumentError, match="publisher committed"):
        await relay.offer(1, holder="relay", host="h1", descriptor=b"m", landed=3)  # a lie: only 2 exist
    await relay.offer(1, holder="relay", host="h1", descriptor=b"m", landed=2)
    with pytest.raises(InvalidArgumentError, match="between the 2"):
        await relay.mark_offer(1, 1, holder="relay")
    with pytest.raises(InvalidArgumentError, match="publisher committed"):
        await relay.mark_offer(1, 3, holder="relay")
    with pytest.raises(PermissionDeniedError):
        await registry.as_principal(Principal.reader("other")).mark_offer(1, 2, holder="relay")
    with pytest.raises(VersionStateError, match="offers no v1"):
        await relay.mark_offer(1, 2, holder="relay/b")


async def test_an_aborted_stream_or_a_relay_gone_wakes_its_readers():
    registry = InProcessRegistry(FakeClock())
    await streaming(registry)
    await registry.offer(1, holder="relay", host="h1", descriptor=b"m", landed=1)
    await registry.offer(1, holder="relay2", host="h2", descriptor=b"m", landed=1)
    errors: list[BaseException] = []

    async def reader(source: str) -> None:
        try:
            await registry.wait_for_buckets(1, 4, timeout=5.0, source=source)
        except Exception as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        tg.start_soon(reader, "relay")
        await anyio.wait_all_tasks_blocked()
        await registry.withdraw(1, holder="relay")
    assert isinstance(errors[0], NoSourceError) and "no longer" in str(errors[0])
    async with anyio.create_task_group() as tg:
        tg.start_soon(reader, "relay2")
        await anyio.wait_all_tasks_blocked()
        await registry.abort(1, "the trainer died")
    assert isinstance(errors[1], VersionStateError) and "the trainer died" in str(errors[1])  # torn, not re-chosen
    assert registry.machine.relays.offers(1) == ()


async def test_a_stream_committed_without_digests_ends_its_offers():
    registry = InProcessRegistry(FakeClock())
    await streaming(registry)
    await registry.offer(1, holder="relay", host="h1", descriptor=b"m", landed=2)
    await registry.commit_stream(1)
    assert registry.machine.relays.offers(1) == ()
    with pytest.raises(NoSourceError):
        await registry.progress(1, source="relay")


async def test_a_lapsed_relays_offer_of_a_stream_vanishes():
    clock = FakeClock()
    registry = InProcessRegistry(clock, liveness_ttl=3.0)
    await streaming(registry)
    relay = registry.as_principal(Principal.reader("relay"))
    await relay.offer(1, holder="relay", host="h1", descriptor=b"m", landed=1)
    clock.advance(2.0)
    await registry.keepalive(("pub",))  # the publisher lives on; the relay falls silent
    clock.advance(2.0)
    with pytest.raises(NoSourceError):
        await registry.progress(1, source="relay")


# -- pullers that relay ------------------------------------------------------------------


async def chain(world, *, kill_relay1_at: float | None = None):
    """Publish v1 slowly, streamed; relay1 pulls it from the trainer while forwarding it,
    relay2 (its host's) pulls it from relay1. Returns when each ended, and the pullers."""
    adapter = SlowCopy(RATE, world.clock.sleep, None, "")
    publisher = world.publisher(stream=True, adapter=adapter, bucket_bytes=2048, digests=True)
    t1, t2 = (world.transport(faults=FakeFaults(bandwidth=RATE)) for _ in range(2))
    relay1 = world.puller(t1, host="h1", holder="relay1", stream=True, relay=True, ttl=30)
    relay2 = world.puller(t2, host="h1", holder="relay2", stream=True, relay=True, ttl=30)
    ended: dict[str, object] = {}
    sources: list[str] = []
    real_acquire = world.registry.acquire

    async def spy(*args, **kw):
        lease = await real_acquire(*args, **kw)
        sources.append(f"{kw['holder']}<-{lease.source or 'origin'}")
        return lease

    world.registry.acquire = spy

    async def publish():
        await publisher.publish(1, host_tensors(1, sizes=SIZES))
        ended["published"] = world.clock.now()

    async def pull(name, puller, after):
        await world.clock.sleep(after)
        try:
            ended[name] = await puller.pull()
        except Exception as exc:
            ended[name] = exc
        ended[f"{name}_end"] = world.clock.now()

    async def kill(at):
        await world.clock.sleep(at)
        await t1.aclose()  # relay1's process is gone: its mirror with it
        await world.registry.withdraw(1, holder="relay1")  # as its liveness lapsing would

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publish)
        tg.start_soon(pull, "relay1", relay1, 0.5)
        tg.start_soon(pull, "relay2", relay2, 2.5)
        if kill_relay1_at is not None:
            tg.start_soon(kill, kill_relay1_at)
    return ended, sources, relay2


def exact(pulled) -> bool:
    return all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(1, sizes=SIZES).items())


async def test_a_chain_of_relays_pipelines_a_streamed_version(world):
    ended, sources, relay2 = await chain(world)
    assert sources[:2] == ["relay1<-origin", "relay2<-relay1"]
    assert exact(ended["relay1"]) and exact(ended["relay2"])
    # 8 s of copy; each hop adds about a bucket's second, not another 8 s.
    assert ended["published"] == pytest.approx(8, abs=0.2)
    assert ended["relay2_end"] - ended["relay1_end"] <= 1.5
    assert relay2.offered == 1
    offers = {o.holder: (o.landed, o.buckets) for o in (await world.registry.status()).offers}
    assert offers == {"relay1": (8, 8), "relay2": (8, 8)}


async def test_a_relay_killed_mid_stream_sends_its_reader_back_to_the_trainer(world, caplog):
    ended, sources, relay2 = await chain(world, kill_relay1_at=4.5)
    assert isinstance(ended["relay1"], Exception)  # its own pull died with it
    assert sources[:3] == ["relay1<-origin", "relay2<-relay1", "relay2<-origin"]
    assert exact(ended["relay2"]) and relay2.metrics()["pull/failed"] == 0
    assert "relay 'relay1' failed v1" in caplog.text


async def test_a_relay_that_lies_about_its_count_leaves_no_copy_of_it(world, caplog):
    """A relay claims buckets its mirror does not hold: its reader reads zeros there, the
    publisher's digests refuse them, and it reads the version afresh from the trainer."""
    publisher = world.publisher(stream=True, digests=True, bucket_bytes=2048)
    await publisher.publish(1, host_tensors(1, sizes=SIZES))
    liar = world.transport()
    mirror = liar.allocate(8 * 2048, "cpu")
    await world.registry.offer(1, holder="liar", host="h1", descriptor=liar.export(mirror), landed=8)
    reader = world.puller(host="h1", holder="reader", stream=True)
    assert exact(await reader.pull())
    assert "relay 'liar' failed v1" in caplog.text and "digest" in caplog.text


def test_status_shows_each_relays_offer_and_its_json_only_adds_them():
    from weightpull.integrations.cli import _status_sections
    from weightpull.records import OfferInfo, RegistryStatus

    offers = (OfferInfo(4, "replica-1", "node-7", 3, 8, 1, 2), OfferInfo(4, "replica-2", "node-8", 8, 8, 0))
    status = RegistryStatus(3, (), (), {}, offers=offers)
    sections = {title: rows for title, _, rows in _status_sections(status)}
    assert sections["relays"] == [
        ["v4", "replica-1", "node-7", "3/8", "1/2"],
        ["v4", "replica-2", "node-8", "8/8", "0/-"],
    ]
    assert RegistryStatus.from_dict(status.to_dict()) == status
    assert set(RegistryStatus(3, (), (), {}).to_dict()) == {"newest_ready", "versions", "leases", "serving"}


async def test_an_idle_relays_client_keeps_its_offer_alive_and_a_dead_ones_lapses(tmp_path):
    """A relay that only serves its mirror asks the registry nothing: its client's
    heartbeat keeps its offer alive; once the client stops, the offer lapses."""
    pytest.importorskip("zmq")
    from weightpull.registry import connect_registry

    from .served import ServedRegistry, make_keys

    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "relay"))
    served = ServedRegistry(tmp_path, keys=keys, args=("--liveness-ttl", "2"))  # heartbeats: every 1 s
    served.start()
    try:
        async with connect_registry(served.address, **served.key("trainer")) as trainer:
            await trainer.begin(1, publisher="trainer", slot=0)
            await trainer.stream(Manifest(1, LAYOUT, "fake", b"src", 0, "trainer"))
            await trainer.mark(1, 2)
            relay = connect_registry(served.address, **served.key("relay"))
            async with relay:
                await relay.offer(1, holder="relay", host="h1", descriptor=b"m", landed=1)
                await anyio.sleep(4.0)  # idle, past its liveness TTL
                assert [o.holder for o in (await trainer.status()).offers] == ["relay"]
            await anyio.sleep(4.0)  # its client closed: silent now
            assert (await trainer.status()).offers == ()
    finally:
        served.stop()


class FairLink(WrappedTransport):
    """Reads in flight share `rate` bytes a second equally, as TCP streams over one link
    do (NIXL over UCX's tcp): reads asked together all land together, at the end. It
    records the most reads in flight and when each landed (mirror offset)."""

    def __init__(self, inner, clock, rate: float, tick: float = 0.125) -> None:
        super().__init__(inner)
        self.clock, self.rate, self.tick = clock, rate, tick
        self.left: dict[object, float] = {}
        self.most = 0
        self.landed: list[tuple[float, int]] = []

    async def read(self, remote, remote_offset, local, local_offset, nbytes) -> None:
        key = object()
        self.left[key] = nbytes
        self.most = max(self.most, len(self.left))
        try:
            while self.left[key] > 0:
                share = self.rate * self.tick / len(self.left)
                await self.clock.sleep(self.tick)
                self.left[key] -= share
        finally:
            del self.left[key]
        await self.inner.read(remote, remote_offset, local, local_offset, nbytes)
        self.landed.append((self.clock.now(), local_offset))


async def test_a_relay_reads_its_buckets_in_order_and_offers_each_as_it_lands(world):
    """Over a link whose reads share it fairly, a relay that asked for all 8 buckets at
    once would hold (and offer) its first only when it held them all; it reads them in
    order, one at a time, so each lands a bucket's time after the one before, and its
    offer and marks advance with them."""
    publisher = world.publisher(stream=True, digests=True, bucket_bytes=2048)
    await publisher.publish(1, host_tensors(1, sizes=SIZES))
    buckets = (await world.registry.get(1)).layout.buckets
    assert len(buckets) == 8
    link = FairLink(world.transport(), world.clock, rate=buckets[0].nbytes)  # a bucket a second
    relay = world.puller(link, host="h1", holder="relay", stream=True, relay=True, ttl=30)
    counts: list[tuple[float, int]] = []  # (when, buckets the relay said it holds)
    offer, mark = world.registry.offer, world.registry.mark_offer

    async def offering(version, **kw):
        counts.append((world.clock.now(), kw["landed"]))
        await offer(version, **kw)

    async def marking(version, landed, **kw):
        counts.append((world.clock.now(), landed))
        await mark(version, landed, **kw)

    world.registry.offer, world.registry.mark_offer = offering, marking
    async with autojump(world.clock):
        pulled = await relay.pull()
    assert exact(pulled)
    assert link.most == 1  # one read in flight at a time
    assert [offset for _, offset in link.landed] == [b.offset for b in buckets]  # in bucket order
    assert [when for when, _ in link.landed] == pytest.approx([i + 1.0 for i in range(8)], abs=0.3)
    assert counts[0] == (pytest.approx(1.0, abs=0.3), 1)  # offered once its first bucket landed
    assert [n for _, n in counts] == sorted({n for _, n in counts}) and counts[-1][1] == 8
    during = [n for when, n in counts if when < link.landed[-1][0]]
    assert len(during) >= 4  # its readers could follow it bucket by bucket
