import anyio
import pytest

from weightpull import (
    FakeClock,
    InProcessRegistry,
    InvalidArgumentError,
    LeaseExpiredError,
    Manifest,
    NoReadyVersionError,
    VersionState,
    VersionWaitTimeoutError,
    plan_layout,
)
from weightpull.errors import (
    InvalidTransitionError,
    VersionInUseError,
    VersionNotFoundError,
    VersionOrderError,
    VersionStateError,
)
from weightpull.layout import TensorSpec

from .conftest import autojump

pytestmark = pytest.mark.anyio

LAYOUT = plan_layout([TensorSpec("w", "uint8", (16,))])


def manifest(version, slot=0, publisher="pub"):
    return Manifest(version, LAYOUT, "fake", b"desc", slot, publisher)


async def publish(reg, version, slot=None):
    slot = version % 4 if slot is None else slot
    await reg.begin(version, publisher="pub", slot=slot)
    await reg.commit(manifest(version, slot))


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def reg(clock):
    return InProcessRegistry(clock)


async def states(reg):
    return {v.version: v.state for v in (await reg.status()).versions}


async def test_publish_makes_the_newest_ready_and_retires_the_previous(reg):
    assert await reg.newest() is None
    await publish(reg, 1)
    await publish(reg, 2)
    assert (await reg.newest()).version == 2
    assert await states(reg) == {1: VersionState.RETIRED, 2: VersionState.READY}
    assert (await reg.get(1)).version == 1


async def test_the_registry_numbers_versions_giving_the_number_asked_while_it_is_free(reg):
    await publish(reg, 5)
    # A number already passed (a restarted trainer counting from its start again, or
    # another publisher's versions) gets the next free one, never an error.
    assert await reg.begin(5, publisher="pub", slot=10) == 6
    assert await reg.begin(3, publisher="pub", slot=11) == 7
    assert await reg.begin(None, publisher="pub", slot=12) == 8
    assert await reg.begin(20, publisher="pub", slot=13) == 20
    for v in (6, 7, 8, 20):
        await reg.abort(v)


async def test_versions_are_announced_in_order(reg):
    await publish(reg, 5)
    await reg.begin(6, publisher="pub", slot=2)
    await reg.begin(7, publisher="pub", slot=0)
    await reg.commit(manifest(7, 0))
    with pytest.raises(VersionOrderError, match="after 7 of 'pub'"):  # 6 would be announced after 7
        await reg.commit(manifest(6, 2))


async def test_another_publishers_announcements_do_not_order_a_line(reg):
    """Each publisher's versions are a line of their own: another's newer number neither
    bars this one's commit nor retires its newest READY."""
    await publish(reg, 5)
    await reg.begin(6, publisher="pub", slot=2)
    assert await reg.begin(7, publisher="pub2", slot=0) == 7
    await reg.commit(manifest(7, 0, "pub2"))
    await reg.commit(manifest(6, 2))
    assert await states(reg) == {5: VersionState.RETIRED, 6: VersionState.READY, 7: VersionState.READY}
    assert (await reg.newest(publisher="pub")).version == 6
    assert (await reg.newest(publisher="pub2")).version == 7
    assert (await reg.newest()).version == 6  # the default line: the one that announced last


async def test_a_withdrawn_version_still_bars_older_ones(reg):
    """Regression (found by fuzz/test_concurrent.py, two trainers): once the newest READY
    was withdrawn, an older version still WRITING could be announced after it, and
    readers that had applied v7 were offered v6 as the newest. (Within one line: each
    publisher's versions are ordered among themselves.)"""
    await reg.begin(6, publisher="pub", slot=0)
    await reg.begin(7, publisher="pub", slot=1)
    await reg.commit(manifest(7, 1))
    await reg.retire(7)
    with pytest.raises(VersionOrderError, match="after 7"):
        await reg.commit(manifest(6, 0))
    assert await reg.newest() is None


async def test_a_failed_publish_ends_aborted_and_keeps_the_previous_ready(reg):
    await publish(reg, 1)
    await reg.begin(2, publisher="pub", slot=2)
    await reg.abort(2, reason="copy failed")
    assert (await reg.newest()).version == 1
    assert await states(reg) == {1: VersionState.READY, 2: VersionState.ABORTED}
    lease = await reg.acquire(ttl=1, holder="r")
    assert lease.version == 1
    with pytest.raises(VersionStateError, match="ABORTED"):
        await reg.get(2)


async def test_aborted_slot_must_be_reclaimed_before_reuse(reg):
    await reg.begin(1, publisher="pub", slot=0)
    await reg.abort(1)
    with pytest.raises(VersionInUseError, match="slot 0"):
        await reg.begin(2, publisher="pub", slot=0)
    await reg.reclaim(1)
    await reg.begin(2, publisher="pub", slot=0)


async def test_leases_expire_on_the_registry_clock(reg, clock):
    await publish(reg, 1)
    lease = await reg.acquire(ttl=10, holder="r")
    assert lease.expires_at == 10
    clock.advance(9.9)
    assert await reg.is_valid(lease)
    renewed = await reg.renew(lease)
    assert renewed.expires_at == pytest.approx(19.9)
    clock.advance(9.9)
    assert await reg.is_valid(renewed)
    clock.advance(0.1)
    assert not await reg.is_valid(renewed)
    with pytest.raises(LeaseExpiredError):
        await reg.renew(renewed)


async def test_release_is_idempotent_and_renew_after_release_is_illegal(reg):
    await publish(reg, 1)
    lease = await reg.acquire(ttl=10, holder="r")
    await reg.release(lease)
    await reg.release(lease)
    assert not await reg.is_valid(lease)
    with pytest.raises(InvalidTransitionError, match="RELEASED"):
        await reg.renew(lease)


async def test_retired_versions_take_no_new_leases_but_keep_old_ones(reg, clock):
    await publish(reg, 1)
    held = await reg.acquire(1, ttl=10, holder="slow")
    await publish(reg, 2)
    with pytest.raises(VersionStateError, match="RETIRED"):
        await reg.acquire(1, ttl=10, holder="late")
    assert await reg.is_valid(held)
    assert (await reg.renew(held)).version == 1


async def test_reclaim_waits_for_leases_and_never_takes_the_newest(reg, clock):
    await publish(reg, 1)
    await reg.acquire(ttl=5, holder="reader-a")
    await publish(reg, 2)
    with pytest.raises(VersionInUseError, match="reader-a"):
        await reg.reclaim(1)
    clock.advance(5)  # the lease lapses: nobody can rely on v1 any more
    await reg.reclaim(1)
    with pytest.raises(VersionNotFoundError):
        await reg.get(1)
    with pytest.raises(VersionInUseError, match="READY"):
        await reg.reclaim(2)
    with pytest.raises(InvalidTransitionError):
        await reg.begin(3, publisher="pub", slot=3)
        await reg.reclaim(3)  # WRITING cannot be reclaimed


async def test_released_lease_frees_the_version_at_once(reg):
    await publish(reg, 1)
    lease = await reg.acquire(ttl=60, holder="r")
    await publish(reg, 2)
    await reg.release(lease)
    await reg.reclaim(1)


async def test_retire_withdraws_the_newest(reg):
    await publish(reg, 1)
    await reg.retire(1)
    assert await reg.newest() is None
    with pytest.raises(NoReadyVersionError):
        await reg.acquire(ttl=1, holder="r")
    await reg.reclaim(1)


async def test_acquire_validates_its_arguments(reg):
    await publish(reg, 1)
    with pytest.raises(InvalidArgumentError, match="ttl"):
        await reg.acquire(ttl=0, holder="r")
    with pytest.raises(InvalidArgumentError, match="ttl"):
        await reg.acquire(ttl=10_000, holder="r")
    with pytest.raises(InvalidArgumentError, match="holder"):
        await reg.acquire(ttl=1, holder="")
    with pytest.raises(VersionNotFoundError):
        await reg.acquire(9, ttl=1, holder="r")
    with pytest.raises(InvalidArgumentError, match="version"):
        await reg.begin(-1, publisher="p", slot=0)


async def test_commit_must_match_the_begin(reg):
    await reg.begin(1, publisher="pub", slot=0)
    with pytest.raises(InvalidArgumentError, match="begun by"):
        await reg.commit(manifest(1, slot=1))


async def test_wait_for_version(reg, clock):
    got = []

    async def waiter():
        got.append((await reg.wait_for_version(2)).version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(waiter)
        await publish(reg, 1)
        await anyio.wait_all_tasks_blocked()
        assert got == []
        await publish(reg, 3)
    assert got == [3]
    async with autojump(clock):
        with pytest.raises(VersionWaitTimeoutError, match=">= 4"):
            await reg.wait_for_version(4, timeout=2.5)
    assert clock.now() == 2.5


async def test_status_reports_versions_leases_and_serving(reg, clock):
    await publish(reg, 1)
    clock.advance(3)
    await reg.acquire(ttl=10, holder="replica-a")
    await reg.report_serving("replica-a", 1)
    status = await reg.status()
    assert status.newest_ready == 1
    (info,) = status.versions
    assert (info.state, info.age, info.live_leases, info.nbytes) == (VersionState.READY, 3, 1, LAYOUT.total_bytes)
    assert [(x.holder, x.expires_in) for x in status.leases] == [("replica-a", 10)]
    assert status.serving == {"replica-a": 1}


async def test_ended_leases_are_pruned(reg):
    await publish(reg, 1)
    for _ in range(600):
        await reg.release(await reg.acquire(ttl=1, holder="r"))
    assert len(reg.machine._versions[1].leases) <= 257


def test_a_ray_address_names_a_registry_in_a_ray_actor():
    from weightpull.registry import connect_registry

    registry = connect_registry("ray://weights")
    assert type(registry).__name__ == "RayRegistry"  # what it does with Ray: tests/verl
