"""Slots reserved ahead: a publisher registers its slots before v1 (`Reservation`), and a
puller maps them and sizes its mirror from them (`Puller.prepare`), so that the first
version's pull does nothing a later one does not."""

import logging

import anyio
import pytest

from tests.served import ServedRegistry, make_keys
from weightpull import InvalidArgumentError, PermissionDeniedError, Principal, Publisher, Puller, Role
from weightpull.clock import FakeClock
from weightpull.drivers.fake import FakeTransport
from weightpull.errors import RegionNotRegisteredError
from weightpull.layout import TensorSpec
from weightpull.records import Reservation
from weightpull.registry import InProcessRegistry, ReservingRegistry, connect_registry
from weightpull.registry_machine import MAX_RESERVED_SLOTS, RegistryMachine
from weightpull.rl.agent import UpdateAgent
from weightpull.transport import WrappedTransport

from .conftest import host_tensors

pytestmark = pytest.mark.anyio

TRAINER = Principal(Role.PUBLISHER, "trainer")
REPLICA = Principal(Role.READER, "replica-0")
SPECS = [TensorSpec(f"t{i}", "uint8", (n,)) for i, n in enumerate((1000, 300, 5000))]


def reservation(publisher="trainer", sources=(b"slot-0", b"slot-1"), nbytes=4096):
    return Reservation(publisher, "fake", tuple(sources), nbytes)


# -- the registry's rules ------------------------------------------------------------------


def test_a_publisher_reserves_and_readers_see_it():
    m = RegistryMachine(FakeClock())
    m.reserve(reservation(), by=TRAINER)
    m.reserve(reservation("trainer/rank1", (b"slot-2",)), by=TRAINER)  # its ranks are it
    assert [r.publisher for r in m.reservations(by=REPLICA)] == ["trainer", "trainer/rank1"]
    m.reserve(reservation(sources=(b"slot-9",), nbytes=8192), by=TRAINER)  # a newer one replaces it
    assert m.reservations(by=REPLICA)[0] == reservation(sources=(b"slot-9",), nbytes=8192)


@pytest.mark.parametrize(
    ("by", "publisher"),
    [(REPLICA, "replica-0"), (TRAINER, "other"), (Principal(Role.PUBLISHER, "other"), "trainer")],
)
def test_only_a_publisher_reserves_and_only_under_its_own_name(by, publisher):
    m = RegistryMachine(FakeClock())
    with pytest.raises(PermissionDeniedError):
        m.reserve(reservation(publisher), by=by)
    assert m.reservations() == ()


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        (reservation(sources=()), "1 to 64 slots"),
        (reservation(sources=[b"x"] * (MAX_RESERVED_SLOTS + 1)), "1 to 64 slots"),
        (reservation(nbytes=-1), "nbytes"),
        (reservation(publisher=""), "publisher"),
        ({"publisher": "trainer"}, "Reservation"),
    ],
)
def test_bad_reservations_are_refused_by_name(bad, says):
    m = RegistryMachine(FakeClock())
    with pytest.raises(InvalidArgumentError, match=says):
        m.reserve(bad, by=TRAINER)
    assert m.reservations() == ()


def test_a_lapsed_publishers_reservations_go_with_it():
    clock = FakeClock()
    m = RegistryMachine(clock, liveness_ttl=5.0)
    m.reserve(reservation(), by=TRAINER)
    m.reserve(reservation("trainer/rank1"), by=TRAINER)
    m.reserve(reservation("other"), by=Principal(Role.PUBLISHER, "other"))
    clock.advance(3.0)
    m.keepalive(by=Principal(Role.PUBLISHER, "other"))
    clock.advance(3.0)  # the trainer was last heard 6 s ago: its slots are gone
    assert [r.publisher for r in m.reservations(by=REPLICA)] == ["other"]


async def test_a_served_registry_carries_reservations(tmp_path):
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "replica-0"))
    served = ServedRegistry(tmp_path, keys=keys)
    served.start()
    try:
        trainer = connect_registry(served.address, **served.key("trainer"))
        replica = connect_registry(served.address, **served.key("replica-0"))
        async with trainer, replica:
            assert isinstance(trainer, ReservingRegistry)
            await trainer.reserve(reservation(sources=(b"\x00\xff" * 40,)))
            assert await replica.reservations() == (reservation(sources=(b"\x00\xff" * 40,)),)
            with pytest.raises(PermissionDeniedError):  # typed across the wire
                await replica.reserve(reservation("replica-0"))
    finally:
        served.stop()


# -- publisher and puller ------------------------------------------------------------------


class Counting(WrappedTransport):
    """The fake driver, counting what a puller asks of it; `broken` fails each prepare."""

    def __init__(self, inner, broken=False):
        super().__init__(inner)
        self.calls = {"connect": 0, "prepare": 0, "allocate": 0}
        self.broken = broken

    def connect(self, descriptor):
        self.calls["connect"] += 1
        return super().connect(descriptor)

    def prepare(self, remote, device="cpu"):
        self.calls["prepare"] += 1
        if self.broken:
            raise RegionNotRegisteredError("that slot's owner is gone")
        super().prepare(remote, device)

    def allocate(self, nbytes, device="cpu"):
        self.calls["allocate"] += 1
        return super().allocate(nbytes, device)


async def test_prepare_maps_every_reserved_slot_and_the_first_pull_does_nothing_more():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, num_slots=3)
    await publisher.reserve(SPECS)
    (reserved,) = await registry.reservations()
    assert len(reserved.sources) == 3 and reserved.nbytes == publisher._plan(SPECS, None)[0].total_bytes
    transport = Counting(FakeTransport())
    puller = Puller(registry, transport, holder="replica-0")
    assert puller.mirror is None
    assert await puller.prepare() == 3
    assert transport.calls == {"connect": 3, "prepare": 3, "allocate": 1}
    mirror = puller.mirror
    assert mirror is not None and mirror.nbytes == reserved.nbytes

    await publisher.publish(1, host_tensors(1))
    pulled = await puller.pull()
    assert pulled.version == 1 and puller.mirror is mirror  # the mirror made ahead, not a new one
    assert transport.calls == {"connect": 3, "prepare": 3, "allocate": 1}  # and no new connection
    assert bytes(pulled.region.host_view()[: pulled.layout.total_bytes]) == bytes(
        publisher.slots[0].region.host_view()[: pulled.layout.total_bytes]
    )


async def test_prepare_without_reservations_does_nothing_and_a_later_call_finds_them():
    registry = InProcessRegistry()
    transport = Counting(FakeTransport())
    puller = Puller(registry, transport, holder="replica-0")
    assert await puller.prepare() == 0
    assert puller.mirror is None and transport.calls["connect"] == 0
    await Publisher(registry, FakeTransport(), rollout_dtype=None).reserve(SPECS)
    assert await puller.prepare() == 2


async def test_prepare_ignores_slots_over_another_transport():
    registry = InProcessRegistry()
    await registry.reserve(Reservation("trainer", "nixl", (b"elsewhere",), 4096))
    transport = Counting(FakeTransport())
    assert await Puller(registry, transport, holder="replica-0").prepare() == 0
    assert transport.calls["connect"] == 0


async def test_a_slot_that_cannot_be_mapped_is_logged_and_left_to_the_pull(caplog):
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None)
    await publisher.reserve(SPECS)
    puller = Puller(registry, Counting(FakeTransport(), broken=True), holder="replica-0")
    with caplog.at_level(logging.WARNING):
        assert await puller.prepare() == 0
    assert "could not map a reserved slot ahead" in caplog.text and "owner is gone" in caplog.text
    await publisher.publish(1, host_tensors(1))
    assert (await puller.pull()).version == 1  # the pull does what prepare could not


async def test_a_sharded_reservation_by_bytes_leaves_the_mirror_size_unknown():
    from weightpull.sharding import Sharding

    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None)
    await publisher.reserve(4096, shard=Sharding(0, 2, {}, {}))
    (reserved,) = await registry.reservations()
    assert reserved.nbytes == 0  # a shard's slot size is not the version's
    puller = Puller(registry, FakeTransport(), holder="replica-0")
    assert await puller.prepare() == 2 and puller.mirror is None


# -- the update agent ----------------------------------------------------------------------


class Engine:
    def __init__(self, fail=False):
        self.prepared = 0
        self.fail = fail
        self.applied = []

    async def prepare(self):
        self.prepared += 1
        if self.fail:
            raise RegionNotRegisteredError("gone")

    async def prefetch(self, version):
        pass

    async def pause(self, mode):
        pass

    async def apply(self, version):
        self.applied.append(version)

    async def label(self, version):
        pass

    async def resume(self):
        pass


@pytest.mark.parametrize("fail", [False, True])
async def test_the_agent_prepares_its_engine_once_before_the_first_version(fail):
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None)
    engine = Engine(fail=fail)
    agent = UpdateAgent("replica-0", registry, engine)
    async with anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        await publisher.publish(1, host_tensors(1))
        await agent.wait_for_version(1, timeout=5)
        await publisher.publish(2, host_tensors(2))
        await agent.wait_for_version(2, timeout=5)
        tg.cancel_scope.cancel()
    assert engine.prepared == 1 and engine.applied == [1, 2]
