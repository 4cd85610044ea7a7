import anyio
import pytest

from tests.conftest import autojump
from weightpull import FakeClock
from weightpull.errors import AgentFailedError, InvalidArgumentError
from weightpull.rl.dispatcher import Dispatcher, DispatchQueue, Prompt, ReplicaView
from weightpull.rl.staleness import Trajectory

pytestmark = pytest.mark.anyio


def test_prompts_are_claimed_oldest_first_by_replicas_that_serve_their_version():
    q = DispatchQueue(max_inflight_prompts=2)
    for name, v in [("a", 3), ("b", 1), ("c", 1)]:
        q.submit(Prompt(name, v))
    assert q.claim({"r0": ReplicaView(None, 0)}) is None  # serves nothing yet
    assert q.claim({"r0": ReplicaView(2, 0)}) == (Prompt("b", 1), "r0")  # "a" needs v3
    claimed = q.claim({"r0": ReplicaView(3, 1), "r1": ReplicaView(3, 0)})
    assert claimed == (Prompt("a", 3), "r1")  # the oldest, on the least busy replica
    assert q.claim({"r0": ReplicaView(3, 0)}) is None  # two in flight: the bound
    q.retry(Prompt("a", 3))  # an update aborted it: it is the oldest again
    assert q.claim({"r0": ReplicaView(3, 1)}) == (Prompt("a", 3), "r0")
    q.done(Prompt("b", 1))
    assert q.claim({"r0": ReplicaView(3, 1)}) == (Prompt("c", 1), "r0")
    with pytest.raises(InvalidArgumentError):
        q.submit(Prompt("c", 0))


class FakeReplica:
    """Generates for `duration` on a fake clock; an update in `abort` mode aborts what
    runs, in `keep` mode it lets it finish on the new version too."""

    def __init__(self, name, clock, serving=None, duration=1.0):
        self.name, self.clock, self.serving, self.duration = name, clock, serving, duration
        self.failure = None
        self.changed = anyio.Event()
        self.running: dict[str, list[int]] = {}
        self.aborted: set[str] = set()

    async def wait_changed(self):
        await self.changed.wait()
        if self.failure:
            raise AgentFailedError(f"{self.name} failed") from self.failure

    def update(self, version, mode="abort"):
        self.serving = version
        for pid, versions in self.running.items():
            if mode == "abort":
                self.aborted.add(pid)
            else:
                versions.append(version)
        self.changed.set()
        self.changed = anyio.Event()

    def fail(self, exc):
        self.failure = exc
        self.changed.set()

    async def generate(self, prompt):
        assert self.serving is not None and self.serving >= prompt.min_weight_version
        self.running[prompt.id] = versions = [self.serving]
        await self.clock.sleep(self.duration)
        del self.running[prompt.id]
        if prompt.id in self.aborted:
            self.aborted.discard(prompt.id)
            return None
        return Trajectory(prompt.id, (1,), versions, group=prompt.group, replica=self.name)


async def test_every_trajectory_is_generated_by_one_version_while_updates_abort():
    clock = FakeClock()
    replicas = [FakeReplica("r0", clock), FakeReplica("r1", clock, duration=0.7)]
    d = Dispatcher(replicas, max_inflight_prompts=3)
    for i in range(12):
        d.submit(Prompt(f"p{i}", min_weight_version=i // 4, group=f"g{i // 2}"))
    d.close()
    done: list[Trajectory] = []
    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(d.run)

        async def trainer():
            for v in range(4):
                for r in replicas:
                    r.update(v)
                    await clock.sleep(0.9)

        tg.start_soon(trainer)
        async for t in d.completed():
            done.append(t)
    assert sorted(t.prompt_id for t in done) == sorted(f"p{i}" for i in range(12))
    assert all(len(t.versions) == 1 for t in done)
    assert all(t.start_version >= int(t.prompt_id[1:]) // 4 for t in done)
    assert d.stats.retried > 0 and d.stats.max_inflight_seen <= 3


async def test_a_failed_agent_fails_the_dispatcher_and_its_consumer():
    clock = FakeClock()
    replica = FakeReplica("r0", clock)
    d = Dispatcher([replica], max_inflight_prompts=1)
    d.submit(Prompt("p0", 5))  # never served: it would wait forever

    async def run():
        with pytest.raises(AgentFailedError, match="r0 failed"):
            await d.run()

    async with autojump(clock), anyio.create_task_group() as tg:
        tg.start_soon(run)
        await clock.sleep(1)
        replica.fail(RuntimeError("apply broke"))
        with pytest.raises(AgentFailedError, match="r0 failed"):
            async for _ in d.completed():
                pass
