"""A publisher's digests of each kind (`Publisher(digests=...)`), computed where its slot
lies, and the readers that check them: pulls from the trainer, and from relays."""

from __future__ import annotations

import pytest

from weightpull import InvalidArgumentError, PublishError
from weightpull.digests import BLAKE2B128, WSUM64, digest, wsum64_hex, wsum64_reference
from weightpull.errors import DigestMismatchError
from weightpull.manifest import bucket_digest
from weightpull.transport import WrappedTransport

from .conftest import host_tensors

pytestmark = pytest.mark.anyio

SIZES = (1000, 300, 5000, 2047, 1)  # buckets of odd sizes: tails short of a word


def same(pulled, version=1) -> bool:
    return all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(version, SIZES).items())


def slot_bytes(publisher, result) -> list[bytes]:
    """Each bucket's bytes, as they lie in the slot."""
    view = publisher.slots[result.slot].region.host_view()
    return [bytes(view[b.offset : b.offset + b.nbytes]) for b in result.manifest.layout.buckets]


@pytest.mark.parametrize(
    ("digests", "expect"),
    [
        (True, bucket_digest),  # bare hex, as manifests have always held
        (BLAKE2B128, lambda data: digest(data, BLAKE2B128)),
        (WSUM64, lambda data: wsum64_hex(*wsum64_reference(data))),
    ],
)
async def test_each_kind_is_recorded_for_every_bucket_and_checked_on_pull(world, digests, expect):
    publisher = world.publisher(digests=digests)
    result = await publisher.publish(1, host_tensors(1, SIZES))
    buckets = slot_bytes(publisher, result)
    assert len(buckets) > 2 and any(len(b) % 8 for b in buckets)
    assert result.manifest.digests == tuple(expect(b) for b in buckets)
    assert same(await world.puller().pull())  # a host mirror checks them (verify_digests)
    publisher.slots[result.slot].region.host_view()[3] ^= 0x10  # bit rot in the slot
    with pytest.raises(DigestMismatchError, match="bucket 0"):
        await world.puller().pull()


async def test_a_relayed_pull_checks_wsum64_digests_end_to_end(world):
    publisher = world.publisher(digests=WSUM64)
    await publisher.publish(1, host_tensors(1, SIZES))
    relay = world.puller(host="h1", holder="relay")
    assert same(await relay.pull())
    assert await relay.offer() == 1
    await publisher.transport.aclose()  # the trainer's slot is gone: only the relay can serve
    reader = world.puller(host="h1", holder="reader")
    pulled = await reader.pull()
    assert same(pulled) and pulled.manifest.digests[0].startswith("wsum64:")


async def test_a_bucket_a_relay_changed_is_caught_under_wsum64(world, caplog):
    await world.publisher(digests=WSUM64).publish(1, host_tensors(1, SIZES))
    relay = world.puller(host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    view = relay.mirror.host_view()
    view[8:16], view[16:24] = bytes(view[16:24]), bytes(view[8:16])  # two words swapped: same s1
    reader = world.puller(host="h1", holder="reader")
    assert same(await reader.pull())  # from the origin, after the relay's copy failed its digests
    assert "relay 'relay' failed v1" in caplog.text
    assert "does not match the publisher's wsum64 digest" in caplog.text


async def test_a_streamed_publish_commits_its_wsum64_digests(world):
    publisher = world.publisher(stream=True, digests=WSUM64)
    result = await publisher.publish(1, host_tensors(1, SIZES))
    want = tuple(digest(b, WSUM64) for b in slot_bytes(publisher, result))
    assert result.manifest.digests == want
    assert (await world.registry.get(1)).digests == want  # they came with commit_stream
    relay = world.puller(host="h1", holder="relay", stream=True)
    await relay.pull()
    await relay.offer()
    assert same(await world.puller(host="h1", holder="reader", stream=True).pull())


class DeviceSlots(WrappedTransport):
    """Slots "on a device" that are host memory: the core's path for device slots, tried
    on a CPU."""

    def allocate(self, nbytes: int, device: str = "cpu"):
        return self.inner.allocate(nbytes, "cpu")


async def test_a_device_slot_records_what_its_digester_computed_there(world):
    seen = []

    def digester(region, spans):
        seen.append(list(spans))
        view = region.host_view()
        return [digest(view[o : o + n], WSUM64) for o, n in spans]

    publisher = world.publisher(digests=WSUM64, device="cuda:0", digester=digester)
    publisher.transport = DeviceSlots(publisher.transport)
    result = await publisher.publish(1, host_tensors(1, SIZES))
    assert seen == [[(b.offset, b.nbytes) for b in result.manifest.layout.buckets]]
    assert result.manifest.digests == tuple(digest(b, WSUM64) for b in slot_bytes(publisher, result))


async def test_a_digester_that_gives_other_than_wsum64_digests_aborts_the_publish(world):
    def wrong(region, spans):
        return [digest(b"", BLAKE2B128)] * len(spans)

    publisher = world.publisher(digests=WSUM64, device="cuda:0", digester=wrong)
    publisher.transport = DeviceSlots(publisher.transport)
    with pytest.raises(PublishError, match="not wsum64"):
        await publisher.publish(1, host_tensors(1, SIZES))


def test_digests_a_slot_on_a_device_cannot_compute_are_refused(world):
    for blake in (True, BLAKE2B128):
        with pytest.raises(InvalidArgumentError, match="host slots only, not on 'cuda:0': pass digests='wsum64'"):
            world.publisher(digests=blake, device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="pass digester=weightpull.integrations.torch_digests"):
        world.publisher(digests=WSUM64, device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="digests must be a bool or one of blake2b128, wsum64"):
        world.publisher(digests="md5")
    assert world.publisher(digests=False, device="cuda:0").digest_kind is None
