"""The registry's decisions, driven as plain calls on a fake clock: no event loop at all."""

from __future__ import annotations

import pytest

from weightpull import (
    FakeClock,
    InvalidArgumentError,
    LeaseExpiredError,
    Manifest,
    NoReadyVersionError,
    TensorSpec,
    VersionState,
    plan_layout,
)
from weightpull.errors import (
    InvalidTransitionError,
    LeaseNotFoundError,
    VersionInUseError,
    VersionNotFoundError,
    VersionStateError,
)
from weightpull.registry import InProcessRegistry, RegistryMachine
from weightpull.sharding import Shard

LAYOUT = plan_layout([TensorSpec("w", "uint8", (4,))])
ROWS = {0: (0, 2), 1: (2, 4)}  # two shards of the one tensor's rows


def manifest(version, slot=0, publisher="pub"):
    return Manifest(version, LAYOUT, "fake", b"desc", slot, publisher)


def shard_manifest(version, index, rows=None):
    shard = Shard(index, 2, f"rank{index}", 0, b"desc", [rows or ROWS[index]])
    return Manifest(version, LAYOUT, "fake", b"desc", 0, f"rank{index}", None, (shard,))


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def m(clock):
    return RegistryMachine(clock, max_ttl=60.0)


def publish(m, version, slot=None):
    slot = version % 4 if slot is None else slot
    m.begin(version, publisher="pub", slot=slot)
    m.commit(manifest(version, slot))


def states(m):
    return {v.version: v.state for v in m.status().versions}


def test_its_methods_are_plain_calls():
    import inspect

    for name, fn in inspect.getmembers(RegistryMachine, inspect.isfunction):
        assert not inspect.iscoroutinefunction(fn), name


def test_a_commit_makes_the_newest_ready_and_retires_the_previous(m):
    assert m.newest() is None and m.newest_ready is None
    publish(m, 1)
    publish(m, 2)
    assert m.newest().version == 2 and m.newest_ready == 2
    assert states(m) == {1: VersionState.RETIRED, 2: VersionState.READY}


def test_versions_only_go_up_and_a_slot_waits_for_its_reclaim(m):
    publish(m, 2, slot=0)
    assert m.begin(2, publisher="pub", slot=1) == 3  # 2 is taken: the next free number
    with pytest.raises(VersionInUseError, match="slot 0 of 'pub' still holds version 2"):
        m.begin(3, publisher="pub", slot=0)


def test_a_lease_holds_its_version_until_the_clock_passes_its_ttl(m, clock):
    publish(m, 1)
    lease = m.acquire(ttl=10.0, holder="reader")
    publish(m, 2)
    with pytest.raises(VersionInUseError, match="leased by reader"):
        m.reclaim(1)
    clock.advance(9.0)
    assert m.is_valid(lease)
    clock.advance(1.0)
    assert not m.is_valid(lease)
    with pytest.raises(LeaseExpiredError):
        m.renew(lease)
    m.reclaim(1)
    assert 1 not in states(m)
    with pytest.raises(LeaseNotFoundError):
        m.renew(lease)


def test_renew_extends_from_now_and_release_is_idempotent(m, clock):
    publish(m, 1)
    lease = m.acquire(ttl=10.0, holder="reader")
    clock.advance(8.0)
    assert m.renew(lease).expires_at == 18.0
    m.release(lease)
    m.release(lease)
    assert not m.is_valid(lease)
    with pytest.raises(InvalidTransitionError, match="RELEASED"):
        m.renew(lease)


def test_acquire_refuses_what_it_cannot_lease(m):
    with pytest.raises(NoReadyVersionError):
        m.acquire(ttl=1.0, holder="reader")
    publish(m, 1)
    with pytest.raises(InvalidArgumentError, match="ttl"):
        m.acquire(ttl=61.0, holder="reader")
    publish(m, 2)
    with pytest.raises(VersionStateError, match="RETIRED"):
        m.acquire(1, ttl=1.0, holder="reader")
    with pytest.raises(VersionNotFoundError):
        m.acquire(7, ttl=1.0, holder="reader")


def test_the_newest_ready_is_never_reclaimed(m):
    publish(m, 1)
    with pytest.raises(VersionInUseError, match="READY; retire it first"):
        m.reclaim(1)
    m.retire(1)
    assert m.newest() is None
    m.reclaim(1)


def test_an_aborted_version_frees_its_slot_once_reclaimed(m):
    publish(m, 1, slot=0)
    m.begin(2, publisher="pub", slot=1)
    m.abort(2, "disk full")
    assert m.newest().version == 1
    assert {v.version: v.reason for v in m.status().versions}[2] == "disk full"
    m.reclaim(2)
    m.begin(3, publisher="pub", slot=1)


def test_status_reads_ages_and_leases_on_the_clock(m, clock):
    publish(m, 1)
    clock.advance(5.0)
    m.acquire(ttl=10.0, holder="reader")
    m.report_serving("replica-0", 1)
    clock.advance(2.0)
    status = m.status()
    (info,) = status.versions
    (lease,) = status.leases
    assert (info.age, info.live_leases, lease.expires_in) == (7.0, 1, 8.0)
    assert status.serving == {"replica-0": 1} and status.newest_ready == 1


def test_watchers_hear_each_change_a_waiter_waits_on_and_nothing_else(m):
    heard = []
    m.watch(lambda: heard.append(m.newest_ready))
    m.begin(1, publisher="pub", slot=0)
    m.begin(2, publisher="pub", slot=1)
    assert heard == []  # nothing to wait for in a begin
    m.abort(2)  # a stream's readers wait on its end
    assert heard == [None]
    m.commit(manifest(1, 0))
    assert heard == [None, 1]


def test_two_faces_on_one_machine_see_one_state(clock):
    """The served registry drives the machine under an InProcessRegistry's waiters."""
    registry = InProcessRegistry(clock)
    publish(registry.machine, 1)
    assert registry.machine.newest().version == 1
    assert registry.max_ttl == registry.machine.max_ttl


# -- shard assembly ----------------------------------------------------------------------


def begin_shards(m, version, shards=(0, 1)):
    for i in shards:
        m.begin(version, publisher=f"rank{i}", slot=0, shard=(i, 2))


def test_a_sharded_version_turns_ready_at_its_last_shard_as_one_manifest(m):
    begin_shards(m, 1)
    m.commit(shard_manifest(1, 1))
    assert states(m) == {1: VersionState.WRITING} and m.newest() is None
    with pytest.raises(VersionInUseError, match=r"shards \[0\] have not committed"):
        m.reclaim(1)
    m.commit(shard_manifest(1, 0))
    whole = m.newest()
    assert [s.index for s in whole.shards] == [0, 1] and whole.publisher == "rank0"


def test_a_shard_cannot_join_twice_or_commit_twice(m):
    begin_shards(m, 1, shards=(0,))
    with pytest.raises(InvalidArgumentError, match=r"of which \[0\] began"):
        m.begin(1, publisher="rank9", slot=3, shard=(0, 2))
    with pytest.raises(InvalidArgumentError, match="it has 2 shards"):
        m.begin(1, publisher="rank1", slot=0, shard=(1, 3))
    m.commit(shard_manifest(1, 0))
    with pytest.raises(InvalidArgumentError, match="already committed"):
        m.commit(shard_manifest(1, 0))
    with pytest.raises(InvalidArgumentError, match="was not begun"):
        m.commit(shard_manifest(1, 1))


def test_shards_that_do_not_tile_abort_the_version(m):
    begin_shards(m, 1)
    m.commit(shard_manifest(1, 0, rows=(0, 2)))
    with pytest.raises(InvalidArgumentError):
        m.commit(shard_manifest(1, 1, rows=(3, 4)))
    assert states(m) == {1: VersionState.ABORTED}


def test_an_abort_before_any_begin_refuses_the_siblings(m):
    m.abort(1, "rank1 found no slot", shard=(1, 2))
    m.abort(1, "again", shard=(1, 2))  # aborting again does nothing
    with pytest.raises(VersionStateError, match="rank1 found no slot"):
        m.begin(1, publisher="rank0", slot=0, shard=(0, 2))
    publish(m, 2)
    assert 1 not in states(m)  # the tombstone goes once a later version is announced


def test_a_later_version_supersedes_an_unfinished_sharded_one(m):
    """Of its own line only: v1's owner (rank0, as an admin wrote it) announces v3 while
    v1 still waits on rank1's shard; another line's v2 leaves v1 alone."""
    begin_shards(m, 1)
    m.commit(shard_manifest(1, 0))
    publish(m, 2, slot=1)  # another line's (pub's): it leaves v1 alone
    assert states(m)[1] is VersionState.WRITING
    m.begin(3, publisher="rank0", slot=1)
    m.commit(manifest(3, 1, "rank0"))
    (info,) = [v for v in m.status().versions if v.version == 1]
    assert info.state is VersionState.ABORTED and "superseded by v3" in info.reason
    m.reclaim(1)
    begin_shards(m, 4)  # both ranks' slots are free again
