"""A pull whose source lands no byte for `stall_timeout` ends with `NoProgressError`; a
slow source whose reads keep landing does not. On a fake clock with the fake and faulty
drivers, and once over nixl between two processes, with a publisher that does not serve."""

import json
import subprocess
import sys
import time

import anyio
import pytest

from weightpull import (
    FakeClock,
    InProcessRegistry,
    InvalidArgumentError,
    Manifest,
    NoProgressError,
    Publisher,
    Puller,
    PullError,
    RegistryUnavailableError,
    TornReadError,
    create_transport,
)
from weightpull.clock import MonotonicClock, ScaledClock
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport
from weightpull.drivers.faulty import Faults, FaultyTransport

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio


async def live_leases(world):
    return (await world.registry.status()).leases


async def test_a_source_that_lands_nothing_ends_the_pull(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(world.transport(faults=FakeFaults(delay=1000.0)), stall_timeout=30.0)
    async with autojump(world.clock):
        with pytest.raises(NoProgressError, match=r"no read of v1 landed in 30 s \(0 of \d+ bytes") as info:
            await puller.pull()
    assert isinstance(info.value, PullError) and isinstance(info.value, TimeoutError)
    assert 30 <= world.clock.now() < 31
    assert await live_leases(world) == () and puller.mirror_version is None
    assert puller.metrics()["pull/stalls"] == 1 and puller.metrics()["pull/failed"] == 1


async def test_the_default_bound_is_thirty_seconds(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(world.transport(faults=FakeFaults(delay=1000.0)))
    async with autojump(world.clock):
        with pytest.raises(NoProgressError):
            await puller.pull()
    assert world.clock.now() == pytest.approx(30.0)


SEVEN = (1000,) * 7  # seven tensors, a bucket each


async def test_a_slow_source_that_keeps_landing_is_no_error(world):
    """Seven buckets land one every 20 s: a pull of 140 s, never 30 s without progress."""
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1, SEVEN))
    puller = world.puller(world.transport(faults=FakeFaults(bandwidth=1000 / 20.0)), stall_timeout=30.0)
    async with autojump(world.clock):
        pulled = await puller.pull()
    assert len(pulled.layout.buckets) == 7 and pulled.seconds == pytest.approx(140)
    assert bytes(pulled.view("t6")) == host_tensors(1, SEVEN)["t6"].data
    assert puller.metrics()["pull/stalls"] == 0


async def test_progress_counts_per_read_so_one_bucket_may_not_outlast_the_bound(world):
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1, SEVEN))
    puller = world.puller(world.transport(faults=FakeFaults(bandwidth=1000 / 40.0)), stall_timeout=30.0)
    async with autojump(world.clock):
        with pytest.raises(NoProgressError, match=r"landed in 30 s \(0 of 7000 bytes"):
            await puller.pull()
    assert world.clock.now() == pytest.approx(30)  # the first bucket needs 40 s


async def test_the_faulty_wrapper_stalls_any_driver(world):
    await world.publisher().publish(1, host_tensors(1))
    transport = FaultyTransport(world.transport(), Faults(delay=1000.0), clock=world.clock)
    puller = world.puller(transport, stall_timeout=5.0)
    async with autojump(world.clock):
        with pytest.raises(NoProgressError):
            await puller.pull()
        transport.faults.delay = 0.0
        pulled = await puller.pull()  # the source moves again: the next pull is whole
    assert bytes(pulled.view("t1")) == host_tensors(1)["t1"].data


async def test_no_bound_waits_as_long_as_the_source_takes(world):
    await world.publisher().publish(1, host_tensors(1))
    puller = world.puller(world.transport(faults=FakeFaults(delay=1000.0)), stall_timeout=None)
    async with autojump(world.clock):
        await puller.pull()
    assert world.clock.now() >= 1000


class Batched(FakeTransport):
    """A driver with a `read_many` of its own: its reads land together, after `wait` s."""

    wait = 0.0

    async def read_many(self, reads):
        await self.clock.sleep(self.wait)
        for r in reads:
            await self.read(*r)


async def test_a_batching_driver_counts_its_reads_as_landing_together(world):
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1))
    transport = Batched(clock=world.clock, fabric=world.fabric)
    puller = world.puller(transport, stall_timeout=10.0)
    transport.wait = 9.0
    async with autojump(world.clock):
        await puller.pull()
        transport.wait = 11.0
        with pytest.raises(NoProgressError):
            await puller.pull()


def test_the_bound_must_be_positive(world):
    for bad in (0, -1.0):
        with pytest.raises(InvalidArgumentError, match="stall_timeout"):
            world.puller(stall_timeout=bad)


# -- a reader's clock at another rate than the registry's -------------------------------------

RATES = (0.1, 0.25, 4.0, 10.0)  # local seconds per registry second


def skewed(world, rate, **kw):
    """A puller whose clock runs at `rate`; the registry and the transport keep the true time."""
    transport = kw.pop("transport", None) or world.transport()
    return Puller(world.registry, transport, clock=ScaledClock(world.clock, rate), **{"ttl": 5.0, **kw})


@pytest.mark.parametrize("rate", RATES)
async def test_a_skewed_reader_of_a_slow_source_keeps_pulling(world, rate):
    """Buckets land every 20 s of the registry's time and the bound is 30 s: whatever rate
    the reader's clock runs at, no stall (at 10x the old watchdog ended it after 3 s)."""
    await world.publisher(bucket_bytes=1024).publish(1, host_tensors(1, SEVEN))
    slow = world.transport(faults=FakeFaults(bandwidth=1000 / 20.0))
    puller = skewed(world, rate, transport=slow, stall_timeout=30.0)
    async with autojump(world.clock):
        pulled = await puller.pull()
    assert world.clock.now() == pytest.approx(140)
    assert bytes(pulled.view("t6")) == host_tensors(1, SEVEN)["t6"].data
    assert puller.metrics()["pull/stalls"] == 0


@pytest.mark.parametrize("rate", RATES)
async def test_a_skewed_reader_still_ends_a_real_stall_on_time(world, rate):
    """A source that lands nothing ends the pull after the bound, in the registry's
    seconds: never before it, and at most a renewal interval (ttl/3) after it (at 0.1x
    the old watchdog waited 300 s)."""
    await world.publisher().publish(1, host_tensors(1))
    stuck = world.transport(faults=FakeFaults(delay=1000.0))
    puller = skewed(world, rate, transport=stuck, stall_timeout=30.0)
    async with autojump(world.clock):
        with pytest.raises(NoProgressError, match=r"no read of v1 landed in 30 s"):
            await puller.pull()
    assert 30 <= world.clock.now() <= 30 + 5.0 / 3
    assert await live_leases(world) == ()


class Silent(InProcessRegistry):
    """A registry whose renewals fail for a while: its time cannot be read."""

    failing = False

    async def renew(self, lease):
        if self.failing:
            raise RegistryUnavailableError("no answer (test)")
        return await super().renew(lease)


async def test_a_registry_that_stops_answering_leaves_the_local_clock_to_judge():
    """Without grants the watchdog counts local time, taken as at most 8x fast: a stuck
    read still ends (the lease has lapsed by then anyway, and the copy would be torn)."""
    clock = FakeClock()
    registry = Silent(clock)
    fabric = FakeFabric()
    await Publisher(registry, FakeTransport(clock=clock, fabric=fabric), rollout_dtype=None).publish(1, host_tensors(1))
    stuck = FakeTransport(clock=clock, fabric=fabric, faults=FakeFaults(delay=1000.0))
    puller = Puller(registry, stuck, ttl=5.0, clock=ScaledClock(clock, 2.0), stall_timeout=10.0)
    registry.failing = True
    async with autojump(clock):
        with pytest.raises((NoProgressError, TornReadError, RegistryUnavailableError)):
            await puller.pull()
    assert clock.now() <= 10.0 * 8 / 2.0 + 1


@pytest.mark.filterwarnings("ignore:a shared secret:DeprecationWarning")  # what tests/served.py serves with
async def test_a_fast_reader_of_a_served_registry_keeps_pulling(tmp_path):
    """The case as a user met it: a served registry in its own process, a reader whose
    clock runs 10x fast and a read that takes ~1.5 s of real time against a bound of 4 s
    of the registry's time (the old watchdog ended it after 0.4 s); and a source that
    lands nothing still ends in NoProgressError after 4 s of real time, not 0.4."""
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    from .served import SECRET, ServedRegistry

    server = ServedRegistry(tmp_path)
    server.start()
    try:
        fabric = FakeFabric()
        async with (
            ZmqRegistry(server.address, secret=SECRET, timeout=1.0) as trainer,
            ZmqRegistry(server.address, secret=SECRET, timeout=1.0) as replica,
        ):
            publisher = Publisher(trainer, FakeTransport(fabric=fabric), rollout_dtype=None, name="trainer")
            await publisher.publish(1, host_tensors(1))
            fast = ScaledClock(MonotonicClock(), 10.0)
            slow = FakeTransport(fabric=fabric, faults=FakeFaults(delay=1.5))
            puller = Puller(replica, slow, holder="replica-0", ttl=3.0, clock=fast, stall_timeout=4.0)
            pulled = await puller.pull()
            assert bytes(pulled.view("t2")) == host_tensors(1)["t2"].data
            stuck = FakeTransport(fabric=fabric, faults=FakeFaults(delay=1000.0))
            puller = Puller(replica, stuck, holder="replica-1", ttl=3.0, clock=fast, stall_timeout=4.0)
            started = time.monotonic()
            with pytest.raises(NoProgressError):
                await puller.pull()
            assert 4.0 <= time.monotonic() - started < 4.0 + 1.0 + 1.0
            await publisher.aclose()
    finally:
        server.stop()


# -- nixl, two processes ------------------------------------------------------------------------

PUBLISHER = """
import json, sys, anyio
from weightpull import HostTensor, InProcessRegistry, Publisher, create_transport

async def main(serve):
    registry = InProcessRegistry()
    async with create_transport("nixl") as transport:
        publisher = Publisher(registry, transport, rollout_dtype=None)

        async def publish():
            await publisher.publish(1, {"w": HostTensor("uint8", (1 << 20,), bytes(range(256)) * 4096)})
            print(json.dumps((await registry.get(1)).to_dict()), flush=True)
            await anyio.to_thread.run_sync(sys.stdin.read)  # until the test is done

        if serve:
            async with publisher:  # serves the transport's progress while the block runs
                await publish()
        else:
            await publish()  # forgets to serve: no reader's first read ever completes
            await publisher.aclose()

anyio.run(main, sys.argv[1] == "serve")
"""


@pytest.mark.parametrize("serve", [False, True], ids=["not-serving", "serving"])
async def test_nixl_pull_from_a_publisher_process(serve):
    pytest.importorskip("numpy")
    if create_transport("nixl").unavailable_reason():
        pytest.skip("nixl cannot load here")
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, "serve" if serve else "idle"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = await anyio.to_thread.run_sync(proc.stdout.readline)
        assert line, "the publisher process died"
        manifest = Manifest.from_dict(json.loads(line))
        registry = InProcessRegistry()
        await registry.begin(1, publisher=manifest.publisher, slot=manifest.slot)
        await registry.commit(manifest)
        async with create_transport("nixl") as transport:
            puller = Puller(registry, transport, stall_timeout=2.0)
            started = time.monotonic()
            if serve:
                pulled = await puller.pull()
                assert bytes(pulled.view("w")) == bytes(range(256)) * 4096
            else:
                with pytest.raises(NoProgressError, match=r"no read of v1 landed in 2 s \(0 of 1048576 bytes read\)"):
                    await puller.pull()
                assert time.monotonic() - started < 10
            await puller.aclose()
    finally:
        proc.stdin.close()
        proc.wait(30)
