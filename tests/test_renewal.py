"""Lease renewal paced by the registry's clock: a reader whose own clock runs at another
rate (r local seconds per registry second) keeps its lease through a read of many TTLs
and renews about as often as `renew_every` of the registry's seconds, not more. On a
pair of fake clocks, with the old pacing (a fixed local sleep) as the control; and
against a served registry in another process."""

from __future__ import annotations

import math
from itertools import pairwise

import anyio
import pytest

from weightpull import FakeClock, InProcessRegistry, Lease, Publisher, Puller, TornReadError
from weightpull.clock import MonotonicClock, ScaledClock
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio

RATES = (0.25, 0.5, 2.0, 4.0)
EPS = 1e-6


class Witness(InProcessRegistry):
    """An in-process registry that notes, on its own clock, each grant and what was left
    of the lease it renewed."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__(clock)
        self.grants: list[float] = []  # registry times of the acquire and each renewal
        self.left: list[float] = []  # registry seconds the renewed lease had left

    async def acquire(self, *args, **kw) -> Lease:
        lease = await super().acquire(*args, **kw)
        self.grants.append(self.clock.now())
        return lease

    async def renew(self, lease: Lease, *args, **kw) -> Lease:
        self.left.append(lease.expires_at - self.clock.now())
        renewed = await super().renew(lease, *args, **kw)
        self.grants.append(self.clock.now())
        return renewed


def gaps_of(times: list[float]) -> list[float]:
    return [b - a for a, b in pairwise(times)]


TTL = 5.0
SECONDS = 30.0  # a read of six TTLs, in registry seconds


async def slow_pull(rate: float, **puller_kw) -> tuple[Witness, FakeClock, object]:
    """One pull of ~SECONDS registry seconds, by a puller whose clock runs at `rate`."""
    clock = FakeClock()
    registry = Witness(clock)
    fabric = FakeFabric()
    publisher = Publisher(
        registry, FakeTransport(clock=clock, fabric=fabric), clock=clock, rollout_dtype=None, bucket_bytes=1024
    )
    await publisher.publish(1, host_tensors(1))
    nbytes = sum(len(t.data) for t in host_tensors(1).values())
    transport = FakeTransport(clock=clock, fabric=fabric, faults=FakeFaults(bandwidth=nbytes / SECONDS))
    puller = Puller(registry, transport, ttl=TTL, clock=ScaledClock(clock, rate), stall_timeout=None, **puller_kw)
    torn: list[TornReadError] = []
    async with autojump(clock):
        try:
            pulled = await puller.pull()
        except TornReadError as exc:  # raised out here, not in the autojump's group
            torn.append(exc)
    if torn:
        raise torn[0]
    assert bytes(pulled.view("t2")) == host_tensors(1)["t2"].data
    assert pulled.renewals == len(registry.grants) - 1
    return registry, clock, pulled


def check_paced(registry: Witness, clock: FakeClock, interval: float) -> None:
    """Every renewal came within `interval` registry seconds of the grant before (so it
    found the TTL less `interval` left, or more), and none much sooner than needed."""
    duration = clock.now() - registry.grants[0]
    assert duration >= SECONDS - EPS
    gaps = gaps_of(registry.grants)
    assert max(gaps) <= interval + EPS, gaps
    assert min(registry.left) >= TTL - interval - EPS
    # One early renewal measures the rate; then one per interval of the registry's time.
    assert len(gaps) <= math.ceil(duration / interval) + 1, gaps


@pytest.mark.parametrize("rate", RATES)
async def test_a_reader_with_a_skewed_clock_keeps_its_lease(rate):
    registry, clock, pulled = await slow_pull(rate)
    check_paced(registry, clock, TTL / 3)
    # The first renewal comes early, after an eighth of the interval on a local clock
    # assumed eight times slower than the registry's; the rest are a full interval apart.
    first = registry.grants[1] - registry.grants[0]
    assert first == pytest.approx(TTL / 3 / 8 / rate)
    gaps = gaps_of(registry.grants[1:])
    assert gaps and all(g == pytest.approx(TTL / 3) for g in gaps)


@pytest.mark.parametrize("rate", RATES)
async def test_renew_every_is_counted_in_registry_seconds(rate):
    registry, clock, _ = await slow_pull(rate, renew_every=1.0)
    check_paced(registry, clock, 1.0)
    assert all(g == pytest.approx(1.0) for g in gaps_of(registry.grants[1:]))


class OldPacer:
    """The pacing this replaced: a fixed `renew_every` of local sleep between renewals."""

    def __init__(self, renew_every, ttl, lease, sent, received) -> None:
        self.renew_every = renew_every
        self.due = sent + renew_every

    def granted(self, lease, sent, received) -> None:
        self.due = sent + self.renew_every

    def failed(self, sent) -> None:
        self.granted(None, sent, None)


@pytest.mark.parametrize("rate", RATES)
async def test_the_old_pacing_fails_these_checks(rate, monkeypatch):
    """Control: with a fixed local sleep a slow clock renews too late (at r=0.25, after
    the lease lapsed: the copy is rejected) and a fast one far too often."""
    import weightpull.leasing

    monkeypatch.setattr(weightpull.leasing, "Pacer", OldPacer)
    if rate < 1 / 3:
        with pytest.raises(TornReadError):
            await slow_pull(rate)
        return
    registry, clock, _ = await slow_pull(rate)
    with pytest.raises(AssertionError):
        check_paced(registry, clock, TTL / 3)


class Odd(Witness):
    """A registry whose renewals report registry times that make no sense."""

    def __init__(self, clock: FakeClock, replies) -> None:
        super().__init__(clock)
        self.replies = iter(replies)

    async def renew(self, lease: Lease, *args, **kw) -> Lease:
        renewed = await super().renew(lease, *args, **kw)
        reply = next(self.replies, None)
        return renewed if reply is None else Lease(renewed.id, renewed.version, renewed.holder, *reply(renewed))


@pytest.mark.parametrize(
    "reply",
    [
        lambda lease: (lease.ttl, lease.expires_at + 1e9),  # the registry's time leaps ahead: renew at the floor
        lambda lease: (lease.ttl, 0.0),  # it goes back
        lambda lease: (1e-9, lease.expires_at),  # a tiny TTL
        lambda lease: (math.nan, math.inf),
    ],
    ids=["leap", "back", "tiny-ttl", "nan"],
)
async def test_odd_replies_neither_stall_nor_spin_the_renewals(reply):
    """Whatever a registry's grants say, the puller renews at least once per `renew_every`
    times the fastest rate it believes (8), and at most once per an eighth of it."""
    clock = FakeClock()
    registry = Odd(clock, [reply] * 3)
    fabric = FakeFabric()
    await Publisher(
        registry, FakeTransport(clock=clock, fabric=fabric), clock=clock, rollout_dtype=None, bucket_bytes=1024
    ).publish(1, host_tensors(1))
    transport = FakeTransport(clock=clock, fabric=fabric, faults=FakeFaults(delay=60.0))
    puller = Puller(registry, transport, ttl=TTL, renew_every=1.0, clock=clock, stall_timeout=None)
    async with autojump(clock):
        pulled = await puller.pull()
    gaps = gaps_of(registry.grants)
    assert all(1 / 8 - EPS <= g <= 1.0 + EPS for g in gaps), gaps
    assert 60 <= pulled.renewals <= 60 * 8 + 1


# -- a served registry, in another process -----------------------------------------------


@pytest.mark.filterwarnings("ignore:a shared secret:DeprecationWarning")  # what tests/served.py serves with
@pytest.mark.parametrize("rate", [0.25, 4.0])
async def test_a_skewed_reader_keeps_its_lease_on_a_served_registry(rate, tmp_path):
    """The registry judges on its process's monotonic clock; this reader's puller sleeps
    on a clock running at `rate`. A read of over three TTLs holds its lease. (At r=0.25
    the old pacing slept 1.07 s of real time between renewals, past the 0.8 s TTL; at r=4
    it renewed four times as often as needed.)"""
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    from .served import SECRET, ServedRegistry

    server = ServedRegistry(tmp_path)
    server.start()
    try:
        fabric = FakeFabric()
        trainer = ZmqRegistry(server.address, secret=SECRET, timeout=0.5, retry_for=5.0)
        replica = ZmqRegistry(server.address, secret=SECRET, timeout=0.5, retry_for=5.0)
        publisher = Publisher(
            trainer, FakeTransport(fabric=fabric), rollout_dtype=None, bucket_bytes=1024, name="trainer"
        )
        await publisher.publish(1, host_tensors(1))
        ttl, seconds = 0.8, 2.6
        nbytes = sum(len(t.data) for t in host_tensors(1).values())
        slow = FakeTransport(fabric=fabric, faults=FakeFaults(bandwidth=nbytes / seconds))
        puller = Puller(replica, slow, holder="replica-0", ttl=ttl, clock=ScaledClock(MonotonicClock(), rate))
        real = MonotonicClock()
        started = real.now()
        pulled = await puller.pull()
        took = real.now() - started
        assert took >= 3 * ttl
        assert bytes(pulled.view("t2")) == host_tensors(1)["t2"].data
        # About every ttl/3 of real time, after a first early one (latency shortens the
        # sleeps a little, never lengthens them); at least once a TTL, or it had lapsed.
        assert int(took / ttl) <= pulled.renewals <= 2 * took / (ttl / 3) + 2
        assert (await replica.status()).leases == ()
        await puller.aclose()
        await publisher.aclose()
        for reg in (trainer, replica):
            await reg.aclose()
    finally:
        server.stop()
    await anyio.lowlevel.checkpoint()
