"""Streams through a real served registry, with keys: a publisher client marks buckets, a
reader client in the same process waits for each mark over the wire (fake transport for
the bytes, real clock)."""

import time

import anyio
import pytest

from tests.served import ServedRegistry, make_keys
from weightpull import Publisher, PublishError, Puller, TornReadError, VersionState
from weightpull.drivers.fake import FakeFaults, FakeTransport
from weightpull.registry import connect_registry

from .conftest import SlowCopy, host_tensors

pytestmark = pytest.mark.anyio

SIZES = (1500,) * 10  # ten buckets of 2048 bytes
PER_BUCKET = 0.1  # seconds the trainer's copy, and the replica's read, take per bucket


@pytest.fixture
def served(tmp_path):
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "replica-0"))
    served = ServedRegistry(tmp_path, keys=keys)
    served.start()
    yield served
    served.stop()


async def race(served, fail_at=None):
    trainer = connect_registry(served.address, **served.key("trainer"))
    replica = connect_registry(served.address, **served.key("replica-0"))
    async with trainer, replica:
        publisher = Publisher(
            trainer,
            FakeTransport(),
            stream=True,
            adapter=SlowCopy(1500 / PER_BUCKET, fail_at=fail_at, why="copy failed midway"),
            bucket_bytes=2048,
        )
        link = FakeFaults(bandwidth=2048 / PER_BUCKET)
        puller = Puller(replica, FakeTransport(faults=link), holder="replica-0", stream=True, ttl=5)
        out = {}

        async def publish():
            try:
                await publisher.publish(1, host_tensors(1, sizes=SIZES))
            except PublishError as exc:
                out["publish_error"] = exc
            out["published"] = time.monotonic()

        async def pull():
            while True:
                try:
                    out["pulled"] = await puller.pull()
                except TornReadError as exc:
                    out["pulled"] = exc
                except Exception:  # nothing to lease yet
                    await anyio.sleep(0.01)
                    continue
                break
            out["pull_end"] = time.monotonic()

        started = time.monotonic()
        async with anyio.create_task_group() as tg:
            tg.start_soon(publish)
            tg.start_soon(pull)
        out["copy_s"] = out["published"] - started
        out["status"] = await replica.status()
        return out


async def test_a_reader_streams_a_version_over_the_wire(served):
    out = await race(served)
    pulled = out["pulled"]
    assert pulled.version == 1
    for name, t in host_tensors(1, sizes=SIZES).items():
        assert bytes(pulled.view(name)) == t.data
    # The copy and the read take 1 s each: read after the copy, the pull would end 1 s after
    # it; streamed behind it, about a bucket (0.1 s) after.
    assert out["copy_s"] >= 10 * PER_BUCKET
    assert out["pull_end"] - out["published"] < 5 * PER_BUCKET
    assert out["status"].versions[-1].state is VersionState.READY


async def test_a_stream_aborted_midway_rejects_the_copy_over_the_wire(served):
    out = await race(served, fail_at=4)
    assert isinstance(out["publish_error"], PublishError)
    assert isinstance(out["pulled"], TornReadError) and "copy failed midway" in str(out["pulled"])
    info = out["status"].versions[-1]
    assert info.state is VersionState.ABORTED and info.committed is None
