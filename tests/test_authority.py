"""Who may do what at the registry, and what a principal's lapse ends: the rules of
`RegistryMachine`, tried through `InProcessRegistry.as_principal` on a fake clock (the
served registry runs the same machine: tests/test_registry_auth.py tries them over the
wire)."""

import logging

import pytest

from weightpull import (
    FakeClock,
    InProcessRegistry,
    InvalidArgumentError,
    Manifest,
    NoReadyVersionError,
    Publisher,
    PublishError,
    Puller,
    VersionState,
)
from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.errors import PermissionDeniedError, VersionStateError
from weightpull.layout import TensorSpec, plan_layout
from weightpull.principals import Principal, root
from weightpull.registry_machine import MAX_HELD_VERSIONS

from .conftest import host_tensors

pytestmark = pytest.mark.anyio

LAYOUT = plan_layout([TensorSpec("w", "uint8", (64,))])
TTL = 10.0


def manifest(version: int, slot: int, publisher: str) -> Manifest:
    return Manifest(version, LAYOUT, "fake", b"src", slot, publisher)


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def reg(clock):
    return InProcessRegistry(clock, liveness_ttl=TTL)


@pytest.fixture
def trainer(reg):
    return reg.as_principal(Principal.publisher("trainer"))


@pytest.fixture
def rogue(reg):
    return reg.as_principal(Principal.publisher("rogue"))


@pytest.fixture
def replica(reg):
    return reg.as_principal(Principal.reader("replica-0"))


@pytest.fixture
def other_replica(reg):
    return reg.as_principal(Principal.reader("replica-1"))


async def publish(registry, version, slot, publisher="trainer"):
    given = await registry.begin(version, publisher=publisher, slot=slot)
    await registry.commit(manifest(given, slot, publisher))
    return given


def test_a_principal_owns_its_name_and_the_names_below_it():
    p = Principal.publisher("trainer")
    assert p.owns("trainer") and p.owns("trainer/rank3")
    assert not p.owns("trainer-evil") and not p.owns("trainerx/rank0") and not p.owns("other")
    assert Principal.admin().owns("anything")
    assert root("trainer/rank3") == "trainer"
    for bad in ("", "a/b", "-x", "x" * 65, "sp ace", 7):
        with pytest.raises(InvalidArgumentError, match="principal's name"):
            Principal.reader(bad)
    with pytest.raises(ValueError):
        Principal("superuser", "x")
    assert Principal.from_dict(Principal.reader("r").to_dict()) == Principal.reader("r")


async def test_a_reader_cannot_begin_or_end_versions(trainer, replica):
    await publish(trainer, 1, 0)
    for attempt in (
        replica.begin(2, publisher="replica-0", slot=0),
        replica.commit(manifest(1, 0, "trainer")),
        replica.abort(1),
        replica.retire(1),
        replica.reclaim(1),
        replica.abort(9, shard=(0, 2)),
    ):
        with pytest.raises(PermissionDeniedError, match="readers cannot begin or end versions"):
            await attempt
    assert (await replica.newest()).version == 1


async def test_a_publisher_acts_only_on_its_own_versions(trainer, rogue, reg):
    await publish(trainer, 1, 0)
    await trainer.begin(2, publisher="trainer", slot=1)
    refused = {
        "retire": rogue.retire(1),
        "reclaim": rogue.reclaim(1),
        "abort": rogue.abort(2, "hostile"),
        "commit": rogue.commit(manifest(2, 1, "trainer")),
    }
    for op, attempt in refused.items():
        with pytest.raises(
            PermissionDeniedError, match=f"publisher rogue may not {op} .*belongs to publisher 'trainer'"
        ):
            await attempt
    with pytest.raises(PermissionDeniedError, match="writes only under its own name"):
        await rogue.begin(3, publisher="trainer", slot=5)
    with pytest.raises(PermissionDeniedError, match="writes only under its own name"):
        await rogue.begin(3, publisher="trainer/rank0", slot=5)
    await trainer.commit(manifest(2, 1, "trainer"))
    states = {v.version: v.state for v in (await reg.status()).versions}
    assert states == {1: VersionState.RETIRED, 2: VersionState.READY}


async def test_no_other_principal_can_make_a_publishers_next_version_fail(trainer, rogue):
    await publish(trainer, 5, 0)
    # The rogue takes a number the trainer will ask, then races far ahead: its numbers are
    # its own line's, and the trainer's go on, skipping only the one number it holds.
    assert await rogue.begin(7, publisher="rogue", slot=1) == 7
    assert await rogue.begin(1_000_000, publisher="rogue", slot=0) == 1_000_000
    assert await publish(trainer, 6, 1) == 6
    given = await publish(trainer, 7, 2)
    assert given == 8
    assert (await trainer.newest(publisher="trainer")).version == given
    with pytest.raises(InvalidArgumentError, match="past the next"):  # its own line cannot jump far either
        await rogue.begin(2**62, publisher="rogue", slot=2)


async def test_no_principal_can_hold_more_than_its_share_of_the_numbers(trainer, rogue):
    """The numbers another can take from a line are the versions it holds, and those
    are bounded: squatting the numbers a trainer will ask costs a version each."""
    for slot in range(MAX_HELD_VERSIONS):
        await rogue.begin(100 + slot, publisher="rogue", slot=slot)
    with pytest.raises(InvalidArgumentError, match="versions not reclaimed"):
        await rogue.begin(None, publisher="rogue", slot=MAX_HELD_VERSIONS)
    assert await publish(trainer, 100, 0) == 100 + MAX_HELD_VERSIONS  # skips what it holds, no more


async def test_the_shards_of_one_publisher_find_each_other_by_the_number_they_ask(trainer, rogue):
    await rogue.begin(7, publisher="rogue", slot=0)  # takes 7 first
    a = await trainer.begin(7, publisher="trainer/rank0", slot=0, shard=(0, 2))
    b = await trainer.begin(7, publisher="trainer/rank1", slot=0, shard=(1, 2))
    assert a == b == 8
    # A shard that gives up before its siblings begin aborts by the number asked too.
    await trainer.abort(9, "rank 0 failed to snapshot", shard=(0, 2))
    with pytest.raises(VersionStateError, match="ABORTED"):
        await trainer.begin(9, publisher="trainer/rank1", slot=1, shard=(1, 2))


async def test_leases_and_serving_reports_are_their_holders_own(trainer, replica, other_replica, reg):
    await publish(trainer, 1, 0)
    lease = await replica.acquire(ttl=5, holder="replica-0/mirror0")
    status = await other_replica.status()  # anyone reads status, lease ids included
    assert status.leases[0].id == lease.id
    for op in ("renew", "release"):
        with pytest.raises(PermissionDeniedError, match="held by 'replica-0/mirror0'"):
            await getattr(other_replica, op)(lease)
    with pytest.raises(PermissionDeniedError, match="under its own names"):
        await other_replica.acquire(ttl=5, holder="replica-0")
    with pytest.raises(PermissionDeniedError, match="what it serves itself"):
        await other_replica.report_serving("replica-0", 1)
    assert await replica.is_valid(lease)
    await replica.renew(lease)
    await replica.report_serving("replica-0", 1)
    await reg.release(lease)  # an admin may act for anyone
    assert not await replica.is_valid(lease)


async def test_every_refusal_is_logged(rogue, caplog):
    with caplog.at_level(logging.WARNING, logger="weightpull.registry"):
        with pytest.raises(PermissionDeniedError):
            await rogue.begin(1, publisher="trainer", slot=0)
    assert "refused begin of a version as 'trainer' by publisher rogue" in caplog.text


async def test_a_lapsed_publishers_versions_end_with_the_reason(trainer, replica, clock, reg):
    await publish(trainer, 1, 0)
    await publish(trainer, 2, 1)
    await trainer.begin(3, publisher="trainer", slot=0 + 2)
    clock.advance(TTL / 2)
    await trainer.keepalive()  # its heartbeat
    clock.advance(TTL / 2 + 1)
    assert (await replica.newest()).version == 2  # still alive: last heard TTL/2 + 1 ago
    clock.advance(TTL)
    status = await replica.status()
    states = {v.version: (v.state, v.reason) for v in status.versions}
    assert states[2][0] is VersionState.RETIRED and "withdrawn: publisher 'trainer' lapsed" in states[2][1]
    assert states[3][0] is VersionState.ABORTED and "lapsed" in states[3][1]
    assert status.newest_ready is None and status.alive["trainer"] <= 0
    with pytest.raises(NoReadyVersionError, match="v2 was withdrawn: publisher 'trainer' lapsed"):
        await replica.acquire(ttl=5, holder="replica-0")
    # Back under the same name (restarted): numbering goes on, its dead slots are freed.
    assert await publish(trainer, 0, 0) == 4
    assert {v.version for v in (await reg.status()).versions} == {4}
    assert (await replica.acquire(ttl=5, holder="replica-0")).version == 4


async def test_a_lapsed_reader_leaves_serving(trainer, replica, other_replica, clock):
    await publish(trainer, 1, 0)
    await replica.report_serving("replica-0", 1)
    await other_replica.report_serving("replica-1", 1)
    clock.advance(TTL - 1)
    await other_replica.keepalive()
    await trainer.keepalive()
    clock.advance(2)
    assert (await trainer.status()).serving == {"replica-1": 1}


async def test_an_embedded_registry_judges_no_liveness_by_default(clock):
    reg = InProcessRegistry(clock)
    await publish(reg, 1, 0)
    clock.advance(1e6)
    status = await reg.status()
    assert status.newest_ready == 1 and status.alive == {}


# -- the publisher's side ---------------------------------------------------------------


def publisher(reg, clock, fabric, **kw):
    kw.setdefault("rollout_dtype", None)
    return Publisher(reg, FakeTransport(clock=clock, fabric=fabric), clock=clock, **kw)


async def test_a_failed_publish_leaves_an_aborted_record_and_a_publish_error(reg, clock):
    fabric = FakeFabric()
    pub = publisher(reg, clock, fabric)
    await pub.publish(1, host_tensors(1))

    def broken():
        yield "t0", host_tensors(2)["t0"]
        raise RuntimeError("the source ran dry")

    with pytest.raises(PublishError, match="publish of v2 failed") as info:
        await pub.publish(2, broken())
    assert isinstance(info.value.__cause__, RuntimeError)
    status = await reg.status()
    record = {v.version: v for v in status.versions}[2]
    assert record.state is VersionState.ABORTED and "the source ran dry" in record.reason
    assert status.newest_ready == 1
    assert (await pub.publish(3, host_tensors(3))).version == 3


async def test_a_restarted_publisher_continues_under_its_name(trainer, clock):
    fabric = FakeFabric()
    first = publisher(trainer, clock, fabric)
    assert first.name == "trainer"  # a publisher principal's own name, when it gives none
    await first.publish(10, host_tensors(10))
    await first.publish(11, host_tensors(11))
    await trainer.begin(12, publisher="trainer", slot=5)  # it died while writing a version
    second = publisher(trainer, clock, fabric)  # the restarted process: counts from its checkpoint
    result = await second.publish(0, host_tensors(0))
    assert result.version == 13 and result.manifest.step == 0
    states = {v.version: v.state for v in (await trainer.status()).versions}
    assert states[13] is VersionState.READY and states[12] is VersionState.ABORTED


async def test_faces_as_other_principals_share_one_waiting_room(reg, trainer):
    """A face per principal (the server makes one per request) adds no watcher to the
    machine, and a waiter on any face wakes when another face announces."""
    import anyio

    faces = [reg.as_principal(Principal.reader(f"r{i}")) for i in range(100)]
    assert len(reg.machine._watchers) == 1
    got = []

    async def wait():
        got.append((await faces[7].wait_for_version(1, timeout=5)).version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0.01)
        await publish(trainer, 1, 0)
    assert got == [1]


def test_a_puller_and_a_publisher_that_give_no_name_take_one_their_principal_owns(reg):
    replica = reg.as_principal(Principal.reader("replica-3"))
    puller = Puller(replica, FakeTransport())
    assert puller.holder.startswith("replica-3/puller-")
    assert Principal.reader("replica-3").owns(puller.holder)
    assert Puller(reg, FakeTransport()).holder.startswith("puller-")  # an admin's: any name
    assert Publisher(reg.as_principal(Principal.publisher("trainer")), FakeTransport()).name == "trainer"
