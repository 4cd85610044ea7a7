import anyio
import pytest

from weightpull import (
    HostTensor,
    InvalidArgumentError,
    Publisher,
    PublishError,
    SlotState,
    TransportError,
    VersionState,
)
from weightpull.errors import NoFreeSlotError, SlotWaitTimeoutError, VersionOrderError
from weightpull.transport import WrappedTransport

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio


async def states(world):
    return {v.version: v.state for v in (await world.registry.status()).versions}


async def test_publish_writes_a_slot_and_announces_it(world):
    pub = world.publisher()
    result = await pub.publish(1, host_tensors(1))
    assert not result.skipped and result.manifest.version == 1
    assert (await world.registry.newest()) == result.manifest
    slot = pub.slots[result.slot]
    assert slot.state is SlotState.HOLDING and slot.version == 1
    view = slot.region.host_view()
    for name, t in host_tensors(1).items():
        p = result.manifest.layout[name]
        assert bytes(view[p.offset : p.end]) == t.data


async def test_slots_are_registered_once(world):
    pub = world.publisher(num_slots=2)
    regions = set()
    for v in range(1, 7):
        r = await pub.publish(v, host_tensors(v))
        regions.add(id(pub.slots[r.slot].region))
    assert len(regions) == 2


async def test_a_slot_is_reused_only_after_its_leases_end(world):
    pub = world.publisher(num_slots=2, when_full="fail")
    await pub.publish(1, host_tensors(1))
    lease = await world.registry.acquire(1, ttl=10, holder="reader")
    await pub.publish(2, host_tensors(2))  # the free slot
    with pytest.raises(NoFreeSlotError, match="leased by reader") as info:
        await pub.publish(3, host_tensors(3))  # slot 0: v1 leased; slot 1: v2 newest
    assert "READY" in str(info.value)
    await world.registry.release(lease)
    r = await pub.publish(4, host_tensors(4))
    assert r.slot == 0
    assert await states(world) == {2: VersionState.RETIRED, 4: VersionState.READY}


async def test_an_expired_lease_frees_the_slot(world):
    pub = world.publisher(num_slots=2, when_full="fail")
    await pub.publish(1, host_tensors(1))
    await world.registry.acquire(1, ttl=10, holder="dead-reader")  # never released
    await pub.publish(2, host_tensors(2))
    world.clock.advance(10)
    assert (await pub.publish(3, host_tensors(3))).slot == 0


async def test_wait_policy_times_out_with_a_clear_error(world):
    pub = world.publisher(num_slots=2, when_full="wait", wait_timeout=3)
    await pub.publish(1, host_tensors(1))
    await world.registry.acquire(1, ttl=100, holder="reader")
    await pub.publish(2, host_tensors(2))
    async with autojump(world.clock):
        with pytest.raises(SlotWaitTimeoutError, match="within 3"):
            await pub.publish(3, host_tensors(3))
    assert world.clock.now() == pytest.approx(3)
    assert (await world.registry.newest()).version == 2


async def test_wait_policy_publishes_once_a_lease_ends(world):
    pub = world.publisher(num_slots=2, when_full="wait", wait_timeout=30)
    await pub.publish(1, host_tensors(1))
    await world.registry.acquire(1, ttl=4, holder="reader")
    await pub.publish(2, host_tensors(2))
    async with autojump(world.clock):
        result = await pub.publish(3, host_tensors(3))
    assert result.slot == 0 and 4 <= world.clock.now() < 4.1
    assert result.blocked_s == pytest.approx(world.clock.now(), abs=0.1)


async def test_skip_policy_publishes_nothing(world):
    pub = world.publisher(num_slots=2, when_full="skip")
    await pub.publish(1, host_tensors(1))
    await world.registry.acquire(1, ttl=100, holder="reader")
    await pub.publish(2, host_tensors(2))
    result = await pub.publish(3, host_tensors(3))
    assert result.skipped and result.manifest is None
    assert (await world.registry.newest()).version == 2
    assert 3 not in await states(world)


async def test_versions_must_increase(world):
    pub = world.publisher()
    await pub.publish(2, host_tensors(2))
    with pytest.raises(VersionOrderError):
        await pub.publish(2, host_tensors(2))


async def test_a_failed_copy_aborts_and_keeps_the_previous_version(world):
    class Exploding:
        def describe(self, name, value, rollout_dtype):
            from weightpull.tensors import HostTensorAdapter

            return HostTensorAdapter().describe(name, value, rollout_dtype)

        async def write(self, items, region):
            view = region.host_view()
            view[:10] = b"\xff" * 10  # a partial write, then the failure
            raise RuntimeError("device lost")

        async def fence(self):
            pass

    pub = world.publisher(num_slots=2)
    good = await pub.publish(1, host_tensors(1))
    pub.adapter = Exploding()
    with pytest.raises(PublishError, match="device lost"):
        await pub.publish(2, host_tensors(2))
    assert await states(world) == {1: VersionState.READY, 2: VersionState.ABORTED}
    assert (await world.registry.newest()) == good.manifest
    pulled = await world.puller().pull()
    assert pulled.version == 1 and bytes(pulled.view("t0")) == host_tensors(1)["t0"].data
    pub.adapter = None  # the aborted slot is reclaimed and reused
    assert (await pub.publish(3, host_tensors(3))).slot == 1
    assert await states(world) == {1: VersionState.RETIRED, 3: VersionState.READY}


async def test_cancelled_publish_is_aborted(world):
    class Stuck:
        def describe(self, name, value, rollout_dtype):
            from weightpull.tensors import HostTensorAdapter

            return HostTensorAdapter().describe(name, value, rollout_dtype)

        async def write(self, items, region):
            await anyio.sleep_forever()

        async def fence(self):
            pass

    pub = world.publisher(adapter=Stuck())
    with anyio.move_on_after(0.05):
        await pub.publish(1, host_tensors(1))
    assert await states(world) == {1: VersionState.ABORTED}
    assert all(s.state is SlotState.FREE for s in pub.slots)


async def test_layout_change_reregisters_only_a_slot_too_small(world):
    pub = world.publisher(num_slots=2)
    await pub.publish(1, host_tensors(1, sizes=(100,)))
    await pub.publish(2, host_tensors(2, sizes=(100,)))
    small = pub.slots[0].region
    r = await pub.publish(3, host_tensors(3, sizes=(100, 9000)))
    assert r.slot == 0 and pub.slots[0].region is not small
    assert r.manifest.layout.signature != (await world.registry.get(2)).layout.signature


async def test_bad_configuration_is_named(world):
    with pytest.raises(InvalidArgumentError, match="num_slots"):
        world.publisher(num_slots=1)
    with pytest.raises(InvalidArgumentError, match="when_full"):
        world.publisher(when_full="sometimes")
    with pytest.raises(InvalidArgumentError, match="rollout"):
        world.publisher(rollout_dtype="float13")
    pub = world.publisher()
    with pytest.raises(InvalidArgumentError, match="at least one"):
        await pub.publish(1, {})
    with pytest.raises(InvalidArgumentError, match="cannot publish"):
        await pub.publish(1, {"w": [1, 2, 3]})
    with pytest.raises(InvalidArgumentError, match="needs 8 bytes"):
        HostTensor("float32", (2,), b"1234")


async def test_host_tensors_refuse_a_cast_they_cannot_do(world):
    pub = world.publisher(rollout_dtype="bfloat16")
    with pytest.raises(InvalidArgumentError, match="needs torch"):
        await pub.publish(1, {"w": HostTensor("float32", (1,), b"\0\0\0\0")})
    assert await world.registry.newest() is None


async def test_concurrent_publishes_take_turns(world):
    pub = world.publisher(num_slots=2)
    async with anyio.create_task_group() as tg:
        for v in (1, 2, 3):
            tg.start_soon(pub.publish, v, host_tensors(v))
    assert (await world.registry.newest()).version == 3
    assert await states(world) == {2: VersionState.RETIRED, 3: VersionState.READY}


class Progressing(WrappedTransport):
    """A transport whose reads would need the owner's progress: `serve` loops until
    cancelled (as nixl's does), counting its rounds, or fails after `fail_after` rounds."""

    def __init__(self, inner, fail_after=None):
        super().__init__(inner)
        self.rounds, self.fail_after, self.stopped = 0, fail_after, False

    async def serve(self):
        try:
            while True:
                self.rounds += 1
                if self.fail_after is not None and self.rounds > self.fail_after:
                    raise TransportError("progress failed")
                await anyio.sleep(0.001)
        finally:
            self.stopped = True


async def test_a_publisher_as_context_manager_serves_its_transport_until_exit(world):
    transport = Progressing(world.transport())
    async with Publisher(world.registry, transport, rollout_dtype=None) as pub:
        result = await pub.publish(1, host_tensors(1))
        await anyio.sleep(0.02)
        assert transport.rounds > 1 and not transport.stopped
    assert transport.stopped
    assert all(slot.region is None for slot in pub.slots)  # what it registered, it deregistered
    assert result.manifest is not None and not transport.inner._mine


async def test_the_blocks_own_error_leaves_the_publisher_unwrapped(world):
    transport = Progressing(world.transport())
    with pytest.raises(ValueError, match="the trainer's"):
        async with Publisher(world.registry, transport) as pub:
            await pub.publish(1, host_tensors(1))
            raise ValueError("the trainer's own failure")
    assert transport.stopped and all(slot.region is None for slot in pub.slots)


async def test_a_failure_to_serve_ends_the_block_with_its_error(world):
    transport = Progressing(world.transport(), fail_after=3)
    with pytest.raises(TransportError, match="progress failed"):
        async with Publisher(world.registry, transport):
            await anyio.sleep(10)  # cancelled: replicas could not read, so the trainer hears of it


async def test_outer_cancellation_of_the_block_stops_serving(world):
    transport = Progressing(world.transport())
    with anyio.move_on_after(0.02) as scope:
        async with Publisher(world.registry, transport):
            await anyio.sleep(10)
    assert scope.cancelled_caught and transport.stopped


async def test_a_publisher_is_entered_once_at_a_time(world):
    async with world.publisher() as pub:
        with pytest.raises(InvalidArgumentError, match="already in use"):
            async with pub:
                pass
