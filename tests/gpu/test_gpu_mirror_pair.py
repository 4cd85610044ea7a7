"""The vLLM worker's mirrors on its GPU (`PullSpec(mirror_device="cuda")`), without vLLM
(which cannot run on the GPU machine): a host slot of model-shaped tensors pulled in the
background into GPU mirrors over cuda_ipc, then applied into GPU weights."""

from __future__ import annotations

import anyio
import pytest
import torch

from weightpull import InProcessRegistry, Publisher, create_transport
from weightpull.integrations.bench.gpu import make_tensors
from weightpull.integrations.vllm.mirrors import BackgroundPulls, checkpoint_weights

from ..conftest import settle

pytestmark = pytest.mark.anyio
SHAPES = [
    ("model.embed_tokens.weight", (1000, 256)),
    *[(f"model.layers.{i}.mlp.down_proj.weight", (256, 768)) for i in range(4)],
    ("model.norm.weight", (256,)),
]


async def test_gpu_mirrors_pull_a_host_slot_and_apply_into_gpu_weights():
    registry, owner = InProcessRegistry(), create_transport("cuda_ipc")
    publisher = Publisher(registry, owner, rollout_dtype=None, bucket_bytes=1 << 20, device="cpu")

    async def setup():
        return registry, create_transport("cuda_ipc")

    pulls = await anyio.to_thread.run_sync(lambda: BackgroundPulls(setup, holder="r0", device="cuda:0"))
    weights = {name: torch.zeros(shape, dtype=torch.bfloat16, device="cuda:0") for name, shape in SHAPES}
    try:
        for version in (1, 2):
            tensors = make_tensors(SHAPES, "cuda:0", seed=version)
            await publisher.publish(version, tensors)
            pulls.prefetch(version)
            assert (await anyio.to_thread.run_sync(settle, pulls, 10.0))["pulled"] == version
            pulled = pulls.take(version)
            assert pulled.region.device == "cuda:0"
            for name, mirror in checkpoint_weights(pulled):  # the apply: one device copy per tensor
                assert mirror.device == torch.device("cuda:0")
                weights[name].copy_(mirror)
            pulls.pair.promote(pulled)
            assert all(torch.equal(weights[n], tensors[n]) for n in tensors)
        assert {p.mirror.device for p in pulls.pair.pullers} == {"cuda:0"}  # both mirrors
    finally:
        await anyio.to_thread.run_sync(pulls.close)
        await publisher.aclose()
        await owner.aclose()
