import anyio
import pytest

from tests.conftest import autojump, host_tensors
from weightpull.errors import AgentFailedError, ApplyError, InvalidArgumentError, TornReadError, VersionWaitTimeoutError
from weightpull.rl.agent import PauseMode, UpdateAgent

pytestmark = pytest.mark.anyio


class FakeEngine:
    """An engine whose weights are the bytes of the version last applied. Prefetch is a
    real pull over the fake transport; `events` records what the agent drove."""

    def __init__(self, world, **puller):
        self.clock = world.clock
        self.puller = world.puller(holder="engine", **puller)
        self.events: list[tuple] = []
        self.weights: dict[str, bytes] = {}
        self.paused = False
        self.fail_apply: set[int] = set()
        self.restores = False  # a failed apply gives back the last good version
        self.serving: int | None = None

    async def prefetch(self, version):
        self.events.append(("prefetch", version))
        self.pulled = await self.puller.pull(version)
        assert not self.paused  # generation goes on while the copy is made

    async def pause(self, mode):
        self.events.append(("pause", mode))
        self.paused = True

    async def apply(self, version):
        assert self.paused and self.pulled.version == version
        self.events.append(("apply", version))
        if version in self.fail_apply:
            raise ApplyError(f"v{version} broke", version=version, restored=self.serving if self.restores else None)
        self.weights = {p.spec.name: bytes(self.pulled.view(p.spec.name)) for p in self.pulled.layout.placements}
        self.serving = version

    async def label(self, version):
        self.events.append(("label", version))

    async def resume(self):
        self.events.append(("resume",))
        self.paused = False


async def publish_each(world, publisher, versions, every=1.0):
    for v in versions:
        await publisher.publish(v, host_tensors(v))
        await world.clock.sleep(every)


async def test_the_first_version_always_then_every_min_version_lag(world):
    publisher, engine = world.publisher(num_slots=3), FakeEngine(world)
    agent = UpdateAgent("r0", world.registry, engine, min_version_lag=2, pause_mode="wait", clock=world.clock)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        await publish_each(world, publisher, range(1, 7))
        tg.cancel_scope.cancel()
    assert agent.stats.applied == [1, 3, 5]
    assert engine.events[:5] == [("prefetch", 1), ("pause", PauseMode.WAIT), ("apply", 1), ("label", 1), ("resume",)]
    assert engine.weights == {n: t.data for n, t in host_tensors(5).items()}
    assert (await world.registry.status()).serving == {"r0": 5}
    assert len(agent.stats.pause_s) == 3


async def test_wait_for_version_loads_it_now_whatever_the_lag(world):
    publisher, engine = world.publisher(num_slots=3), FakeEngine(world)
    agent = UpdateAgent("r0", world.registry, engine, min_version_lag=10, clock=world.clock)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        await publish_each(world, publisher, [1, 2, 3])
        assert agent.serving == 1
        assert await agent.wait_for_version(3, timeout=5) == 3
        with pytest.raises(VersionWaitTimeoutError):
            await agent.wait_for_version(4, timeout=5)
        tg.cancel_scope.cancel()


async def test_a_torn_pull_never_reaches_the_engine(world):
    publisher = world.publisher(num_slots=3)
    transport = world.transport()
    engine = FakeEngine(world, transport=transport, ttl=1.0)
    agent = UpdateAgent("r0", world.registry, engine, clock=world.clock)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        await publisher.publish(1, host_tensors(1))
        transport.faults.tear_reads, transport.faults.freeze = 1, 5.0  # past the lease
        tg.start_soon(agent.run)
        assert await agent.wait_for_version(1, timeout=10) == 1
        tg.cancel_scope.cancel()
    assert agent.stats.pull_failures == agent.stats.torn_reads == 1
    assert engine.events.count(("prefetch", 1)) == 2 and engine.events.count(("apply", 1)) == 1
    assert engine.weights == {n: t.data for n, t in host_tensors(1).items()}


async def test_a_pull_that_keeps_failing_fails_the_agent(world):
    publisher = world.publisher()
    transport = world.transport()
    engine = FakeEngine(world, transport=transport, ttl=1.0)
    agent = UpdateAgent("r0", world.registry, engine, max_pull_attempts=2, clock=world.clock)
    await publisher.publish(1, host_tensors(1))
    transport.faults.tear_reads, transport.faults.freeze = 100, 5.0
    async with autojump(world.clock):
        with pytest.raises(TornReadError):
            await agent.run()
    assert ("apply", 1) not in engine.events


async def test_a_version_whose_source_is_gone_is_skipped_for_the_next(world):
    """The trainer's process died with v1's slot: v1 can never be read, so the agent
    waits for a newer version rather than failing or retrying v1 in a loop."""
    dead, engine = world.publisher(), FakeEngine(world)
    agent = UpdateAgent("r0", world.registry, engine, max_pull_attempts=1, clock=world.clock)
    result = await dead.publish(1, host_tensors(1))
    dead.transport.deregister(dead.slots[result.slot].region)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        await world.clock.sleep(5)
        assert agent.serving is None and agent.failure is None
        assert engine.events.count(("prefetch", 1)) == 1  # tried once, not in a loop
        await world.publisher(name="restarted").publish(2, host_tensors(2))
        assert await agent.wait_for_version(2, timeout=5) == 2
        tg.cancel_scope.cancel()
    assert agent.stats.applied == [2] and agent.stats.pull_failures == 1


async def test_a_failed_apply_leaves_the_replica_paused_and_fails_the_agent_and_its_waiters(world):
    publisher, engine = world.publisher(num_slots=3), FakeEngine(world)
    engine.fail_apply = {2}
    agent = UpdateAgent("r0", world.registry, engine, clock=world.clock)
    raised: list[BaseException] = []

    async def run():
        try:
            await agent.run()
        except ApplyError as exc:
            raised.append(exc)

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(run)
        await publisher.publish(1, host_tensors(1))
        assert await agent.wait_for_version(1) == 1
        await publisher.publish(2, host_tensors(2))
        with pytest.raises(AgentFailedError) as waited:  # not left waiting
            await agent.wait_for_version(2)
    assert isinstance(waited.value.__cause__, ApplyError) and raised == [waited.value.__cause__]
    assert engine.paused and agent.serving == 1 and engine.events[-1] == ("apply", 2)
    with pytest.raises(AgentFailedError):
        await agent.wait_changed()


async def test_a_failed_apply_that_restored_the_last_good_version_serves_it_again_and_takes_the_next(world):
    publisher, engine = world.publisher(num_slots=3), FakeEngine(world)
    engine.fail_apply, engine.restores = {2}, True
    agent = UpdateAgent("r0", world.registry, engine, clock=world.clock)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(agent.run)
        await publisher.publish(1, host_tensors(1))
        assert await agent.wait_for_version(1) == 1
        await publisher.publish(2, host_tensors(2))
        while agent.stats.apply_failures == 0:
            await agent.wait_changed()
        assert not engine.paused and agent.serving == 1  # resumed on v1, still reported as v1
        assert engine.weights == {n: t.data for n, t in host_tensors(1).items()}
        assert (await world.registry.status()).serving == {"r0": 1}
        with pytest.raises(VersionWaitTimeoutError):  # v2 is not tried again
            await agent.wait_for_version(2, timeout=5)
        await publisher.publish(3, host_tensors(3))
        assert await agent.wait_for_version(2, timeout=5) == 3
        tg.cancel_scope.cancel()
    assert engine.events.count(("apply", 2)) == 1 and agent.stats.applied == [1, 3]
    assert "v2: v2 broke" in agent.stats.last_apply_error
    metrics = agent.metrics()
    assert metrics["agent/apply_failures"] == 1 and metrics["agent/serving_version"] == 3
    assert metrics["agent/versions_behind"] == 0 and metrics["agent/updates"] == 2


async def test_repeated_apply_failures_fail_the_agent(world):
    publisher, engine = world.publisher(num_slots=3), FakeEngine(world)
    engine.fail_apply, engine.restores = {2, 3}, True
    agent = UpdateAgent("r0", world.registry, engine, max_apply_failures=2, clock=world.clock)
    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publish_each, world, publisher, [1, 2, 3])
        with pytest.raises(ApplyError):
            await agent.run()
        tg.cancel_scope.cancel()
    assert agent.stats.apply_failures == 2 and agent.serving == 1 and isinstance(agent.failure, ApplyError)
    assert agent.failure.version == 3 and engine.paused  # the second failure is not resumed


@pytest.mark.parametrize(
    "kw", [{"min_version_lag": 0}, {"pause_mode": "later"}, {"max_pull_attempts": 0}, {"max_apply_failures": 0}]
)
def test_bad_settings_are_refused(world, kw):
    with pytest.raises(InvalidArgumentError):
        UpdateAgent("r0", world.registry, FakeEngine(world), **kw)
