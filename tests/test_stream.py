"""Versions readable while written: the registry's STREAMING state, the publisher's
bucket-by-bucket copy with batched marks, and readers that opt in."""

import anyio
import attrs
import pytest

from weightpull import FakeClock, InProcessRegistry, InvalidArgumentError, Manifest, VersionState, VersionStateError
from weightpull.errors import NoReadyVersionError, PermissionDeniedError, VersionWaitTimeoutError
from weightpull.layout import TensorSpec, plan_layout
from weightpull.principals import Principal

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio

LAYOUT = plan_layout([TensorSpec(f"w{i}", "uint8", (1000,)) for i in range(8)], bucket_bytes=2048)


def manifest(version: int, slot: int = 0, publisher: str = "pub", digests=None) -> Manifest:
    return Manifest(version, LAYOUT, "fake", b"src", slot, publisher, digests)


@pytest.fixture
def reg():
    return InProcessRegistry(FakeClock())


async def test_a_stream_takes_marks_then_turns_ready_at_its_commit(reg):
    assert len(LAYOUT.buckets) == 4
    await reg.begin(1, publisher="pub", slot=0)
    with pytest.raises(VersionStateError, match="only a STREAMING one takes marks"):
        await reg.mark(1, 1)
    await reg.stream(manifest(1))
    assert (await reg.progress(1)).committed == 0
    await reg.mark(1, 2)
    progress = await reg.progress(1)
    assert (progress.state, progress.committed, progress.buckets) == (VersionState.STREAMING, 2, 4)
    for bad in (1, 5):  # marks only grow, and never past the buckets there are
        with pytest.raises(InvalidArgumentError, match="not between"):
            await reg.mark(1, bad)
    info = (await reg.status()).versions[0]
    assert info.state is VersionState.STREAMING and info.committed == 2
    assert await reg.newest() is None  # a plain reader sees nothing yet
    with pytest.raises(NoReadyVersionError):
        await reg.acquire(ttl=5, holder="plain")
    lease = await reg.acquire(ttl=5, holder="streamer", streaming=True)
    assert lease.version == 1 and (await reg.get(1)) == manifest(1)
    await reg.commit(manifest(1, digests=("d",) * 4))  # digests may come with the commit
    assert (await reg.progress(1)).committed == 4 and (await reg.newest()).version == 1
    assert await reg.is_valid(lease)


async def test_a_stream_commits_only_the_manifest_it_streamed(reg):
    await reg.begin(1, publisher="pub", slot=0)
    await reg.stream(manifest(1))
    other = attrs.evolve(manifest(1), source=b"elsewhere")
    with pytest.raises(InvalidArgumentError, match="other than the one it streamed"):
        await reg.commit(other)
    await reg.begin(2, publisher="pub", slot=1)
    with pytest.raises(InvalidArgumentError, match="digests come with its commit"):
        await reg.stream(manifest(2, slot=1, digests=("d",) * 4))


async def test_streaming_readers_take_the_newest_of_ready_and_streaming(reg):
    await reg.begin(1, publisher="pub", slot=0)
    await reg.commit(manifest(1))
    await reg.begin(2, publisher="pub", slot=1)
    assert (await reg.acquire(ttl=5, holder="r", streaming=True)).version == 1  # 2 is not streaming yet
    await reg.stream(manifest(2, slot=1))
    assert (await reg.acquire(ttl=5, holder="r", streaming=True)).version == 2
    assert (await reg.acquire(ttl=5, holder="r")).version == 1
    with pytest.raises(VersionStateError, match="STREAMING"):
        await reg.acquire(2, ttl=5, holder="r")


async def test_waiters_wake_at_each_mark_and_hear_of_an_abort(reg):
    clock = reg.clock
    await reg.begin(1, publisher="pub", slot=0)
    await reg.stream(manifest(1))
    seen = []

    async def reader():
        seen.append((await reg.wait_for_buckets(1, 1)).committed)
        seen.append((await reg.wait_for_buckets(1, 3)).committed)
        with pytest.raises(VersionStateError, match="ABORTED \\(copy failed\\)"):
            await reg.wait_for_buckets(1, 4)
        seen.append("aborted")

    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(reader)
        await clock.sleep(1)
        await reg.mark(1, 1)
        await clock.sleep(1)
        await reg.mark(1, 3)
        await clock.sleep(1)
        await reg.abort(1, "copy failed")
    assert seen == [1, 3, "aborted"]
    await reg.begin(2, publisher="pub", slot=1)
    with pytest.raises(VersionWaitTimeoutError, match="0 of 0 buckets committed"):
        await reg.wait_for_buckets(2, 1, timeout=0)  # begun, not streaming yet: it may still come


async def test_only_the_owner_streams_and_marks():
    reg = InProcessRegistry(FakeClock())
    trainer, rogue = reg.as_principal(Principal.publisher("pub")), reg.as_principal(Principal.publisher("rogue"))
    await trainer.begin(1, publisher="pub", slot=0)
    with pytest.raises(PermissionDeniedError):
        await rogue.stream(manifest(1))
    await trainer.stream(manifest(1))
    with pytest.raises(PermissionDeniedError):
        await rogue.mark(1, 4)


async def test_a_lapsed_streaming_publisher_ends_aborted():
    clock = FakeClock()
    reg = InProcessRegistry(clock, liveness_ttl=5)
    trainer = reg.as_principal(Principal.publisher("pub"))
    await trainer.begin(1, publisher="pub", slot=0)
    await trainer.stream(manifest(1))
    clock.advance(6)
    progress = await reg.progress(1)
    assert progress.state is VersionState.ABORTED and "lapsed" in progress.reason


async def test_a_streaming_publisher_marks_buckets_as_they_land(world):
    publisher = world.publisher(stream=True, bucket_bytes=2048)
    marks: list[int] = []
    real_mark = world.registry.mark

    async def spy(version, committed):
        marks.append(committed)
        await real_mark(version, committed)

    world.registry.mark = spy
    result = await publisher.publish(1, host_tensors(1, sizes=(1500,) * 6))
    assert not result.skipped and (await world.registry.newest()).version == 1
    assert marks and marks == sorted(marks) and marks[-1] <= len(result.manifest.layout.buckets)
    view = publisher.slots[result.slot].region.host_view()
    for name, t in host_tensors(1, sizes=(1500,) * 6).items():
        p = result.manifest.layout[name]
        assert bytes(view[p.offset : p.end]) == t.data
