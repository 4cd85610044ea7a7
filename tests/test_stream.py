"""Versions readable while written: the registry's STREAMING state, the publisher's
bucket-by-bucket copy with batched marks, and readers that opt in."""

import anyio
import attrs
import pytest

from weightpull import (
    FakeClock,
    InProcessRegistry,
    InvalidArgumentError,
    Manifest,
    Publisher,
    PublishError,
    Puller,
    TornReadError,
    VersionState,
)
from weightpull.errors import (
    DigestMismatchError,
    NoReadyVersionError,
    PermissionDeniedError,
    VersionStateError,
    VersionWaitTimeoutError,
)
from weightpull.layout import TensorSpec, plan_layout
from weightpull.principals import Principal
from weightpull.tensors import HostTensorAdapter

from .conftest import SlowCopy, World, autojump, host_tensors

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


async def test_a_version_of_many_buckets_is_queued_in_a_few_buckets_a_write(world):
    class Counting(HostTensorAdapter):
        groups: list[list[int]] = []

        async def write(self, items, region) -> None:
            self.groups.append(sorted({p.bucket for _, p in items}))
            await super().write(items, region)

    adapter = Counting()
    publisher = world.publisher(stream=True, adapter=adapter, bucket_bytes=2048)
    sizes = (1500,) * 200  # 200 buckets
    result = await publisher.publish(1, host_tensors(1, sizes=sizes))
    buckets = len(result.manifest.layout.buckets)
    assert buckets == 200 and 48 <= len(adapter.groups) <= 60  # 4 buckets a write
    assert [b for g in adapter.groups for b in g] == list(range(buckets))  # each once, in order
    view = publisher.slots[result.slot].region.host_view()
    for name, t in host_tensors(1, sizes=sizes).items():
        p = result.manifest.layout[name]
        assert bytes(view[p.offset : p.end]) == t.data
    assert (await world.registry.progress(1)).state is VersionState.READY


# -- readers that stream ---------------------------------------------------------------


SIZES = (1500,) * 8  # eight buckets of 2048 bytes
RATE = 1500.0  # bytes per second: one bucket a second, for the copy and for the read


async def race(world, *, stream: bool, fail_at=None):
    """Publish v1 slowly while a reader pulls the newest; (publish end, pull end, pulled or error)."""
    from weightpull.drivers.fake import FakeFaults

    adapter = SlowCopy(RATE, world.clock.sleep, fail_at, "the trainer's device fell off the bus")
    publisher = world.publisher(stream=True, adapter=adapter, bucket_bytes=2048)
    puller = world.puller(world.transport(faults=FakeFaults(bandwidth=RATE)), stream=stream, ttl=30)
    ended = {}

    async def publish():
        try:
            await publisher.publish(1, host_tensors(1, sizes=SIZES))
        except Exception as exc:
            ended["publish_error"] = exc
        ended["published"] = world.clock.now()

    async def pull():
        while True:
            try:
                ended["pulled"] = await puller.pull()
                break
            except NoReadyVersionError:
                await world.clock.sleep(0.5)
            except Exception as exc:
                ended["pulled"] = exc
                break
        ended["pull_end"] = world.clock.now()

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publish)
        tg.start_soon(pull)
    return ended, puller


async def test_a_streaming_reader_finishes_about_a_bucket_after_the_publisher(world):
    ended, puller = await race(world, stream=True)
    pulled = ended["pulled"]
    assert pulled.version == 1 and puller.mirror_version == 1
    for name, t in host_tensors(1, sizes=SIZES).items():
        assert bytes(pulled.view(name)) == t.data
    # The copy takes 8 s; a serial pull would end 8 s later, the stream one bucket later.
    assert ended["published"] == pytest.approx(8, abs=0.1)
    assert ended["pull_end"] - ended["published"] <= 1.5


async def test_a_streaming_reader_that_saw_the_version_ready_asks_no_more(world):
    """A stream seen READY while its batches were handed out is not asked again once they
    landed (a round trip on the way to serving); one that was not, is."""
    publisher = world.publisher(stream=True)
    await publisher.publish(1, host_tensors(1, sizes=SIZES))
    asked = []
    real = world.registry.wait_for_buckets

    async def spy(version, at_least, **kw):
        asked.append(at_least)
        return await real(version, at_least, **kw)

    world.registry.wait_for_buckets = spy
    pulled = await world.puller(stream=True).pull()
    assert pulled.version == 1 and asked == [1]
    for name, t in host_tensors(1, sizes=SIZES).items():
        assert bytes(pulled.view(name)) == t.data
    racing = World()  # read while written: its end is the commit's, asked for once every batch landed
    asked.clear()
    real = racing.registry.wait_for_buckets
    racing.registry.wait_for_buckets = spy
    ended, _ = await race(racing, stream=True)
    assert ended["pulled"].version == 1 and asked[-1] == len(ended["pulled"].layout.buckets) + 1


async def test_a_plain_reader_waits_for_the_whole_version(world):
    ended, _ = await race(world, stream=False)
    assert ended["pulled"].version == 1
    assert ended["pull_end"] - ended["published"] >= 7.5


async def test_a_stream_aborted_midway_leaves_every_reader_with_a_rejected_copy(world):
    ended, puller = await race(world, stream=True, fail_at=4)
    assert isinstance(ended["publish_error"], PublishError)
    error = ended["pulled"]
    assert isinstance(error, TornReadError) and "ABORTED" in str(error) and "device fell off" in str(error)
    assert ": version 1 is ABORTED" in str(error) and "v1 version" not in str(error)  # the version named once
    assert puller.mirror_version is None
    assert (await world.registry.progress(1)).state is VersionState.ABORTED


async def test_a_streaming_reader_verifies_the_digests_that_come_with_the_commit(world):
    publisher = world.publisher(stream=True, digests=True, bucket_bytes=2048)
    await publisher.publish(1, host_tensors(1, sizes=SIZES))
    puller = world.puller(stream=True)
    view = publisher.slots[0].region.host_view()
    view[10] ^= 0xFF  # a byte altered in the slot after the commit
    with pytest.raises(DigestMismatchError):
        await puller.pull()


def test_streaming_needs_a_registry_that_streams(world):
    class Plain:  # a Registry of someone else's that knows nothing of streams
        pass

    with pytest.raises(InvalidArgumentError, match="cannot stream"):
        Puller(Plain(), world.transport(), stream=True)
    with pytest.raises(InvalidArgumentError, match="Plain cannot stream"):
        Publisher(Plain(), world.transport(), stream=True)
