"""Streaming defects found by the fuzzers (fuzz/test_concurrent.py), each shown by the
smallest test that shows it (while a fix is awaited, marked strict xfail, with a switch of
the same name in fuzz/harness.AWAITING_FIX; both fixed now)."""

import anyio
import pytest

from weightpull import NoReadyVersionError, PublishError, VersionState

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio


class FailingAdapter:
    """Host tensors whose copy into the slot fails at the second tensor (in its own bucket)."""

    def __init__(self):
        from weightpull.tensors import HostTensorAdapter

        self.inner = HostTensorAdapter()

    def describe(self, name, value, rollout_dtype):
        return self.inner.describe(name, value, rollout_dtype)

    async def write(self, items, region):
        if any(p.spec.name == "t1" for _, p in items):
            raise RuntimeError("injected: the device was lost mid-copy")
        await self.inner.write(items, region)

    async def fence(self):
        await self.inner.fence()


@pytest.mark.parametrize("stream", [False, True])
async def test_a_streamed_publish_that_fails_is_chained_to_its_cause(world, stream):
    """A publish that fails once begun raises PublishError chained to the cause (as the
    serial path does), not to the ExceptionGroups of `_stream`'s task groups."""
    publisher = world.publisher(stream=stream, adapter=FailingAdapter())
    with pytest.raises(PublishError) as caught:
        await publisher.publish(1, host_tensors(1, sizes=(1500, 1500)))
    assert (await world.registry.progress(1)).state is VersionState.ABORTED
    assert isinstance(caught.value.__cause__, RuntimeError), repr(caught.value.__cause__)


class SlowAdapter:
    """Host tensors copied a second per bucket of the fake clock."""

    def __init__(self, clock):
        from weightpull.tensors import HostTensorAdapter

        self.inner, self.clock = HostTensorAdapter(), clock

    def describe(self, name, value, rollout_dtype):
        return self.inner.describe(name, value, rollout_dtype)

    async def write(self, items, region):
        await self.clock.sleep(1.0)
        await self.inner.write(items, region)

    async def fence(self):
        await self.inner.fence()


async def test_a_stream_that_turned_ready_then_retired_is_kept(world):
    """A reader streams v1; v1 turns READY and is withdrawn (or retired by a newer one)
    before the reader looks again. Its lease held throughout and every bucket landed once
    marked: the copy is whole, as a plain pull's of a version retired under it is. It is
    rejected as torn: `_until_ready` takes anything but READY, RETIRED too, as a stream
    that ended otherwise, though RETIRED is reached only from READY."""
    publisher = world.publisher(stream=True, adapter=SlowAdapter(world.clock))
    puller = world.puller(stream=True, ttl=30)
    tensors = host_tensors(1, sizes=(1500,) * 4)
    pulled = []

    async def pull():
        while True:
            try:
                pulled.append(await puller.pull())
                return
            except NoReadyVersionError:
                await world.clock.sleep(0.5)

    async def publish_then_withdraw():
        await publisher.publish(1, tensors)
        await world.registry.retire(1)  # at once: the reader has not looked since the commit

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(pull)
        tg.start_soon(publish_then_withdraw)
    assert pulled[0].version == 1 and puller.mirror_version == 1
    for name, t in tensors.items():
        assert bytes(pulled[0].view(name)) == t.data


class QueuedCopies:
    """Host tensors whose copies are queued at once and land `per_bucket` seconds apart (real
    time, as a GPU's do): `landing()` waits, in the publisher's worker thread, for the
    copies queued so far."""

    def __init__(self, per_bucket):
        from weightpull.tensors import HostTensorAdapter

        self.inner, self.per_bucket = HostTensorAdapter(), per_bucket

    def describe(self, name, value, rollout_dtype):
        return self.inner.describe(name, value, rollout_dtype)

    async def write(self, items, region):
        await self.inner.write(items, region)

    async def fence(self):
        await self.inner.fence()

    def landing(self):
        import time

        return lambda: time.sleep(self.per_bucket)


async def test_queued_copies_are_marked_as_they_land_not_only_at_the_commit():
    """The worker thread that counts queued copies landed starts once they are all queued;
    the marker, which began waiting before it started, must still look and mark while the
    copies land (it once waited for a wake-up that never came: no marks, the stream read
    only after its commit)."""
    from weightpull import InProcessRegistry, Publisher
    from weightpull.drivers.fake import FakeTransport

    registry = InProcessRegistry()
    marks = []
    real = registry.mark

    async def spy(version, committed):
        marks.append(committed)
        await real(version, committed)

    registry.mark = spy
    publisher = Publisher(
        registry, FakeTransport(), stream=True, adapter=QueuedCopies(0.03), rollout_dtype=None, bucket_bytes=2048
    )
    await publisher.publish(1, host_tensors(1, sizes=(1500,) * 10))
    assert marks and marks[0] < 10, f"no bucket was marked before the last landed: {marks}"
    assert (await registry.progress(1)).state is VersionState.READY


class AskedCopies:
    """Host tensors whose copies are queued at once and land two writes later, as a GPU's
    trail the loop that queues them: `landing()` never blocks to say so (`done()`)."""

    def __init__(self):
        from weightpull.tensors import HostTensorAdapter

        self.inner, self.writes = HostTensorAdapter(), 0

    def describe(self, name, value, rollout_dtype):
        return self.inner.describe(name, value, rollout_dtype)

    async def write(self, items, region):
        self.writes += 1
        await self.inner.write(items, region)

    async def fence(self):
        await self.inner.fence()

    def landing(self):
        adapter, queued_at = self, self.writes

        class Landing:
            def __call__(self):
                pass

            def done(self):
                return adapter.writes >= queued_at + 2

        return Landing()


async def test_copies_asked_without_blocking_are_marked_while_still_queued():
    """A GPU trainer queues a model's casts about as fast as they run, so a worker thread
    started once all are queued finds them all landed: one mark, at the end, and readers
    read nothing while the trainer writes. Copies whose landing can be asked (a CUDA
    event's query) are marked by the queueing loop itself, between its turns."""
    from weightpull import InProcessRegistry, Publisher
    from weightpull.drivers.fake import FakeTransport

    registry = InProcessRegistry()
    adapter = AskedCopies()
    marks = []  # (buckets marked, writes queued by then)
    real = registry.mark

    async def spy(version, committed):
        marks.append((committed, adapter.writes))
        await real(version, committed)

    registry.mark = spy
    publisher = Publisher(
        registry, FakeTransport(), stream=True, adapter=adapter, rollout_dtype=None, bucket_bytes=2048
    )
    await publisher.publish(1, host_tensors(1, sizes=(1500,) * 100))
    assert marks and marks[0][1] < 100, f"nothing was marked before every copy was queued: {marks}"
    assert [m for m, _ in marks] == sorted(m for m, _ in marks)
    assert (await registry.progress(1)).state is VersionState.READY
