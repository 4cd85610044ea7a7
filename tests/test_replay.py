"""The replay buffer on weight versions, the health check, and the sampling wait that
cannot hang: all on the fake clock."""

from __future__ import annotations

import anyio
import pytest

from tests.conftest import autojump
from weightpull.clock import FakeClock
from weightpull.errors import AgentFailedError, InvalidArgumentError, StaleSampleError
from weightpull.rl.dispatcher import Prompt
from weightpull.rl.health import Health, NoProducerError, Producer, agent_producers
from weightpull.rl.ledger import Ledger, MemoryStore
from weightpull.rl.replay import ReplayBuffer, Sampler
from weightpull.rl.staleness import Group, StalenessClock, Trajectory

pytestmark = pytest.mark.anyio


def group(gid: str, *starts: int) -> Group:
    return Group(gid, [Trajectory(gid, (1,), (v,), group=gid) for v in starts])


def test_a_groups_age_counts_from_its_oldest_start_and_one_clock_evicts_and_samples():
    clock = StalenessClock(max_staleness=1, now=3)
    buffer = ReplayBuffer(clock)
    assert buffer.add([group("old", 3, 1), group("a", 3, 3), group("b", 2, 3)]) == 3
    assert buffer.take(3) is None  # "old" started on v1: two versions behind, evicted first
    assert len(buffer) == 2
    assert buffer.metrics()["staleness/max"] == 1
    assert [g.id for g in buffer.take(2)] == ["b", "a"]  # oldest start first
    assert buffer.add([group("a", 3)]) == 0  # handed out: never again
    assert buffer.add([group("old", 3)]) == 1  # evicted, run again on fresh weights: taken in
    clock.advance(5)
    buffer.add([group("c", 3)])
    assert [g.id for g in buffer.evict()] == ["old", "c"]  # the clock moved: the same rule, everywhere


def test_the_sample_passes_the_clocks_check():
    clock = StalenessClock(max_staleness=2, now=2)
    buffer = ReplayBuffer(clock)
    buffer.add([group("a", 0)])
    (a,) = buffer.take(1)
    assert buffer.metrics([a]) == {
        "staleness/max": 2,
        "staleness/mean": 2.0,
        "staleness/stale_fraction": 0.0,
        "replay/size": 0,
    }
    with pytest.raises(StaleSampleError):
        clock.advance(3)
        clock.check([a])
    with pytest.raises(InvalidArgumentError, match="n >= 1"):
        buffer.take(0)


def test_health_names_what_became_of_each_producer():
    health = Health(timeout=5)
    producers = [Producer("replica-0", last_beat=0.0), Producer("replica-1", 9.0, failure="AgentFailedError('x')")]
    health.check(producers, now=4.0)
    with pytest.raises(NoProducerError, match=r"replica-0: silent for 6.0 s \(timeout 5 s\); replica-1: failed"):
        health.check(producers, now=6.0)
    health.check([], now=5.0, since=0.0)  # none yet: waited for one timeout
    with pytest.raises(NoProducerError, match="no rollout worker was heard from within 5 s"):
        health.check([], now=5.5, since=0.0)
    with pytest.raises(NoProducerError, match="the dispatcher failed"):
        health.check(producers, now=1.0, dispatcher_failure="RuntimeError('boom')")
    with pytest.raises(InvalidArgumentError, match="health timeout"):
        Health(0)


def test_agent_producers_are_alive_until_their_agent_fails():
    class Agent:
        def __init__(self, name, failure=None):
            self.name, self.failure = name, failure

    producers = agent_producers([Agent("a"), Agent("b", AgentFailedError("gone"))], now=7.0)
    assert [p.name for p in Health(1).alive(producers, now=7.0)] == ["a"]
    with pytest.raises(NoProducerError, match="b: failed"):
        Health(1).check(agent_producers([Agent("b", AgentFailedError("gone"))], 0.0), 0.0)


async def test_sampling_waits_for_rollout_and_fails_when_no_producer_is_left():
    clock = FakeClock()
    ledger = Ledger(MemoryStore(), max_inflight=8, clock=clock)
    staleness = StalenessClock(max_staleness=1)
    health = Health(timeout=2.0)

    def producers():
        return [Producer(w.name, w.last_beat, w.failure) for w in ledger.workers()]

    sampler = Sampler(ReplayBuffer(staleness), ledger.ready_groups, producers, health, clock=clock, poll_s=0.1)
    ledger.enqueue([Prompt(f"p{i}", 0, group=f"p{i}") for i in range(3)])

    async def worker(stop_after: int) -> None:
        for _ in range(stop_after):
            ledger.beat("w", 0)
            for e in ledger.claim("w", 0):
                await clock.sleep(0.5)  # generating
                ledger.complete("w", e.id, [Trajectory(e.id, (1,), (0,), group=e.group)])
            await clock.sleep(0.5)

    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(worker, 2)
        got = await sampler.sample(2)
        assert sorted(g.id for g in got.groups) == ["p0", "p1"] and got.waited_s == pytest.approx(1.5, abs=0.11)
        # The worker stops beating after two rounds: the third prompt never comes, and
        # the wait ends once the worker was silent past the timeout.
        with pytest.raises(NoProducerError, match=r"w: silent for 2\.\d s \(timeout 2 s\)"):
            await sampler.sample(1)
    assert clock.now() < 10


async def test_evicted_groups_are_handed_back_to_run_again():
    clock = FakeClock()
    ledger = Ledger(MemoryStore(), max_inflight=8, clock=clock)
    staleness = StalenessClock(max_staleness=0, now=1)
    ledger.enqueue([Prompt("old", 0, group="old"), Prompt("new", 1, group="new")])
    ledger.beat("w", 1)
    for e in ledger.claim("w", 1, limit=2):
        ledger.complete("w", e.id, [Trajectory(e.id, (1,), (e.min_weight_version,), group=e.group)])
    sampler = Sampler(
        ReplayBuffer(staleness),
        ledger.ready_groups,
        lambda: [Producer("w", clock.now())],
        Health(5),
        on_evict=lambda gone: ledger.requeue([g.id for g in gone], staleness.min_weight_version()),
        clock=clock,
    )
    got = await sampler.sample(1)
    assert [g.id for g in got.groups] == ["new"] and [g.id for g in got.evicted] == ["old"]
    (e,) = [e for e in ledger.entries() if e.id == "old"]
    assert e.state.value == "pending" and e.min_weight_version == 1
