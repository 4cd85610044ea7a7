import anyio
import pytest

from weightpull import InvalidArgumentError, NoReadyVersionError, TornReadError, TransportError
from weightpull.drivers.fake import FakeFaults
from weightpull.errors import DigestMismatchError, RegionNotRegisteredError, VersionStateError

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio


async def live_leases(world):
    return (await world.registry.status()).leases


async def test_round_trip_is_bit_exact(world):
    pub = world.publisher(bucket_bytes=1024)
    await pub.publish(1, host_tensors(1))
    puller = world.puller()
    pulled = await puller.pull()
    assert pulled.version == 1 and puller.mirror_version == 1
    assert len(pulled.layout.buckets) > 2
    for name, t in host_tensors(1).items():
        assert bytes(pulled.view(name)) == t.data
    assert await live_leases(world) == ()


async def test_pull_takes_the_newest_or_a_given_ready_version(world):
    pub = world.publisher(num_slots=3)
    puller = world.puller()
    with pytest.raises(NoReadyVersionError):
        await puller.pull()
    await pub.publish(1, host_tensors(1))
    await pub.publish(2, host_tensors(2))
    assert (await puller.pull()).version == 2
    assert (await puller.pull(2)).version == 2
    with pytest.raises(VersionStateError, match="RETIRED"):
        await puller.pull(1)


async def test_a_torn_read_is_rejected_and_never_handed_on(world):
    await world.publisher().publish(1, host_tensors(1))
    transport = world.transport(faults=FakeFaults(tear_reads=1, freeze=6.0))
    puller = world.puller(transport, ttl=5.0)
    with pytest.raises(TornReadError, match="lapsed"):
        await puller.pull()
    assert puller.mirror_version is None
    assert transport.faults.tear_reads == 0
    pulled = await puller.pull()  # the next pull is whole again
    assert bytes(pulled.view("t2")) == host_tensors(1)["t2"].data


async def test_the_fake_tear_really_corrupts_the_copy(world):
    """Control for the test above: the torn copy's bytes really differ. With a freeze
    inside the TTL the lease holds, so only the digests can catch the scribble."""
    await world.publisher(digests=True).publish(1, host_tensors(1))
    transport = world.transport(faults=FakeFaults(tear_reads=1, freeze=1.0))
    with pytest.raises(DigestMismatchError, match="bucket"):
        await world.puller(transport, ttl=5.0).pull()


async def test_slow_reads_renew_the_lease(world):
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1))
    nbytes = sum(len(t.data) for t in host_tensors(1).values())
    transport = world.transport(faults=FakeFaults(bandwidth=nbytes / 12.0))  # ~12 s a pull
    puller = world.puller(transport, ttl=5.0)
    async with autojump(world.clock):
        pulled = await puller.pull()
    assert world.clock.now() >= 12 and pulled.renewals >= 6
    assert bytes(pulled.view("t1")) == host_tensors(1)["t1"].data


async def test_a_lost_lease_cancels_the_reads_at_once(world):
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1))
    transport = world.transport(faults=FakeFaults(delay=100.0))
    puller = world.puller(transport, ttl=5.0)

    async def lose_lease():
        await world.clock.sleep(1)
        (lease,) = (await world.registry.status()).leases
        world.registry.machine._versions[1].leases[lease.id].expires_at = world.clock.now()  # aged by hand

    async with autojump(world.clock):
        async with anyio.create_task_group() as tg:
            tg.start_soon(lose_lease)
            with pytest.raises(TornReadError):
                await puller.pull()
    assert world.clock.now() < 100


async def test_a_failed_read_cancels_its_siblings_and_releases_the_lease(world):
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1))
    transport = world.transport(faults=FakeFaults(fail_reads=1))
    puller = world.puller(transport)
    with pytest.raises(TransportError, match="injected"):
        await puller.pull()
    assert transport.faults.reads < 6  # the others never finished
    assert await live_leases(world) == ()
    assert puller.mirror_version is None


async def test_the_lease_is_released_on_cancellation(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(world.transport(faults=FakeFaults(delay=1000.0)))
    async with anyio.create_task_group() as tg:
        tg.start_soon(puller.pull)
        await anyio.wait_all_tasks_blocked()
        assert len(await live_leases(world)) == 1
        tg.cancel_scope.cancel()
    assert await live_leases(world) == ()


async def test_digests_are_verified_on_pull(world):
    pub = world.publisher(digests=True, bucket_bytes=1024)
    r = await pub.publish(1, host_tensors(1))
    assert len(r.manifest.digests) == len(r.manifest.layout.buckets)
    assert (await world.puller().pull()).version == 1
    pub.slots[r.slot].region.host_view()[5] ^= 1  # bit rot in the slot
    with pytest.raises(DigestMismatchError, match="bucket 0"):
        await world.puller().pull()
    assert (await world.puller(verify_digests=False).pull()).version == 1


async def test_a_connection_to_memory_that_is_gone_is_dropped_not_kept(world):
    """A slot deregistered under a cached connection: the pull fails with the driver's
    error and the puller forgets that connection, so the next pull connects afresh."""
    pub = world.publisher()
    r = await pub.publish(1, host_tensors(1))
    transport = world.transport()
    puller = world.puller(transport)
    await puller.pull()
    assert list(puller._remotes) == [r.manifest.source]
    slot = pub.slots[r.slot].region
    pub.transport.deregister(slot)
    with pytest.raises(RegionNotRegisteredError):
        await puller.pull()
    assert not puller._remotes
    pub.transport.fabric.regions[slot.handle] = slot  # the same memory, back under the same descriptor
    assert (await puller.pull()).version == 1 and list(puller._remotes) == [r.manifest.source]


def test_digests_are_checked_on_host_mirrors_or_by_a_digester(world):
    """They are hashed on the CPU, or by a digester where the mirror lies: a GPU mirror
    without one skips them by default, and insisting is refused up front, rather than
    every pull failing after its reads."""
    assert world.puller().verify_digests
    with pytest.raises(InvalidArgumentError, match="or on 'cuda:0' by digester="):
        world.puller(device="cuda:0", verify_digests=True)


async def test_the_puller_notices_a_layout_change(world):
    pub = world.publisher(num_slots=2)
    puller = world.puller()
    await pub.publish(1, host_tensors(1, sizes=(10, 20)))
    await puller.pull()
    first_mirror = puller.mirror
    await pub.publish(2, host_tensors(2, sizes=(10, 20)))
    await puller.pull()
    assert puller.layout_changes == 0 and puller.mirror is first_mirror
    await pub.publish(3, host_tensors(3, sizes=(10, 20000)))
    pulled = await puller.pull()
    assert puller.layout_changes == 1 and puller.mirror is not first_mirror
    assert bytes(pulled.view("t1")) == host_tensors(3, sizes=(10, 20000))["t1"].data


async def test_remote_connections_are_reused_across_pulls(world):
    pub = world.publisher(num_slots=2)
    puller = world.puller()
    for v in range(1, 6):
        await pub.publish(v, host_tensors(v))
        await puller.pull()
    assert len(puller._remotes) == 2


async def test_a_manifest_from_another_transport_is_refused(world):
    r = await world.publisher().publish(1, host_tensors(1))
    puller = world.puller()
    assert r.manifest.transport == "fake"
    puller.transport.name = "other"
    with pytest.raises(InvalidArgumentError, match="'fake'"):
        await puller.pull()
    assert await live_leases(world) == ()


async def test_overlapping_pulls_each_hand_on_one_whole_version(world):
    """Regression (found by fuzz/test_concurrent.py): two pulls on one puller, as a
    prefetch and a forced load, wrote its one mirror together. The first returned v1,
    its lease valid throughout, with v2's bytes in some buckets."""
    pub = world.publisher(num_slots=3, bucket_bytes=1024)
    await pub.publish(1, host_tensors(1))
    nbytes = sum(len(t.data) for t in host_tensors(1).values())
    puller = world.puller(world.transport(faults=FakeFaults(bandwidth=nbytes / 2.0)))
    copies = {}

    async def pull():
        pulled = await puller.pull()
        copies[pulled.version] = {name: bytes(pulled.view(name)) for name in host_tensors(1)}

    async with autojump(world.clock):
        async with anyio.create_task_group() as tg:
            tg.start_soon(pull)
            await world.clock.sleep(0.5)  # v1 is half read
            await pub.publish(2, host_tensors(2))
            tg.start_soon(pull)
    assert copies == {v: {n: t.data for n, t in host_tensors(v).items()} for v in (1, 2)}


async def test_a_renewal_interval_at_or_past_the_ttl_is_refused(world):
    with pytest.raises(InvalidArgumentError, match="renew_every"):
        world.puller(ttl=5.0, renew_every=5.0)
