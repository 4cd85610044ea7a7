"""Sharded versions: N shard publishers each write rows of every tensor; the version turns
READY only once all N committed, any shard's failure aborts it, one lease covers it, and
a puller reads every shard's rows straight into their place in its full-layout mirror."""

from __future__ import annotations

import anyio
import attrs
import pytest

from weightpull import (
    HostTensor,
    InvalidArgumentError,
    Manifest,
    PublishError,
    Sharding,
    TensorSpec,
    VersionState,
    plan_layout,
)
from weightpull.errors import NoFreeSlotError, VersionInUseError, VersionNotFoundError, VersionStateError
from weightpull.sharding import Shard, chunk_rows, row_bytes
from weightpull.tensors import HostTensorAdapter

pytestmark = pytest.mark.anyio

# Uneven (7, 10 rows over 3), short-last (4 over 3: 2, 2, 0) and empty shards (1 row over 3).
SHAPES = {"embed": ("int32", (7, 3)), "norm": ("uint8", (4,)), "sinks": ("uint8", (1,)), "proj": ("uint8", (10, 300))}


def full(version: int) -> dict[str, bytes]:
    out = {}
    for i, (name, (dtype, shape)) in enumerate(SHAPES.items()):
        n = TensorSpec(name, dtype, shape).nbytes
        out[name] = bytes((version * 31 + i * 7 + k) % 251 for k in range(n))
    return out


def part(version: int, index: int, count: int) -> tuple[dict[str, HostTensor], Sharding]:
    """Shard `index` of `count` of `version`: its rows of each tensor, under FSDP2's rule."""
    tensors, starts = {}, {}
    data = full(version)
    for name, (dtype, shape) in SHAPES.items():
        start, stop = chunk_rows(shape[0], index, count)
        rb = row_bytes(TensorSpec(name, dtype, shape))
        tensors[name] = HostTensor(dtype, (stop - start, *shape[1:]), data[name][start * rb : stop * rb])
        starts[name] = start
    return tensors, Sharding(index, count, {n: s for n, (_, s) in SHAPES.items()}, starts)


async def publish(pub, version: int, index: int, count: int):
    tensors, sharding = part(version, index, count)
    return await pub.publish(version, tensors, shard=sharding)


def assert_whole(pulled, version: int) -> None:
    assert pulled.version == version
    for name, data in full(version).items():
        assert bytes(pulled.view(name)) == data, name


async def state(world, version: int) -> VersionState:
    return {v.version: v.state for v in (await world.registry.status()).versions}[version]


class FailingWrite(HostTensorAdapter):
    """Writes the first tensor, then fails: a shard that breaks off mid-copy."""

    async def write(self, items, region):
        await super().write(items[:1], region)
        raise RuntimeError("the device fell off the bus")


async def test_a_sharded_version_turns_ready_once_every_shard_committed_and_reads_whole(world):
    pubs = [world.publisher(name=f"rank{i}") for i in range(3)]
    puller = world.puller()
    for i in (2, 0):
        result = await publish(pubs[i], 1, i, 3)
        assert not result.skipped and result.manifest.shards[0].index == i
        assert await world.registry.newest() is None and await state(world, 1) is VersionState.WRITING
    await publish(pubs[1], 1, 1, 3)

    manifest = await world.registry.newest()
    assert manifest.version == 1 and [s.index for s in manifest.shards] == [0, 1, 2]
    assert [tuple(s.shape) for s in manifest.layout.specs] == [s for _, s in SHAPES.values()]  # the full layout
    assert manifest.shards[2].rows == ((6, 7), (4, 4), (1, 1), (8, 10))
    assert Manifest.from_dict(manifest.to_dict()) == manifest
    assert_whole(await puller.pull(), 1)

    for i in range(3):  # and again, every publisher reclaiming its own slots as versions move on
        await publish(pubs[i], 2, i, 3)
    for i in range(3):
        await publish(pubs[i], 3, i, 3)
    assert_whole(await puller.pull(), 3)


async def test_a_shard_that_fails_mid_write_aborts_the_version_and_the_previous_stays_readable(world):
    pubs = [world.publisher(name="rank0"), world.publisher(name="rank1")]
    for i in range(2):
        await publish(pubs[i], 1, i, 2)
    await publish(pubs[0], 2, 0, 2)
    pubs[1].adapter = FailingWrite()
    with pytest.raises(PublishError, match="fell off the bus"):
        await publish(pubs[1], 2, 1, 2)
    pubs[1].adapter = None

    assert await state(world, 2) is VersionState.ABORTED
    assert (await world.registry.newest()).version == 1
    assert_whole(await world.puller().pull(), 1)
    for i in range(2):  # both take their slot of v2 back: the first reclaim drops it for both
        await publish(pubs[i], 3, i, 2)
    assert_whole(await world.puller().pull(), 3)


async def test_a_shard_that_gives_up_before_it_begins_aborts_the_version_for_its_siblings(world):
    pubs = [world.publisher(name="rank0"), world.publisher(name="rank1", when_full="skip")]
    for i in range(2):
        await publish(pubs[i], 1, i, 2)
    lease = await world.registry.acquire(ttl=60, holder="reader")  # keeps v1 leased once it retires
    for i in range(2):
        await publish(pubs[i], 2, i, 2)

    assert (await publish(pubs[1], 3, 1, 2)).skipped  # v1 leased, v2 the newest: no free slot
    await world.registry.release(lease)
    with pytest.raises(VersionStateError, match="ABORTED"):  # the sibling is refused, not left waiting
        await publish(pubs[0], 3, 0, 2)
    status = {v.version: v for v in (await world.registry.status()).versions}
    assert status[3].state is VersionState.ABORTED and "shard 1 found no free slot" in status[3].reason
    assert_whole(await world.puller().pull(), 2)

    for i in range(2):
        await publish(pubs[i], 4, i, 2)
    assert 3 not in {v.version for v in (await world.registry.status()).versions}  # the abort's record is gone
    assert_whole(await world.puller().pull(), 4)


async def test_a_shard_that_never_commits_holds_its_version_writing_and_the_previous_readable(world):
    pubs = [world.publisher(name="rank0", when_full="fail"), world.publisher(name="rank1")]
    for i in range(2):
        await publish(pubs[i], 1, i, 2)
    await publish(pubs[0], 2, 0, 2)  # rank1 is late with v2

    assert (await world.registry.newest()).version == 1
    assert_whole(await world.puller().pull(), 1)
    with pytest.raises(NoFreeSlotError, match=r"version 2 is WRITING: shards \[1\] have not committed"):
        await publish(pubs[0], 3, 0, 2)  # its slot of v2 is not reclaimable while v2 waits
    await publish(pubs[1], 2, 1, 2)  # joins v2, although rank0 went on to v3 (and gave it up)
    assert_whole(await world.puller().pull(), 2)


async def test_a_sharded_version_left_behind_by_a_newer_ready_one_is_aborted(world):
    """It could never turn READY (a commit older than the newest READY is refused), so
    its shards' slots come free."""
    pubs = [world.publisher(name=f"rank{i}", num_slots=3, when_full="fail") for i in range(2)]
    for i in range(2):
        await publish(pubs[i], 1, i, 2)
    await publish(pubs[0], 2, 0, 2)  # rank1 skips v2 without a word
    for v in (3, 4, 5):
        for i in range(2):
            await publish(pubs[i], v, i, 2)
        if v == 3:
            status = {x.version: x for x in (await world.registry.status()).versions}
            assert status[2].state is VersionState.ABORTED and "superseded by v3" in status[2].reason
    assert_whole(await world.puller().pull(), 5)


async def test_one_lease_covers_every_shard_and_the_first_reclaim_frees_them_all(world):
    pubs = [world.publisher(name=f"rank{i}") for i in range(2)]
    for i in range(2):
        await publish(pubs[i], 1, i, 2)
    lease = await world.registry.acquire(ttl=60, holder="reader")
    for i in range(2):
        await publish(pubs[i], 2, i, 2)
    with pytest.raises(VersionInUseError, match="leased by reader"):
        await world.registry.reclaim(1)
    await world.registry.release(lease)
    await world.registry.reclaim(1)
    with pytest.raises(VersionNotFoundError):  # the sibling finds it gone: its slot is free too
        await world.registry.reclaim(1)
    for i in range(2):
        await publish(pubs[i], 3, i, 2)
    assert_whole(await world.puller().pull(), 3)


LAYOUT = plan_layout([TensorSpec("w", "uint8", (4, 2))])


def shard(index: int, count: int = 2, rows=((0, 2),), publisher: str | None = None, slot: int = 0) -> Shard:
    return Shard(index, count, publisher or f"p{index}", slot, b"src%d" % index, rows)


def shard_manifest(version: int, s: Shard) -> Manifest:
    return Manifest(version, LAYOUT, "fake", s.source, s.slot, s.publisher, shards=[s])


async def test_the_registry_refuses_shards_that_do_not_fit(world):
    reg = world.registry
    await reg.begin(1, publisher="p0", slot=0, shard=(0, 2))
    with pytest.raises(InvalidArgumentError, match="cannot join"):
        await reg.begin(1, publisher="p1", slot=0, shard=(1, 3))
    assert await reg.begin(1, publisher="p1", slot=1) == 2  # an unsharded begin never joins: a number of its own
    await reg.abort(2)
    await reg.begin(1, publisher="p1", slot=0, shard=(1, 2))
    with pytest.raises(InvalidArgumentError, match="was not begun"):
        await reg.commit(shard_manifest(1, shard(1, publisher="p9")))
    await reg.commit(shard_manifest(1, shard(0)))
    with pytest.raises(InvalidArgumentError, match="already committed"):
        await reg.commit(shard_manifest(1, shard(0)))
    with pytest.raises(InvalidArgumentError, match="do not tile"):  # rows [0, 2) twice, [2, 4) never
        await reg.commit(shard_manifest(1, shard(1)))
    assert await state(world, 1) is VersionState.ABORTED
    await reg.abort(1, shard=(1, 2))  # again: nothing to do

    await reg.begin(2, publisher="p", slot=1)
    with pytest.raises(InvalidArgumentError, match="begun unsharded"):
        await reg.commit(shard_manifest(2, shard(0, count=1, rows=((0, 4),), publisher="p", slot=1)))


def test_manifests_check_their_shards_and_keep_the_unsharded_wire_form():
    plain = Manifest(1, LAYOUT, "fake", b"s", 0, "p")
    assert "shards" not in plain.to_dict()
    whole = Manifest(1, LAYOUT, "fake", b"src0", 0, "p0", shards=[shard(0), shard(1, rows=((2, 4),))])
    assert Manifest.from_dict(whole.to_dict()) == whole
    with pytest.raises(InvalidArgumentError, match="outside its 4 rows"):
        shard_manifest(1, shard(0, rows=((2, 5),)))
    with pytest.raises(InvalidArgumentError, match="those of shard 0"):
        Manifest(1, LAYOUT, "fake", b"other", 0, "p0", shards=[shard(0)])
    with pytest.raises(InvalidArgumentError, match="no digests"):
        attrs.evolve(shard_manifest(1, shard(0)), digests=["00"])
    with pytest.raises(InvalidArgumentError, match="malformed manifest"):
        Manifest.from_dict({**whole.to_dict(), "shards": [{"index": 0}]})


def test_a_sharding_must_describe_dim_0_slices():
    sharding = Sharding(1, 2, {"w": (4, 2)}, {"w": 2})
    layout, rows, packed = sharding.plan([TensorSpec("w", "uint8", (2, 2))], bucket_bytes=1024, align=64)
    assert rows == ((2, 4),) and layout.specs[0].shape == (4, 2) and packed.specs[0].shape == (2, 2)
    with pytest.raises(InvalidArgumentError, match="not a dim-0 slice"):
        sharding.plan([TensorSpec("w", "uint8", (2, 3))], bucket_bytes=1024, align=64)
    with pytest.raises(InvalidArgumentError, match="exceed its 4 rows"):
        sharding.plan([TensorSpec("w", "uint8", (3, 2))], bucket_bytes=1024, align=64)
    with pytest.raises(InvalidArgumentError, match="not published: \\['w'\\]"):
        sharding.plan([TensorSpec("v", "uint8", (2, 2))], bucket_bytes=1024, align=64)
    with pytest.raises(InvalidArgumentError, match="shard index"):
        Sharding(2, 2, {}, {})
    assert [chunk_rows(10, i, 4) for i in range(4)] == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert [chunk_rows(1, i, 3) for i in range(3)] == [(0, 1), (1, 1), (1, 1)]


async def test_sharded_versions_cross_the_served_registry_and_survive_its_restart(tmp_path):
    """Each rank has its own client. After a restart each replays its own parts and its
    aborts: the READY version is READY again, and the aborted one stays aborted although
    rank1 never learnt that rank0 gave it up."""
    pytest.importorskip("zmq")
    import signal

    from weightpull import Publisher, Puller
    from weightpull.drivers.fake import FakeFabric, FakeTransport
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    from .served import SECRET, ServedRegistry

    server = ServedRegistry(tmp_path)
    server.start()
    clients = [ZmqRegistry(server.address, secret=SECRET, timeout=0.5, heartbeat=0.05) for _ in range(3)]
    try:
        fabric = FakeFabric()
        pubs = [
            Publisher(clients[i], FakeTransport(fabric=fabric), rollout_dtype=None, bucket_bytes=2048, name=f"rank{i}")
            for i in range(2)
        ]
        puller = Puller(clients[2], FakeTransport(fabric=fabric), ttl=5.0)
        for v in (1, 2):
            for i in range(2):
                await publish(pubs[i], v, i, 2)
        await publish(pubs[1], 3, 1, 2)
        pubs[0].adapter = FailingWrite()
        with pytest.raises(PublishError):
            await publish(pubs[0], 3, 0, 2)
        pubs[0].adapter = None

        def states(status):
            return [(v.version, v.state) for v in status.versions]

        assert states(await clients[2].status()) == [(2, VersionState.READY), (3, VersionState.ABORTED)]
        server.stop(signal.SIGKILL)
        await anyio.to_thread.run_sync(server.start)
        assert (await clients[2].wait_for_version(2, timeout=10.0)).shards[1].publisher == "rank1"
        assert_whole(await puller.pull(), 2)
        with anyio.fail_after(10):  # rank1's part of v3 came back, and rank0's abort with it
            while states(await clients[2].status()) != [(2, VersionState.READY), (3, VersionState.ABORTED)]:
                await anyio.sleep(0.05)
        for v in (4, 5):  # every slot comes free again as the job goes on
            for i in range(2):
                assert not (await publish(pubs[i], v, i, 2)).skipped
        assert_whole(await puller.pull(), 5)
    finally:
        for c in clients:
            await c.aclose()
        server.stop()
