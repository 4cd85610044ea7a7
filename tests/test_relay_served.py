"""Relays through a real served registry, with keys: a relay client offers its mirror, a
reader client is handed it over the wire and reads it (fake transport for the bytes)."""

import json

import anyio
import pytest

from tests.served import ServedRegistry, cli, make_keys
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


def status_json(served) -> dict:
    key = served.key("reader")
    done = cli(
        "status",
        "--registry",
        served.address,
        "--key",
        str(key["key"]),
        "--server-key",
        str(key["server_key"]),
        "--json",
        secret=None,
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


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
        slot_lease = await reader_reg.acquire(1, ttl=10.0, holder="reader/slot")  # no host: the slot
        # `status --json` names each lease's source: the relay's holder name, "" for the slot.
        shown = await anyio.to_thread.run_sync(status_json, served)
        assert {x["id"]: x["source"] for x in shown["leases"]} == {lease.id: relay.holder, slot_lease.id: ""}
        assert (await reader_reg.status()).leases[0].source in (relay.holder, "")
        await reader_reg.release(slot_lease)
        await reader_reg.release(lease)
        await publisher.transport.aclose()  # only the relay holds the bytes now
        pulled = await Puller(reader_reg, FakeTransport(), host="h1").pull()
        assert all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(1).items())
        await relay_reg.withdraw(1, holder=relay.holder)
        assert (await reader_reg.acquire(1, ttl=10.0, holder="reader", host="h1")).source == ""


async def test_a_served_registry_caps_the_readers_of_a_versions_own_slot(tmp_path):
    """`registry serve --origin-cap 1`: while one reader's lease reads the trainer's slot, a
    second that asks for a source is refused until a relay offers, then placed there."""
    from weightpull.errors import NoSourceError

    keys = make_keys(
        tmp_path / "keys", ("publisher", "trainer"), ("reader", "relay"), ("reader", "first"), ("reader", "second")
    )
    served = ServedRegistry(tmp_path, keys=keys, args=("--origin-cap", "1"))
    served.start()
    try:
        trainer = connect_registry(served.address, **served.key("trainer"))
        relay_reg = connect_registry(served.address, **served.key("relay"))
        first = connect_registry(served.address, **served.key("first"))
        second = connect_registry(served.address, **served.key("second"))
        async with trainer, relay_reg, first, second:
            publisher = Publisher(trainer, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, digests=True)
            await publisher.publish(1, host_tensors(1))
            relay = Puller(relay_reg, FakeTransport(), host="h1")
            await relay.pull()  # its lease read the slot, and ended
            lease = await first.acquire(1, ttl=10.0, holder="first", host="h2")
            assert lease.source == ""  # the slot's one reader
            with pytest.raises(NoSourceError, match="full"):
                await second.acquire(1, ttl=10.0, holder="second", host="h3")
            await relay.offer(cap=1)
            assert (await second.acquire(1, ttl=10.0, holder="second", host="h3")).source == relay.holder
            await first.release(lease)
            assert (await first.acquire(1, ttl=10.0, holder="first", host="h2")).source == ""  # room again
    finally:
        served.stop()


def test_a_server_caps_only_a_registry_it_makes():
    from weightpull.drivers.zmq_registry.server import RegistryServer
    from weightpull.errors import InvalidArgumentError
    from weightpull.registry import InProcessRegistry

    server = RegistryServer(insecure_dev=True, origin_cap=2)
    assert [s.cap for s in server.machine.relays.sources(1)] == [2]  # the slot's, with nothing offered
    with pytest.raises(InvalidArgumentError, match="origin_cap"):
        RegistryServer(insecure_dev=True, registry=InProcessRegistry(), origin_cap=2)
