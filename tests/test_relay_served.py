"""Relays through a real served registry, with keys: a relay client offers its mirror, a
reader client is handed it over the wire and reads it (fake transport for the bytes)."""

import pytest

from tests.served import ServedRegistry, make_keys
from weightpull import PermissionDeniedError, Publisher, Puller
from weightpull.drivers.fake import FakeTransport
from weightpull.registry import connect_registry

from .conftest import host_tensors

pytestmark = pytest.mark.anyio


@pytest.fixture
def served(tmp_path):
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "relay"), ("reader", "reader"))
    served = ServedRegistry(tmp_path, keys=keys)
    served.start()
    yield served
    served.stop()


async def test_a_reader_is_handed_a_relay_over_the_wire(served):
    trainer = connect_registry(served.address, **served.key("trainer"))
    relay_reg = connect_registry(served.address, **served.key("relay"))
    reader_reg = connect_registry(served.address, **served.key("reader"))
    async with trainer, relay_reg, reader_reg:
        publisher = Publisher(trainer, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, digests=True)
        await publisher.publish(1, host_tensors(1))
        relay = Puller(relay_reg, FakeTransport(), host="h1")
        await relay.pull()
        await relay.offer(cap=2)
        with pytest.raises(PermissionDeniedError):
            await reader_reg.offer(1, holder="relay", host="h1", descriptor=b"not-mine")
        lease = await reader_reg.acquire(1, ttl=10.0, holder="reader", host="h1")
        assert lease.source == relay.holder and lease.descriptor
        assert await relay_reg.readers_at(1, relay.holder) == 1
        await reader_reg.release(lease)
        await publisher.transport.aclose()  # only the relay holds the bytes now
        pulled = await Puller(reader_reg, FakeTransport(), host="h1").pull()
        assert all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(1).items())
        await relay_reg.withdraw(1, holder=relay.holder)
        assert (await reader_reg.acquire(1, ttl=10.0, holder="reader", host="h1")).source == ""
