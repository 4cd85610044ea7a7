"""A wait on a version ends when the publisher it waits on lapses, with a typed error
naming it, at the registry's liveness deadline rather than the wait's own timeout: in
process on a fake clock, and through a served registry. A publisher slow but alive ends
no wait. `wait_until_served` waits for every live replica and ends on one that leaves."""

from __future__ import annotations

import anyio
import pytest

import weightpull
from tests.conftest import World, autojump, host_tensors
from tests.test_agent import FakeEngine
from weightpull import FakeClock, InProcessRegistry, Manifest, plan_layout, wait_until_served
from weightpull.errors import (
    InvalidArgumentError,
    PublisherLapsedError,
    ReplicasLeftError,
    VersionStateError,
    VersionWaitTimeoutError,
)
from weightpull.layout import TensorSpec
from weightpull.rl.agent import LAPSE_POLL, UpdateAgent

pytestmark = pytest.mark.anyio

TTL = 0.5
LAYOUT = plan_layout([TensorSpec("w", "uint8", (8,))])


def registry(clock: FakeClock) -> InProcessRegistry:
    return InProcessRegistry(clock, liveness_ttl=TTL)


async def publish(reg, version: int, publisher: str = "trainer", step: int | None = None) -> None:
    number = await reg.begin(version, publisher=publisher, slot=version % 2)
    await reg.commit(Manifest(number, LAYOUT, "fake", b"{}", version % 2, publisher, step=step))


@pytest.mark.parametrize("line", [{"publisher": "trainer"}, {}], ids=["named-line", "default-line"])
async def test_a_wait_for_a_version_ends_at_the_publishers_lapse_naming_it(line):
    clock = FakeClock()
    reg = registry(clock)
    await publish(reg, 1)
    async with autojump(clock):
        with pytest.raises(PublisherLapsedError, match="publisher 'trainer' lapsed") as caught:
            await reg.wait_for_version(2, timeout=60, **line)
    assert clock.now() == pytest.approx(TTL)  # at its lapse, not the wait's 60 s
    assert caught.value.publisher == "trainer"
    assert isinstance(caught.value, VersionWaitTimeoutError)  # old handlers of the timeout catch it
    # A wait begun once it lapsed ends at once too: what it waits on is gone.
    with pytest.raises(PublisherLapsedError):
        await reg.wait_for_version(2, timeout=60, **line)


async def test_a_publisher_slow_but_alive_ends_no_wait_and_its_version_comes():
    clock = FakeClock()
    reg = registry(clock)
    await publish(reg, 1)

    async def slow_trainer() -> None:
        for _ in range(8):  # 4 ttls of silence but for its heartbeat
            await clock.sleep(TTL / 2)
            await reg.keepalive(("trainer",))
        await publish(reg, 2)

    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(slow_trainer)
        manifest = await reg.wait_for_version(2, timeout=60, publisher="trainer")
    assert manifest.version == 2 and clock.now() == pytest.approx(4 * TTL)


async def test_a_wait_on_a_line_not_begun_waits_on_and_another_lines_lapse_ends_it_not():
    clock = FakeClock()
    reg = registry(clock)
    await publish(reg, 1, publisher="other")  # lapses at TTL: not the line waited on
    async with autojump(clock):
        with pytest.raises(VersionWaitTimeoutError) as caught:
            await reg.wait_for_version(1, timeout=3 * TTL, publisher="trainer")
    assert not isinstance(caught.value, PublisherLapsedError) and clock.now() == pytest.approx(3 * TTL)


async def test_a_wait_for_buckets_of_a_version_not_begun_ends_at_the_lapse():
    clock = FakeClock()
    reg = registry(clock)
    await publish(reg, 1)
    async with autojump(clock):
        with pytest.raises(PublisherLapsedError, match="'trainer' lapsed.*v2 will not come"):
            await reg.wait_for_buckets(2, 1, timeout=60, publisher="trainer")
    assert clock.now() == pytest.approx(TTL)


async def test_a_stream_waited_on_ends_aborted_at_the_lapse_naming_it():
    clock = FakeClock()
    reg = registry(clock)
    await reg.begin(1, publisher="trainer", slot=0)
    await reg.stream(Manifest(1, LAYOUT, "fake", b"{}", 0, "trainer"))
    async with autojump(clock):
        with pytest.raises(VersionStateError, match="ABORTED.*publisher 'trainer' lapsed"):
            await reg.wait_for_buckets(1, 1, timeout=60)
    assert clock.now() == pytest.approx(TTL)


async def test_a_borrow_with_wait_ends_at_the_lapse():
    world = World()
    world.registry = registry(world.clock)
    publisher = world.publisher(name="trainer")
    await publisher.publish(1, host_tensors(1))
    puller = world.puller(holder="r0")
    async with puller.borrow(wait=1.0) as lent:
        assert lent.version == 1
    async with autojump(world.clock):
        with pytest.raises(PublisherLapsedError, match="'trainer' lapsed"):
            async with puller.borrow(2, wait=60):
                pass
    assert world.clock.now() < 2 * TTL


async def test_the_update_agent_keeps_serving_through_the_lapse_and_its_waiters_are_told_by_name():
    world = World()
    world.registry = registry(world.clock)
    publisher = world.publisher(name="trainer")
    agent = UpdateAgent("r0", world.registry, FakeEngine(world), clock=world.clock)

    async with autojump(world.clock), anyio.create_task_group() as tg:
        await publisher.publish(1, host_tensors(1))
        tg.start_soon(agent.run)
        assert await agent.wait_for_version(1, timeout=5) == 1
        with pytest.raises(PublisherLapsedError, match="r0 cannot serve v2 .serving: 1.*'trainer' lapsed") as caught:
            await agent.wait_for_version(2, timeout=60)
        assert world.clock.now() < 60 and caught.value.publisher == "trainer"
        # No failure: it serves its version on, and a wait begun while the lapse lasts is told at once.
        assert agent.failure is None and agent.serving == 1 and agent.lapsed is not None
        told = world.clock.now()
        with pytest.raises(PublisherLapsedError, match="'trainer' lapsed"):
            await agent.wait_for_version(2, timeout=60)
        assert world.clock.now() - told <= LAPSE_POLL
        # Heard from again (a restarted trainer): the agent goes on to its next version.
        await publisher.publish(2, host_tensors(2))
        assert await agent.wait_for_version(2, timeout=10) == 2
        assert agent.lapsed is None and agent.failure is None
        tg.cancel_scope.cancel()


# -- the trainer's side: wait_until_served -------------------------------------------------------


async def test_wait_until_served_returns_once_every_live_replica_serves_it():
    clock = FakeClock()
    reg = registry(clock)

    async def replicas() -> None:
        await reg.report_serving("r0", 1)
        await reg.report_serving("r1", 1)
        await clock.sleep(0.2)
        await reg.report_serving("r0", 2)
        await clock.sleep(0.2)
        await reg.report_serving("r1", 3)

    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(replicas)
        served = await weightpull.wait_until_served(reg, 2, timeout=5, poll=0.05, clock=clock)
    assert served == {"r0": 2, "r1": 3}


async def test_wait_until_served_ends_naming_the_replicas_that_left():
    clock = FakeClock()
    reg = registry(clock)
    await reg.report_serving("r0", 1)
    await reg.report_serving("r1", 1)

    async def r0_beats() -> None:  # r0 stays alive, on v1; r1 dies silently
        while True:
            await clock.sleep(TTL / 2)
            await reg.keepalive(("r0",))

    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(r0_beats)
        with pytest.raises(ReplicasLeftError, match=r"'r1' \(serving v1\) left") as caught:
            await wait_until_served(reg, 2, timeout=60, poll=0.1, clock=clock)
        tg.cancel_scope.cancel()
    assert caught.value.replicas == ("r1",) and clock.now() < 2 * TTL


async def test_wait_until_served_times_out_clearly_with_no_replicas_or_one_behind():
    clock = FakeClock()
    reg = InProcessRegistry(clock)
    async with autojump(clock):
        with pytest.raises(VersionWaitTimeoutError, match="no replica reports serving anything after 1 s"):
            await wait_until_served(reg, 1, timeout=1, clock=clock)
        await reg.report_serving("r0", 1)
        with pytest.raises(VersionWaitTimeoutError, match=r"'r0' \(v1\) did not serve v2 within 1 s"):
            await wait_until_served(reg, 2, timeout=1, clock=clock)


@pytest.mark.parametrize(
    "bad",
    [{"version": -1}, {"version": True}, {"version": "2"}, {"timeout": -1}, {"timeout": float("inf")}, {"poll": 0}],
)
async def test_wait_until_served_refuses_bad_arguments(bad):
    args = {"version": 1, **bad}
    with pytest.raises(InvalidArgumentError):
        await wait_until_served(InProcessRegistry(), args.pop("version"), **args)


async def test_a_bad_publisher_name_to_wait_on_is_refused():
    with pytest.raises(InvalidArgumentError, match="publisher"):
        await registry(FakeClock()).wait_for_version(1, timeout=1, publisher="")


# -- served -----------------------------------------------------------------------------------


async def test_a_served_wait_ends_at_the_publishers_lapse_not_its_timeout():
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.client import ZmqRegistry
    from weightpull.drivers.zmq_registry.server import RegistryServer

    server = RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, liveness_ttl=TTL)
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve)
        trainer = ZmqRegistry(address, heartbeat=TTL / 5)
        reader = ZmqRegistry(address, heartbeat=TTL / 5)
        async with reader:
            async with trainer:
                await publish(trainer, 1)
                await anyio.sleep(2 * TTL)  # alive past its TTL: its heartbeat renews it
                assert (await reader.newest(publisher="trainer")).version == 1
            # The trainer is gone (its heartbeat stopped): the waiter is told within about its TTL.
            started = anyio.current_time()
            with pytest.raises(PublisherLapsedError, match="publisher 'trainer' lapsed"):
                await reader.wait_for_version(2, timeout=30, publisher="trainer")
            assert anyio.current_time() - started < 3 * TTL
            with pytest.raises(PublisherLapsedError):  # the default line's publisher, at once
                await reader.wait_for_buckets(2, 1, timeout=30)
            status = await reader.status()
            assert [lapse.name for lapse in status.lapsed] == ["trainer"]
            assert status.lapsed[0].ended == ("withdrew v1",)
        tg.cancel_scope.cancel()


@pytest.mark.parametrize("delay", [float("nan"), float("inf"), -1.0])
def test_an_agent_refuses_a_retry_delay_that_is_not_a_finite_number_of_seconds(delay):
    with pytest.raises(InvalidArgumentError, match="retry_delay must be a finite number"):
        UpdateAgent("r0", registry(FakeClock()), FakeEngine(World()), retry_delay=delay)
