"""Delta versions encoded and patched on the GPU: the torch encoder and patcher there against
the host's, a GPU slot's delta patched on the GPU and on the host, a `Puller` on cuda:0
reading each version's delta alone over cuda_ipc (its mirror grown to hold the section,
the base kept until patched), a base gone bad read whole, and the vLLM worker's two GPU
mirrors patching each version from the one that serves."""

from __future__ import annotations

import anyio
import pytest
import torch

from weightpull import InProcessRegistry, Publisher, Puller, create_transport
from weightpull import delta as deltas
from weightpull.integrations import torch_delta
from weightpull.integrations.torch_delta import patch
from weightpull.integrations.torch_digests import wsum64_digests
from weightpull.integrations.vllm.mirrors import BackgroundPulls
from weightpull.integrations.vllm.worker import digesting

from ..conftest import settle

pytestmark = pytest.mark.anyio
SHAPES = [("embed", (1000, 512)), *[(f"layer{i}.w", (512, 768)) for i in range(4)], ("norm", (512,))]


def versions(n: int, share: float = 0.02) -> list[dict[str, torch.Tensor]]:
    """`n` versions of a bf16 model, each with `share` of its elements changed from the last."""
    gen = torch.Generator().manual_seed(0)
    model = {name: torch.randn(shape, generator=gen).to(torch.bfloat16) for name, shape in SHAPES}
    out = [model]
    for _ in range(n - 1):
        model = {name: t.clone() for name, t in model.items()}
        for t in model.values():
            flat = t.view(-1)
            where = torch.randperm(flat.numel(), generator=gen)[: max(1, int(flat.numel() * share))]
            flat[where] += 0.01
        out.append(model)
    return out


def held(pulled, tensors) -> bool:
    from weightpull.integrations.torch_tensors import as_tensors

    got = as_tensors(pulled.layout, pulled.region)
    return all(torch.equal(got[name].cpu(), t) for name, t in tensors.items())


@pytest.mark.parametrize("group", [torch_delta.SCATTER, 1000])
@pytest.mark.parametrize("word", [1, 2, 8])
def test_the_gpu_patch_is_the_hosts(monkeypatch, word, group):
    monkeypatch.setattr(torch_delta, "SCATTER", group)
    gen = torch.Generator().manual_seed(word)
    size = 5 * deltas.CHUNK * word // 2 + 8 * 3
    old = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    new = old.clone()
    new[torch.randperm(size, generator=gen)[: size // 50]] ^= 0x5A
    room = bytearray(size + (1 << 16))
    got = deltas.encode(memoryview(old.numpy()), memoryview(new.numpy()), word, memoryview(room))
    assert got is not None
    section = torch.frombuffer(room, dtype=torch.uint8)[: got[0]].cuda()
    into = torch.empty(got[0], dtype=torch.uint8, device="cuda")
    assert torch_delta.encode(old.cuda(), new.cuda(), word, into) == got  # the publisher's, on the GPU
    assert torch.equal(into, section)
    target = old.cuda()
    patch(target, section, word)
    assert torch.equal(target.cpu(), new)
    apart = torch.zeros_like(target)
    patch(apart, section, word, base=old.cuda())
    assert torch.equal(apart.cpu(), new)
    bad = section.clone()
    bad[:4] = 255  # a count past a chunk: refused before any write, no device fault
    with pytest.raises(deltas.DigestMismatchError):
        patch(target, bad, word)
    torch.cuda.synchronize()


async def test_a_gpu_mirror_reads_each_delta_alone_and_patches_it_there():
    registry, owner, reader = InProcessRegistry(), create_transport("cuda_ipc"), create_transport("cuda_ipc")
    publisher = Publisher(
        registry, owner, rollout_dtype=None, bucket_bytes=1 << 20, device="cpu", digests="wsum64", deltas=True
    )
    puller = Puller(registry, reader, device="cuda:0", **digesting("cuda:0"))
    models = versions(4)
    try:
        for v, tensors in enumerate(models, start=1):
            result = await publisher.publish(v, tensors)
            if v == 4:
                puller.mirror.memory[5] ^= 0xFF  # the base went bad on the GPU after its check: read whole
            pulled = await puller.pull()
            assert pulled.region.device == "cuda:0" and held(pulled, tensors)
            assert pulled.base == (v - 1 if v in (2, 3) else None), v
            if v > 1:
                assert result.manifest.delta is not None and result.manifest.delta.nbytes < result.manifest.nbytes / 10
        metrics = puller.metrics()
        assert (metrics["pull/patched"], metrics["pull/unpatched"]) == (2, 1)
        assert puller._outgrown is None  # v1's mirror, outgrown at v2, released once patched
    finally:
        await puller.aclose()
        await publisher.aclose()
        await owner.aclose()
        await reader.aclose()


async def test_the_vllm_workers_two_gpu_mirrors_patch_from_the_one_that_serves():
    registry, owner = InProcessRegistry(), create_transport("cuda_ipc")
    publisher = Publisher(
        registry, owner, rollout_dtype=None, bucket_bytes=1 << 20, device="cpu", digests="wsum64", deltas=True
    )

    async def setup():
        return registry, create_transport("cuda_ipc")

    pulls = await anyio.to_thread.run_sync(
        lambda: BackgroundPulls(setup, holder="r0", device="cuda:0", **digesting("cuda:0"))
    )
    try:
        for v, tensors in enumerate(versions(4), start=1):
            await publisher.publish(v, tensors)
            pulls.prefetch(v)
            assert (await anyio.to_thread.run_sync(settle, pulls, 20.0))["pulled"] == v
            pulled = pulls.take(v)
            assert held(pulled, tensors) and pulled.base == (None if v == 1 else v - 1), v
            pulls.pair.promote(pulled)
        assert sum(p.metrics()["pull/patched"] for p in pulls.pair.pullers) == 3
        assert [p.digester for p in pulls.pair.pullers] == [wsum64_digests] * 2
    finally:
        await anyio.to_thread.run_sync(pulls.close)
        await publisher.aclose()
        await owner.aclose()


async def test_a_gpu_slots_delta_is_encoded_there_and_patched_on_the_gpu_and_on_the_host():
    from weightpull.integrations.torch_delta import encode_region

    registry, owner = InProcessRegistry(), create_transport("cuda_ipc")
    publisher = Publisher(
        registry,
        owner,
        rollout_dtype=None,
        bucket_bytes=1 << 20,
        device="cuda:0",
        digests="wsum64",
        digester=wsum64_digests,
        deltas=True,
        encoder=encode_region,
    )
    gpu = Puller(registry, create_transport("cuda_ipc"), device="cuda:0", **digesting("cuda:0"))
    host = Puller(registry, create_transport("cuda_ipc"), device="cpu")
    try:
        for v, tensors in enumerate(versions(3), start=1):
            result = await publisher.publish(v, {n: t.cuda() for n, t in tensors.items()})
            assert (result.manifest.delta is None) == (v == 1)
            for puller in (gpu, host):
                pulled = await puller.pull()
                assert held(pulled, tensors) and pulled.base == (None if v == 1 else v - 1), (v, puller.device)
        assert gpu.metrics()["pull/patched"] == host.metrics()["pull/patched"] == 2
    finally:
        for puller in (gpu, host):
            await puller.aclose()
            await puller.transport.aclose()
        await publisher.aclose()
        await owner.aclose()
