"""GPU mirrors that read from relays: each bucket a relay sent is checked against the
publisher's wsum64 digests on the GPU, by the torch digester (`Puller(digester=)`); a
bucket the relay changed is caught and the copy read again from the trainer's slot; a
version whose digests a GPU mirror cannot check (BLAKE2b) is refused before any read."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import host_tensors
from weightpull import InProcessRegistry, InvalidArgumentError, Publisher, Puller, create_transport
from weightpull.digests import WSUM64, digest
from weightpull.integrations.torch_digests import wsum64_digests
from weightpull.integrations.torch_staging import HostStaged
from weightpull.transport import Region

pytestmark = pytest.mark.anyio
SIZES = (300_000, 5_000, 1_200_000, 77)  # several 256 KiB buckets, odd sizes


def on_gpu_exact(pulled, version: int) -> bool:
    """The GPU mirror holds the version's bytes, tensor by tensor."""
    raw = pulled.region.memory[: pulled.nbytes].cpu().numpy().tobytes()
    return all(
        raw[p.offset : p.end] == host_tensors(version, SIZES)[p.spec.name].data for p in pulled.layout.placements
    )


async def relayed_world(digests):
    """A trainer's host slot published with `digests`, and a relay on host h1 that pulled
    it into a host mirror and offers it."""
    registry = InProcessRegistry()
    publisher = Publisher(
        registry, create_transport("fake"), rollout_dtype=None, bucket_bytes=256 << 10, digests=digests
    )
    await publisher.publish(1, host_tensors(1, SIZES))
    relay = Puller(registry, create_transport("fake"), host="h1", holder="relay")
    await relay.pull()
    await relay.offer()
    return registry, publisher, relay


def gpu_reader(registry, name: str, calls: list[int]) -> Puller:
    def digester(region, spans):
        assert region.device.startswith("cuda")  # computed where the mirror lies
        calls.append(len(spans))
        return wsum64_digests(region, spans)

    puller = Puller(registry, create_transport("fake"), host="h1", holder=name, device="cuda:0", digester=digester)
    assert isinstance(puller.transport, HostStaged) and puller.verify_digests
    return puller


async def test_a_gpu_mirror_reads_a_relay_and_catches_a_bucket_it_changed(caplog):
    registry, publisher, relay = await relayed_world(WSUM64)
    sources: list[str] = []
    acquire = registry.acquire

    async def spy(*args, **kw):
        lease = await acquire(*args, **kw)
        sources.append(lease.source)
        return lease

    registry.acquire = spy
    calls: list[int] = []
    reader = gpu_reader(registry, "reader", calls)
    pulled = await reader.pull()
    buckets = len(pulled.layout.buckets)
    assert buckets > 2 and sources == ["relay"] and calls == [buckets]
    assert pulled.region.device == "cuda:0" and on_gpu_exact(pulled, 1)

    relay.mirror.host_view()[pulled.layout.buckets[1].offset + 5] ^= 0xFF  # a bug, or a hostile relay
    sources.clear()
    calls.clear()
    second = gpu_reader(registry, "reader2", calls)
    pulled = await second.pull()
    assert sources == ["relay", ""]  # the relay's copy dropped, read again from the trainer's slot
    assert calls == [buckets, buckets] and on_gpu_exact(pulled, 1)
    assert "bucket 1 read from 'relay' does not match the publisher's wsum64 digest" in caplog.text
    assert second.metrics()["pull/failed"] == 0
    for p in (reader, second, relay):
        await p.aclose()
    await publisher.aclose()


async def test_a_gpu_mirror_that_reads_from_relays_refuses_blake2b_digests_before_reading():
    registry, publisher, relay = await relayed_world(True)
    calls: list[int] = []
    reader = gpu_reader(registry, "reader", calls)
    with pytest.raises(InvalidArgumentError, match=r"records blake2b128 digests.*digests='wsum64'"):
        await reader.pull()
    assert reader.mirror is None and calls == []
    assert (await registry.status()).leases == ()
    with pytest.raises(InvalidArgumentError, match="torch_digests.wsum64_digests"):
        Puller(registry, create_transport("fake"), host="h1", device="cuda:0")  # no digester: refused
    with pytest.raises(InvalidArgumentError, match="host staging cannot be exported"):
        Puller(
            registry,
            create_transport("fake"),
            host="h1",
            device="cuda:0",
            stream=True,
            relay=True,
            digester=wsum64_digests,
        )
    await reader.aclose()
    await relay.aclose()
    await publisher.aclose()


def test_the_torch_digester_agrees_with_the_host_on_a_staged_gpu_mirror():
    """What the reader's check rests on: the digests of a GPU mirror's spans are the
    publisher's of the same bytes on the host."""
    data = bytes(range(256)) * 4099
    mirror = torch.frombuffer(bytearray(data), dtype=torch.uint8).to("cuda:0")
    spans = [(0, 1 << 16), (1 << 16, 12345), (100_003, len(data) - 100_003)]
    got = wsum64_digests(Region(mirror.numel(), "cuda:0", mirror), spans)
    assert got == [digest(data[o : o + n], WSUM64) for o, n in spans]
