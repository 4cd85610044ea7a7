"""`Puller.borrow`: a READY version lent in place, the publisher's slot itself, under a
lease held (and renewed) for the block and checked at its end. On a fake clock with the
fake driver (one process, one memory); tests/gpu/ borrows cuda_ipc slots across processes."""

import anyio
import pytest

from weightpull import (
    InvalidArgumentError,
    NoReadyVersionError,
    PublishError,
    RegistryUnavailableError,
    TornReadError,
    VersionState,
    VersionWaitTimeoutError,
)
from weightpull.errors import DigestMismatchError, PeerGoneError, VersionNotFoundError
from weightpull.layout import TensorSpec
from weightpull.transport import WrappedTransport

from .conftest import SlowCopy, autojump, host_tensors

pytestmark = pytest.mark.anyio


def assert_holds(lent, version: int) -> None:
    for name, tensor in host_tensors(version).items():
        assert bytes(lent.view(name)) == tensor.data, name


async def leases(world):
    return (await world.registry.status()).leases


async def test_a_borrowed_version_is_the_slot_itself_read_only_and_leased_for_the_block(world):
    publisher = world.publisher()
    await publisher.publish(1, host_tensors(1))
    puller = world.puller(holder="replica-0")
    async with puller.borrow() as lent:
        assert lent.version == 1 and lent.nbytes == lent.manifest.nbytes
        assert_holds(lent, 1)
        assert lent.region.view is not None and lent.region.view.readonly
        (lease,) = await leases(world)
        assert (lease.version, lease.holder) == (1, "replica-0")
    assert await leases(world) == ()
    assert puller.mirror is None and puller.metrics()["pull/borrows"] == 1  # no mirror, no copy


async def test_the_slot_is_not_rewritten_while_it_is_borrowed(world):
    publisher = world.publisher(when_full="skip")  # two slots
    await publisher.publish(1, host_tensors(1))
    puller = world.puller()
    async with puller.borrow() as lent:
        assert not (await publisher.publish(2, host_tensors(2))).skipped  # into the other slot
        async with puller.borrow() as newer:
            assert newer.version == 2
            assert_holds(newer, 2)
        assert (await publisher.publish(3, host_tensors(3))).skipped  # v1's slot is lent: the trainer moves on
        assert_holds(lent, 1)  # and the bytes stay
        assert sorted(x.version for x in await leases(world)) == [1]
    await publisher.publish(4, host_tensors(4))
    async with puller.borrow(4) as lent:
        assert_holds(lent, 4)


async def test_a_long_block_keeps_its_lease_renewed(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(ttl=5.0)
    async with autojump(world.clock):
        async with puller.borrow() as lent:
            await world.clock.sleep(12.0)  # more than twice the TTL
            (lease,) = await leases(world)
            assert lease.expires_in > 0
        assert_holds(lent, 1)
    assert puller.metrics()["pull/borrows"] == 1


class NoRenewals:
    """The registry, but renewals never reach it (a partition, or a stalled event loop)."""

    def __init__(self, registry) -> None:
        self._registry = registry

    def __getattr__(self, name):
        return getattr(self._registry, name)

    async def renew(self, lease):
        raise RegistryUnavailableError("the registry did not answer (a test's partition)")


async def test_a_lease_that_lapsed_while_borrowed_fails_the_block_at_its_end(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(ttl=5.0)
    puller.registry = NoRenewals(world.registry)
    async with autojump(world.clock):
        with pytest.raises(TornReadError, match="lapsed while it was borrowed; what was read of it may mix"):
            async with puller.borrow():
                await world.clock.sleep(6.0)
        assert puller.metrics()["pull/borrows"] == 0
        async with puller.borrow():  # a block within the TTL is whole
            await world.clock.sleep(1.0)
    assert puller.metrics()["pull/borrows"] == 1


async def test_the_blocks_own_error_goes_through_unwrapped_and_the_lease_is_released(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller()
    with pytest.raises(ValueError, match="the apply failed"):
        async with puller.borrow():
            raise ValueError("the apply failed")
    assert await leases(world) == () and puller.metrics()["pull/borrows"] == 0
    with anyio.move_on_after(0.5) as scope:  # cancelled inside: released too
        async with puller.borrow():
            await anyio.sleep_forever()
    assert scope.cancelled_caught and await leases(world) == ()


class CopiesOnly(WrappedTransport):
    def view(self, remote, device="cpu"):
        return None


async def test_a_driver_that_only_copies_is_refused_by_name_and_leaves_no_lease(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(CopiesOnly(world.transport()))
    with pytest.raises(InvalidArgumentError, match=r"the fake driver cannot lend v1's slot to cpu in place.*pull\(\)"):
        async with puller.borrow():
            pytest.fail("the block ran")
    assert await leases(world) == ()


async def test_nothing_ready_and_a_gone_publisher_are_typed_errors(world):
    puller = world.puller()
    with pytest.raises(NoReadyVersionError):
        async with puller.borrow():
            pass
    publisher = world.publisher()
    await publisher.publish(1, host_tensors(1))
    await publisher.transport.aclose()  # the trainer's process, gone
    with pytest.raises(PeerGoneError):
        async with puller.borrow():
            pass
    assert await leases(world) == ()


async def test_a_host_slot_whose_bytes_disagree_with_its_digests_is_refused(world):
    publisher = world.publisher(digests=True)
    result = await publisher.publish(1, host_tensors(1))
    slot = world.fabric.regions[max(world.fabric.regions)]  # the one region: the slot
    first = result.manifest.layout.buckets[0].offset
    slot.host_view()[first] ^= 0xFF  # a flipped bit, after the commit
    puller = world.puller()
    with pytest.raises(DigestMismatchError, match="v1: bucket 0"):
        async with puller.borrow():
            pytest.fail("the block ran")
    assert await leases(world) == ()
    skipping = world.puller(verify_digests=False)  # the caller's choice, as for a pull
    async with skipping.borrow() as lent:
        assert lent.version == 1


class CountingGets:
    """The registry, counting manifests fetched."""

    def __init__(self, registry) -> None:
        self._registry, self.gets = registry, 0

    def __getattr__(self, name):
        return getattr(self._registry, name)

    async def get(self, version):
        self.gets += 1
        return await self._registry.get(version)


async def test_a_borrow_waits_for_the_version_the_trainer_is_writing(world):
    publisher = world.publisher()
    await publisher.publish(1, host_tensors(1))
    puller = world.puller()
    puller.registry = counting = CountingGets(world.registry)
    async with autojump(world.clock), anyio.create_task_group() as tg:

        async def publish_later() -> None:
            await world.clock.sleep(3.0)
            await publisher.publish(2, host_tensors(2))

        tg.start_soon(publish_later)
        async with puller.borrow(2, wait=10.0) as lent:
            assert lent.version == 2 and world.clock.now() == pytest.approx(3.0)
            assert_holds(lent, 2)
        assert counting.gets == 0  # the manifest came with the wait's answer
        with pytest.raises(VersionWaitTimeoutError, match="no version >= 3 within 1.5 s"):
            async with puller.borrow(3, wait=1.5):
                pytest.fail("the block ran")
    assert await leases(world) == ()
    for bad in (-1.0, float("inf"), float("nan"), "1"):
        with pytest.raises(InvalidArgumentError, match="wait must be a finite number of seconds"):
            async with puller.borrow(wait=bad):
                pass


async def test_a_replica_that_only_borrows_maps_the_slots_ahead_without_a_mirror(world):
    publisher = world.publisher()
    specs = [TensorSpec(name, t.dtype, t.shape) for name, t in host_tensors(1).items()]
    await publisher.reserve(specs)
    puller = world.puller()
    assert await puller.prepare(mirror=False) == 2 and puller.mirror is None
    await publisher.publish(1, host_tensors(1))
    async with puller.borrow() as lent:
        assert_holds(lent, 1)
    assert puller.mirror is None


# -- a streaming puller's borrow: leased while written, lent once READY -------------------

SIZES = (1500,) * 8  # eight buckets of 2048 bytes
RATE = 1500.0  # bytes per second: one bucket a second


async def test_a_streaming_borrow_leases_the_version_as_it_is_written_and_lends_it_once_ready(world):
    publisher = world.publisher(stream=True, adapter=SlowCopy(RATE, world.clock.sleep), bucket_bytes=2048)
    puller = world.puller(stream=True, holder="replica-0")
    seen = {}
    async with autojump(world.clock), anyio.create_task_group() as tg:

        async def publish_later() -> None:
            await world.clock.sleep(2.0)  # asked for before the trainer begins it
            await publisher.publish(1, host_tensors(1, sizes=SIZES))
            seen["committed"] = world.clock.now()

        async def watch_leases() -> None:  # the lease is held while the version still streams
            while "lent" not in seen:
                progress = await world.registry.progress(1) if await leases(world) else None
                if progress is not None and progress.state is VersionState.STREAMING:
                    seen.setdefault("leased_while_streaming", progress.committed)
                await world.clock.sleep(0.25)

        tg.start_soon(publish_later)
        tg.start_soon(watch_leases)
        async with puller.borrow(1, wait=30.0) as lent:
            seen["lent"] = world.clock.now()
            assert lent.version == 1 and lent.manifest.version == 1
            assert (await world.registry.progress(1)).state is VersionState.READY
            for name, tensor in host_tensors(1, sizes=SIZES).items():
                assert bytes(lent.view(name)) == tensor.data, name
    assert seen["lent"] == pytest.approx(seen["committed"], abs=0.01)  # the READY notice, nothing more
    assert seen["committed"] >= 2.0 + len(SIZES) - 0.01  # one bucket a second
    assert 1 <= seen["leased_while_streaming"] < len(SIZES)
    assert await leases(world) == ()
    assert puller.mirror is None and puller.metrics()["pull/borrows"] == 1


def aborting(world):
    """A streaming publish of v1 whose copy fails at its fifth write: run it in a task."""
    adapter = SlowCopy(RATE, world.clock.sleep, 4, "the trainer's device fell off the bus")
    publisher = world.publisher(stream=True, adapter=adapter, bucket_bytes=2048)

    async def publish() -> None:
        with pytest.raises(PublishError):
            await publisher.publish(1, host_tensors(1, sizes=SIZES))

    return publish


async def test_a_stream_aborted_while_borrowed_never_enters_the_block(world):
    publish = aborting(world)
    puller = world.puller(stream=True)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publish)
        with pytest.raises(TornReadError, match="ABORTED.*device fell off"):
            async with puller.borrow(1, wait=30.0):
                pytest.fail("the block ran")
    assert await leases(world) == ()


async def test_a_streaming_borrow_of_a_number_never_begun_is_told_so(world):
    publisher = world.publisher(stream=True)
    puller = world.puller(stream=True)
    async with autojump(world.clock), anyio.create_task_group() as tg:

        async def publish_later() -> None:
            await world.clock.sleep(1.0)
            await publisher.publish(5, host_tensors(5))

        tg.start_soon(publish_later)
        with pytest.raises(VersionNotFoundError):  # v5 began, so v3 never will
            async with puller.borrow(3, wait=30.0):
                pytest.fail("the block ran")
        with pytest.raises(VersionWaitTimeoutError, match="v9: not begun within 2.0 s"):
            async with puller.borrow(9, wait=2.0):
                pytest.fail("the block ran")
    async with puller.borrow(5, wait=1.0) as lent:  # READY already: lent at once
        assert_holds(lent, 5)


async def test_a_borrow_not_whole_names_the_tensors_as_they_land_and_checks_the_version_on_leaving(world):
    publisher = world.publisher(stream=True, adapter=SlowCopy(RATE, world.clock.sleep), bucket_bytes=2048)
    puller = world.puller(stream=True)
    batches, seen = [], {}
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publisher.publish, 1, host_tensors(1, sizes=SIZES))
        async with puller.borrow(1, wait=30.0, whole=False) as lent:
            seen["entered"] = (world.clock.now(), (await world.registry.progress(1)).state)
            async for names in lent.landed():
                layout = lent.manifest.layout
                for name in names:  # each tensor named is whole in the slot already
                    assert bytes(lent.view(name)) == host_tensors(1, sizes=SIZES)[name].data
                batches.append((world.clock.now(), names, max(layout[n].bucket for n in names)))
        seen["left"] = world.clock.now()
    assert seen["entered"][1] is VersionState.STREAMING  # lent while written
    assert len(batches) >= 3 and batches[0][0] < batches[-1][0] - 4  # applied behind the copy, bucket by bucket
    assert [n for _, names, _ in batches for n in names] == list(host_tensors(1, sizes=SIZES))  # each once, in order
    assert (await world.registry.progress(1)).state is VersionState.READY
    assert await leases(world) == ()


async def test_a_stream_aborted_while_applied_not_whole_is_torn(world):
    publish = aborting(world)
    puller = world.puller(stream=True)
    applied: list[str] = []
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publish)
        with pytest.raises(TornReadError, match="ABORTED"):
            async with puller.borrow(1, wait=30.0, whole=False) as lent:
                async for names in lent.landed():
                    applied.extend(names)  # what must be undone
    assert 0 < len(applied) < len(SIZES)
    assert await leases(world) == ()
    with pytest.raises(InvalidArgumentError, match="stream=True"):
        async with world.puller().borrow(whole=False):
            pytest.fail("the block ran")


async def test_a_version_lent_whole_names_every_tensor_at_once(world):
    await world.publisher().publish(1, host_tensors(1))
    async with world.puller().borrow() as lent:
        assert [names async for names in lent.landed()] == [tuple(host_tensors(1))]


class OnlyOldReleases:
    """The registry, as one of an earlier release sees it: no release_checked."""

    def __init__(self, registry) -> None:
        self._registry, self.calls = registry, []

    def __getattr__(self, name):
        if name == "release_checked":
            raise AttributeError(name)
        self.calls.append(name)
        return getattr(self._registry, name)


async def test_leaving_a_borrow_releases_and_checks_the_lease_in_one_call_where_the_registry_can(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller()
    calls = []
    real = world.registry.release_checked

    async def spy(lease):
        calls.append(lease.version)
        return await real(lease)

    world.registry.release_checked = spy
    async with puller.borrow() as lent:
        assert_holds(lent, 1)
    assert calls == [1] and await leases(world) == ()
    old = world.puller()
    old.registry = OnlyOldReleases(world.registry)
    async with old.borrow() as lent:
        assert_holds(lent, 1)
    assert ["is_valid", "release"] == [c for c in old.registry.calls if c in ("is_valid", "release")]
    assert await leases(world) == ()


def test_a_release_says_whether_the_lease_held_until_then():
    from weightpull import FakeClock
    from weightpull.registry_machine import RegistryMachine

    from .test_stream import manifest

    clock = FakeClock()
    machine = RegistryMachine(clock)
    machine.begin(1, publisher="pub", slot=0)
    machine.commit(manifest(1))
    held = machine.acquire(1, ttl=5.0, holder="r")
    assert machine.release(held) is True
    assert machine.release(held) is False  # ended already
    lapsed = machine.acquire(1, ttl=5.0, holder="r")
    clock.advance(6.0)
    assert machine.release(lapsed) is False
