"""Relays end to end, in one process over the fake transport: a replica offers its mirror,
the registry places readers' leases at it, readers check every bucket against the
publisher's digests, and a relay that fails a reader sends it elsewhere, never leaving
it a copy of two sources."""

from __future__ import annotations

import pytest

from weightpull import FakeClock, InProcessRegistry, InvalidArgumentError, PermissionDeniedError, Principal, digests
from weightpull.clock import within
from weightpull.drivers.fake import FakeTransport
from weightpull.errors import NoSourceError, TransportError, VersionStateError
from weightpull.manifest import Manifest

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio


def same(pulled, version=1) -> bool:
    return all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(version).items())


async def test_a_reader_reads_a_relay_on_its_host_and_the_copy_is_exact(world):
    publisher = world.publisher(digests=True)
    await publisher.publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    assert same(await relay.pull())
    assert await relay.offer() == 1
    await publisher.transport.aclose()  # the trainer's slot is gone: only the relay can serve now
    reader = world.puller(host="h1", holder="reader")
    assert same(await reader.pull())
    assert await world.registry.readers_at(1, "relay") == 0  # its lease ended


async def test_a_relay_that_died_sends_its_reader_back_to_the_origin(world, caplog):
    await world.publisher(digests=True).publish(1, host_tensors(1))
    transport = world.transport()
    relay = world.puller(transport, host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    await transport.aclose()  # the relay's process exited; its offer has not lapsed yet
    reader = world.puller(host="h1", holder="reader")
    pulled = await reader.pull()
    assert same(pulled) and reader.metrics()["pull/failed"] == 0
    assert "relay 'relay' failed v1" in caplog.text  # it was handed the relay first


async def test_bytes_a_relay_changed_are_caught_and_read_again_elsewhere(world, caplog):
    await world.publisher(digests=True).publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    relay.mirror.host_view()[10] ^= 0xFF  # a bug, or a hostile relay
    reader = world.puller(host="h1", holder="reader")
    assert same(await reader.pull())  # from the origin, after the relay's copy failed its digests
    assert "does not match the publisher's blake2b128 digest" in caplog.text


async def test_a_relay_keeps_its_mirror_while_a_lease_reads_from_it(world):
    publisher = world.publisher(digests=True, num_slots=2)
    await publisher.publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    lease = await world.registry.acquire(1, ttl=5.0, holder="reader", host="h1")
    assert lease.source == "relay" and lease.descriptor
    assert await world.registry.readers_at(1, "relay") == 1
    await publisher.publish(2, host_tensors(2))
    # the relay's next pull waits for that lease to end (here: its TTL on the fake clock)
    start = world.clock.now()
    async with autojump(world.clock):
        assert same(await relay.pull(), 2)
    assert world.clock.now() - start >= 5.0
    assert world.registry.machine.relays.offers(1) == ()  # it withdrew its offer first


async def test_offers_need_digests_a_ready_version_and_names_of_ones_own():
    registry = InProcessRegistry(FakeClock())
    reader = registry.as_principal(Principal.reader("r"))
    with pytest.raises(Exception, match="unknown"):
        await registry.offer(1, holder="r", host="h", descriptor=b"d")
    from weightpull.layout import TensorSpec, plan_layout

    layout = plan_layout([TensorSpec("w", "uint8", (10,))])
    await registry.begin(1, publisher="p", slot=0)
    with pytest.raises(VersionStateError, match="READY"):
        await registry.offer(1, holder="r", host="h", descriptor=b"d")
    await registry.commit(Manifest(1, layout, "fake", b"src", 0, "p"))
    with pytest.raises(InvalidArgumentError, match="no digests"):
        await registry.offer(1, holder="r", host="h", descriptor=b"d")
    with pytest.raises(PermissionDeniedError):
        await reader.offer(1, holder="someone-else", host="h", descriptor=b"d")


async def test_a_lapsed_relays_offers_vanish_after_its_liveness_ttl():
    clock = FakeClock()
    registry = InProcessRegistry(clock, liveness_ttl=2.0)
    from weightpull.layout import TensorSpec, plan_layout

    layout = plan_layout([TensorSpec("w", "uint8", (10,))])
    publisher = registry.as_principal(Principal.publisher("p"))
    await publisher.begin(1, publisher="p", slot=0)
    await publisher.commit(Manifest(1, layout, "fake", b"src", 0, "p", digests=("00" * 16,)))
    relay = registry.as_principal(Principal.reader("relay"))
    await relay.offer(1, holder="relay", host="h1", descriptor=b"mirror")
    assert (await registry.acquire(1, ttl=5.0, holder="a", host="h1")).source == "relay"
    clock.advance(1.5)
    await publisher.newest()  # the publisher is heard from; the relay is not
    clock.advance(1.0)
    assert (await registry.acquire(1, ttl=5.0, holder="b", host="h1")).source == ""


async def test_a_full_relay_and_an_excluded_origin_leave_no_source(world):
    await world.publisher(digests=True).publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer(cap=1)
    lease = await world.registry.acquire(1, ttl=5.0, holder="a", host="h1")
    assert lease.source == "relay"
    with pytest.raises(NoSourceError, match="full"):
        await world.registry.acquire(1, ttl=5.0, holder="b", host="h1", exclude=["origin"])
    await world.registry.release(lease)
    assert (await world.registry.acquire(1, ttl=5.0, holder="b", host="h1", exclude=["origin"])).source == "relay"


async def test_host_needs_a_name_and_a_gpu_mirror_a_digester(world):
    with pytest.raises(InvalidArgumentError, match="digester=weightpull.integrations.torch_digests.wsum64_digests"):
        world.puller(host="h1", device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="host must be"):
        world.puller(host="")
    with pytest.raises(InvalidArgumentError, match="host="):
        await world.puller().offer()


async def test_a_relay_with_a_spare_mirror_pulls_on_while_leases_read_the_offered_one(world):
    """With `spare_mirror`, the next pull goes into the other mirror at once, leaving the
    offered one, bytes unchanged, to the lease reading it; the pull after withdraws the
    older offer (its readers long gone) and reuses that mirror."""
    publisher = world.publisher(digests=True, num_slots=2)
    await publisher.publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay", spare_mirror=True)
    pulled = await relay.pull()
    await relay.offer()
    first = relay.mirror
    lease = await world.registry.acquire(1, ttl=5.0, holder="reader", host="h1")
    assert lease.source == "relay"
    await publisher.publish(2, host_tensors(2))
    start = world.clock.now()
    assert same(await relay.pull(), 2)
    assert world.clock.now() == start  # no wait for the reader's lease
    assert relay.mirror is not first and relay.mirror_version == 2
    assert pulled.region is first and same(pulled, 1)  # what the lease reads, unchanged
    assert [o.holder for o in world.registry.machine.relays.offers(1)] == ["relay"]  # still offered
    await world.registry.release(lease)
    await relay.offer()
    await publisher.publish(3, host_tensors(3))
    assert same(await relay.pull(), 3)
    assert relay.mirror is first  # the older offer withdrawn, its mirror reused
    assert world.registry.machine.relays.offers(1) == ()
    assert [o.holder for o in world.registry.machine.relays.offers(2)] == ["relay"]


async def test_a_spare_mirror_needs_a_relay(world):
    with pytest.raises(InvalidArgumentError, match="host="):
        world.puller(spare_mirror=True)


async def test_a_pull_cancelled_while_it_waits_for_a_relays_readers_leaves_the_next_to_wait(world):
    """The pull that waits for a lease reading the offered mirror is cancelled (a newer
    prefetch, a timeout): the next pull must still wait for that lease, never writing the
    mirror under it."""
    publisher = world.publisher(digests=True, num_slots=3)
    await publisher.publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    lease = await world.registry.acquire(1, ttl=5.0, holder="reader", host="h1")
    assert lease.source == "relay"
    await publisher.publish(2, host_tensors(2))
    start = world.clock.now()
    async with autojump(world.clock):
        assert await within(world.clock, 1.0, relay.pull) == (False, None)  # cancelled mid-wait
        assert relay.mirror_version == 1 and same(relay._last, 1)  # nothing written yet
        assert await world.registry.readers_at(1, "relay") == 1
        assert same(await relay.pull(), 2)
    assert world.clock.now() - start >= 5.0  # the lease's TTL: the second pull waited too
    assert world.registry.machine.relays.offers(1) == ()


async def test_a_withdraw_that_failed_leaves_the_next_pull_to_wait_for_the_relays_readers(world, monkeypatch):
    publisher = world.publisher(digests=True, num_slots=3)
    await publisher.publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    await world.registry.acquire(1, ttl=5.0, holder="reader", host="h1")
    await publisher.publish(2, host_tensors(2))
    withdraw = world.registry.withdraw

    async def unreachable(*args, **kwargs):
        monkeypatch.setattr(world.registry, "withdraw", withdraw)  # once
        raise TransportError("the registry is unreachable")

    monkeypatch.setattr(world.registry, "withdraw", unreachable)
    start = world.clock.now()
    async with autojump(world.clock):
        with pytest.raises(TransportError, match="unreachable"):
            await relay.pull()
        assert same(await relay.pull(), 2)
    assert world.clock.now() - start >= 5.0


async def test_a_relay_with_a_spare_mirror_cancelled_while_it_waits_for_the_spares_readers(world):
    """v1's mirror is read by a lease while v2 sits in the spare; the pull of v3 (into v1's
    mirror) waits for that lease and is cancelled: the mirrors stay as they were, v2 still
    offered, and the pull after waits for v1's lease in turn."""
    publisher = world.publisher(digests=True, num_slots=4)
    await publisher.publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay", spare_mirror=True)
    first = (await relay.pull()).region
    await relay.offer()
    lease = await world.registry.acquire(1, ttl=5.0, holder="reader", host="h1")
    assert lease.source == "relay"
    await publisher.publish(2, host_tensors(2))
    second = await relay.pull()
    await relay.offer()
    await publisher.publish(3, host_tensors(3))
    start = world.clock.now()
    async with autojump(world.clock):
        assert await within(world.clock, 1.0, relay.pull) == (False, None)
        assert relay.mirror is second.region and relay.offered == 2  # as they were
        assert [o.holder for o in world.registry.machine.relays.offers(2)] == ["relay"]
        assert bytes(first.host_view()[:1000]) == host_tensors(1)["t0"].data
        pulled = await relay.pull()
    assert world.clock.now() - start >= 5.0
    assert same(pulled, 3) and pulled.region is first and same(second, 2)


@pytest.mark.parametrize("stream", [False, True])
async def test_a_relayed_copy_is_checked_once_bucket_by_bucket(world, monkeypatch, stream):
    """A copy read from a relay is checked against the publisher's digests once, each
    bucket (the relayed check), not a second time by the check of every copy."""
    from weightpull import digests

    await world.publisher(digests=True, stream=stream).publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay", stream=stream)
    await relay.pull()
    await relay.offer()
    checked: list[int] = []
    real = digests.digest

    def counting(data, kind=digests.BLAKE2B128):
        checked.append(len(data))
        return real(data, kind)

    monkeypatch.setattr(digests, "digest", counting)
    reader = world.puller(host="h1", holder="reader", stream=stream)
    pulled = await reader.pull()
    assert same(pulled) and pulled.manifest.digests is not None
    assert checked == [b.nbytes for b in pulled.layout.buckets]  # one check per bucket
    checked.clear()
    assert same(await world.puller(holder="direct", stream=stream).pull())  # the slot's copy: checked once too
    assert checked == [b.nbytes for b in pulled.layout.buckets]


# -- mirrors on a device: digests checked by a digester ------------------------------------


class OnDevice(FakeTransport):
    """The fake driver, its mirrors labelled as on a device: a puller with device="cuda:0"
    (staging=False) takes a GPU mirror's path, where digests are the digester's to check."""

    def allocate(self, nbytes: int, device: str = "cpu"):
        region = super().allocate(nbytes, "cpu")
        region.device = device
        return region


def wsum64_of_host(calls: list):
    """A digester computing real wsum64 digests of the region's bytes, counting its calls."""

    def digester(region, spans):
        calls.append(len(spans))
        view = region.memory if region.view is None else region.view
        return [digests.digest(memoryview(view)[o : o + n], digests.WSUM64) for o, n in spans]

    return digester


def torch_digester(calls: list):
    """The torch integration's own (wsum64 by tensor ops, here on host memory)."""
    wsum64_digests = pytest.importorskip("weightpull.integrations.torch_digests").wsum64_digests

    def digester(region, spans):
        calls.append(len(spans))
        return wsum64_digests(region, spans)

    return digester


@pytest.mark.parametrize("make", [wsum64_of_host, torch_digester])
@pytest.mark.parametrize("device", ["cpu", "cuda:0"])
async def test_a_digester_checks_a_relayed_copy_and_catches_a_changed_byte(world, caplog, make, device):
    """A relayed copy (into a host mirror, or a mirror on a "device") is checked by the
    digester, once, each bucket; a byte the relay changed is caught, and the copy read
    again from the trainer's slot (checked by the digester too)."""
    await world.publisher(digests="wsum64").publish(1, host_tensors(1))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    calls: list[int] = []

    def reader(name):
        transport = OnDevice(clock=world.clock, fabric=world.fabric)
        return world.puller(transport, host="h1", holder=name, device=device, staging=False, digester=make(calls))

    first = await reader("reader").pull()
    assert same(first) and calls == [len(first.layout.buckets)]
    assert first.region.device == device and "failed" not in caplog.text
    relay.mirror.host_view()[10] ^= 0xFF  # a bug, or a hostile relay
    calls.clear()
    second = reader("reader2")
    assert same(await second.pull()) and second.metrics()["pull/failed"] == 0
    assert "relay 'relay' failed v1" in caplog.text and "does not match the publisher's wsum64 digest" in caplog.text
    assert calls == [len(first.layout.buckets)] * 2  # the relay's copy, then the slot's


async def test_a_mirror_on_a_device_refuses_digests_it_cannot_check_before_reading(world):
    """BLAKE2b digests are computed on the host only: a GPU mirror that reads from relays
    refuses such a version, naming the fix, before any byte is read; one that reads the
    trainer's slot alone (no host=) pulls it unchecked, as before."""
    await world.publisher(digests=True).publish(1, host_tensors(1))
    calls: list[int] = []
    transport = OnDevice(clock=world.clock, fabric=world.fabric)
    gpu = world.puller(transport, host="h1", device="cuda:0", staging=False, digester=wsum64_of_host(calls))
    with pytest.raises(InvalidArgumentError, match=r"records blake2b128 digests.*publish with digests='wsum64'"):
        await gpu.pull()
    assert gpu.mirror is None and calls == []  # refused before its mirror was made
    assert (await world.registry.status()).leases == ()  # its lease released
    plain = world.puller(transport, device="cuda:0", staging=False, digester=wsum64_of_host(calls))
    assert same(await plain.pull()) and calls == []
    with pytest.raises(InvalidArgumentError, match="records blake2b128"):
        await world.puller(
            transport, device="cuda:0", staging=False, digester=wsum64_of_host(calls), verify_digests=True
        ).pull()
