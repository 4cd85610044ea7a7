"""A real vLLM engine started from a block-fp8 checkpoint (a tiny Qwen3, e4m3 with 128 x 128
scales, as Qwen3-FP8 stores it) takes a version published in fp8 (`fp8.expand`: quantized
in the trainer's copy) through weightpull's worker, by vLLM's own fp8 loading path (no
requantization on the replica); after the update its greedy tokens equal those of a fresh
engine started on a checkpoint of the same fp8 bytes. On the GPU: vLLM's CPU build serves
block fp8 only on CPUs with AMX (Sapphire Rapids or newer), which the CI machines lack.

Run on the H200 machine where vLLM is installed (docs/results/scripts/h200-vllm.sh's
`tests` job runs tests/gpu)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import anyio
import pytest
import torch

pytest.importorskip("vllm", reason="vLLM on the GPU: docs/results/scripts/h200-vllm.sh installs it and runs this")

from weightpull import InProcessRegistry, Publisher, create_transport  # noqa: E402
from weightpull.integrations import fp8  # noqa: E402

pytestmark = pytest.mark.anyio
QWEN3 = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    vocab_size=1024,
    max_position_embeddings=512,  # the bench's engine settings take max_model_len=512
    tie_word_embeddings=False,
)
PROMPTS = [[1, 5, 9, 22, 100, 7], [(7 * i + 3) % 1000 + 1 for i in range(40)]]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


def checkpoint(path: Path, seed: int) -> dict[str, torch.Tensor]:
    """A tiny Qwen3 (bf16, seeded) written as a block-fp8 checkpoint at `path`; its bf16
    tensors, which a trainer would publish."""
    from safetensors.torch import save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3)).to(torch.bfloat16)
    model.save_pretrained(path)
    weights = {n: t.detach().clone() for n, t in model.state_dict().items()}
    published = {}
    for name, value in fp8.expand(weights):
        published[name] = value.tensor() if isinstance(value, fp8.Fp8Part) else value.contiguous()
    for old in path.glob("*.safetensors"):
        old.unlink()
    save_file(published, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = dict(fp8.CONFIG)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return weights


async def greedy(llm, tag: str) -> list[list[int]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    out = []
    for i, prompt in enumerate(PROMPTS):
        final = None
        async for o in llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id=f"{tag}-{i}"):
            final = o
        out.append(list(final.outputs[0].token_ids))
    return out


async def test_an_fp8_replica_takes_an_fp8_version_and_serves_it_as_a_fresh_engine(tmp_path):
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from weightpull.drivers.zmq_registry.server import RegistryServer
    from weightpull.integrations.bench.vllm_engine import engine_overrides
    from weightpull.integrations.vllm import PullSpec, engine_args, open_replica, shutdown, start_engine

    checkpoint(tmp_path / "v0", seed=0)
    weights = {n: t.to("cuda:0") for n, t in checkpoint(tmp_path / "v1", seed=1).items()}
    overrides = engine_overrides(True)
    registry = InProcessRegistry()
    transport = create_transport("cuda_ipc")
    async with anyio.create_task_group() as tg:
        address = await tg.start(RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, registry=registry).serve)
        publisher = Publisher(registry, transport, name="trainer", device="cuda:0", when_full="wait")
        spec = PullSpec(address, "replica", transport="cuda_ipc", mirror_device="cuda", ttl=60.0, publisher="trainer")
        async with open_replica("replica", str(tmp_path / "v0"), registry, spec, **overrides) as r:
            tg.start_soon(r.agent.run)
            before = await greedy(r.llm, "before")
            result = await publisher.publish(1, fp8.expand(weights))
            assert fp8.is_fp8(result.manifest.layout)
            await r.agent.wait_for_version(1, timeout=300)
            after = await greedy(r.llm, "after")
        await publisher.aclose()
        tg.cancel_scope.cancel()
    fresh = await start_engine(engine_args(str(tmp_path / "v1"), worker_extension_cls=None, **overrides))
    try:
        want = await greedy(fresh, "fresh")
    finally:
        await shutdown(fresh)
    assert after == want and after != before
