"""A reader's TTL checked against the registry's round trip at the first acquire,
numbers that are not finite named as such, and a torn read that says why its lease
lapsed."""

import math

import anyio
import pytest

from weightpull import (
    HostTensor,
    InvalidArgumentError,
    LeaseSettings,
    Publisher,
    Puller,
    TornReadError,
    create_transport,
)
from weightpull.drivers.faulty import Faults, FaultyTransport
from weightpull.drivers.zmq_registry.client import ZmqRegistry
from weightpull.settings import MIN_TTL_ROUND_TRIPS, SlotSettings

from .conftest import autojump, host_tensors
from .served import ServedRegistry

pytestmark = pytest.mark.anyio


class Distant:
    """The registry behind a link: each call the lease client times takes `rtt` seconds
    of the readers' clock (the acquire `acquire_rtt`, if given)."""

    def __init__(self, inner, clock, rtt: float, acquire_rtt: float | None = None) -> None:
        self.inner, self.clock, self.rtt = inner, clock, rtt
        self.acquire_rtt = rtt if acquire_rtt is None else acquire_rtt
        self.calls: list[str] = []
        self.leases: list = []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    async def acquire(self, *args, **kw):
        self.calls.append("acquire")
        await self.clock.sleep(self.acquire_rtt)
        lease = await self.inner.acquire(*args, **kw)
        self.leases.append(lease)
        return lease

    async def is_valid(self, lease):
        self.calls.append("is_valid")
        await self.clock.sleep(self.rtt)
        return await self.inner.is_valid(lease)


async def live_leases(world) -> int:
    return len((await world.registry.status()).leases)


async def test_a_ttl_below_a_few_round_trips_is_refused_at_the_first_acquire_naming_the_round_trip(world):
    await world.publisher().publish(1, host_tensors(1))
    registry = Distant(world.registry, world.clock, rtt=0.002)
    puller = Puller(registry, world.transport(), ttl=0.001, clock=world.clock)  # accepted as made: no registry yet
    async with autojump(world.clock):
        with pytest.raises(InvalidArgumentError) as info:
            await puller.pull()
    message = str(info.value)
    assert f"ttl=0.001 s is below {MIN_TTL_ROUND_TRIPS} round trips to the registry" in message
    assert "one took 2 ms here" in message and "Pass ttl= of at least 0.01 s" in message
    assert await live_leases(world) == 0  # the lease it was granted is released
    assert puller.metrics()["pull/torn_reads"] == 0  # refused, not torn
    assert puller.leases.round_trip is None  # the next acquire checks again


async def test_a_ttl_of_a_few_round_trips_passes_with_no_call_beyond_the_acquire(world):
    await world.publisher().publish(1, host_tensors(1))
    registry = Distant(world.registry, world.clock, rtt=0.002)
    puller = Puller(registry, world.transport(), ttl=MIN_TTL_ROUND_TRIPS * 0.002 * 2, clock=world.clock)
    async with autojump(world.clock):
        assert (await puller.pull()).version == 1
    assert puller.leases.round_trip == pytest.approx(0.002)
    assert registry.calls == ["acquire", "is_valid"]  # the acquire timed; is_valid: the final check alone


async def test_one_slow_acquire_does_not_refuse_a_good_ttl_and_the_measure_is_made_once(world):
    await world.publisher().publish(1, host_tensors(1))
    registry = Distant(world.registry, world.clock, rtt=0.001, acquire_rtt=0.05)  # each acquire slow, the rest not
    puller = Puller(registry, world.transport(), ttl=0.1, clock=world.clock)
    async with autojump(world.clock):
        assert (await puller.pull()).version == 1
        assert puller.leases.round_trip == pytest.approx(0.001)  # the least of the acquire and one probe
        assert registry.calls == ["acquire", "is_valid", "is_valid"]  # a probe, then the final check
        await puller.pull()
    assert registry.calls[3:] == ["acquire", "is_valid"]  # no second measure


@pytest.mark.parametrize(
    ("kw", "named", "what"),
    [
        ({"ttl": math.nan}, "ttl", "not a number"),
        ({"ttl": math.inf}, "ttl", "infinite"),
        ({"renew_every": math.nan}, "renew_every", "not a number"),
        ({"stall_timeout": math.inf}, "stall_timeout", "infinite"),
        ({"stall_timeout": -math.inf}, "stall_timeout", "infinite"),
    ],
)
def test_a_lease_number_that_is_not_finite_is_named_as_such_under_the_name_passed(world, kw, named, what):
    for make in (lambda: world.puller(**kw), lambda: LeaseSettings(**kw)):
        with pytest.raises(InvalidArgumentError) as info:
            make()
        message = str(info.value)
        assert message.startswith(f"{named} must be a finite number of seconds, got {kw[named]!r} ({what})")
        if named != "renew_every":
            assert "renew_every" not in message  # derived from ttl: never blamed for it


@pytest.mark.parametrize(
    ("kw", "named", "what"),
    [
        ({"wait_timeout": math.nan}, "wait_timeout", "not a number"),
        ({"wait_timeout": math.inf}, "wait_timeout", "infinite"),
        ({"poll_interval": math.inf}, "poll_interval", "infinite"),
    ],
)
def test_a_slot_number_that_is_not_finite_is_named_as_such(world, kw, named, what):
    for make in (lambda: world.publisher(**kw), lambda: SlotSettings(**kw)):
        with pytest.raises(InvalidArgumentError, match=rf"^{named} must be a finite number of seconds, .*\({what}\)"):
            make()


async def test_a_torn_read_whose_lease_lapsed_for_want_of_a_renewal_says_so_and_names_a_longer_ttl(world):
    await world.publisher().publish(1, host_tensors(1))
    faults = Faults(tear_reads=1, freeze=60.0)  # the reader frozen mid-read, past its TTL: no renewal goes out
    puller = world.puller(FaultyTransport(world.transport(), faults, clock=world.clock), ttl=5.0)
    async with autojump(world.clock):
        with pytest.raises(TornReadError) as info:
            await puller.pull()
    message = str(info.value)
    assert "the copy may mix versions and was rejected" in message
    assert "it lapsed for want of a renewal in time" in message and "against its ttl=5 s" in message
    assert "Pass a longer ttl=" in message


async def test_a_torn_read_whose_lease_the_registry_ended_says_a_longer_ttl_would_not_help(world):
    await world.publisher().publish(1, host_tensors(1))
    registry = Distant(world.registry, world.clock, rtt=0.0)
    faults = Faults(delay=4.0)  # a read outlasting several renewals, each in time
    puller = Puller(registry, FaultyTransport(world.transport(), faults, clock=world.clock), ttl=3.0, clock=world.clock)

    async def released_elsewhere():  # another reader under the same holder name lets go of it
        while not registry.leases:
            await world.clock.sleep(0.01)
        await world.clock.sleep(2.5)
        await world.registry.release(registry.leases[0])

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(released_elsewhere)
        with pytest.raises(TornReadError) as info:
            await puller.pull()
    message = str(info.value)
    assert "the registry ended it" in message and "though it was renewed in time" in message
    assert "a longer ttl would not help" in message and "for want of a renewal" not in message


async def test_a_served_registry_refuses_the_ttl_of_issue_31_with_its_round_trip(tmp_path):
    """The user's case: `Puller(ttl=0.001)` over a served registry, whose round trip on
    loopback (0.5-0.8 ms measured here) makes a 1 ms lease lapse between renewals. A TTL
    of 10 us is below 5 round trips on any machine."""
    served = ServedRegistry(tmp_path, secret=None)  # --insecure-dev
    served.start()
    try:
        registry = ZmqRegistry(served.address)
        publisher = Publisher(registry, create_transport("fake"), rollout_dtype=None)
        await publisher.publish(1, {"w": HostTensor("uint8", (64,), bytes(64))})
        with pytest.raises(
            InvalidArgumentError, match=r"ttl=1e-05 s is below 5 round trips to the registry \(one took [\d.]+ ms"
        ):
            await Puller(registry, create_transport("fake"), ttl=1e-5).pull()
        assert not (await registry.status()).leases  # released before it was refused
        assert (await Puller(registry, create_transport("fake")).pull()).version == 1  # the default passes
        await registry.aclose()
    finally:
        served.stop()
