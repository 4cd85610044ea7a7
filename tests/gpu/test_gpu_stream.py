"""A streaming publish from GPU tensors: the trainer's fp32 parameters cast straight into
the slot on a side stream, each bucket marked once its own CUDA event fired, and
`publish` returning only once every copy landed (the trainer changes the tensors at once
after). The cross-process cuda_ipc path streams in `weightpull bench model` (byte-exact)."""

import pytest
import torch

from weightpull import InProcessRegistry, Puller
from weightpull.drivers.fake import FakeTransport
from weightpull.integrations.torch_snapshot import SnapshotPublisher, spec_of
from weightpull.integrations.torch_tensors import as_tensors


def params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda:0").manual_seed(seed)
    shapes = {"embed": (4096, 1024), **{f"layer{i}.w": (1024, 1024 + i) for i in range(8)}, "norm": (1024,)}
    return {n: torch.randn(s, device="cuda:0", generator=gen) for n, s in shapes.items()}


@pytest.mark.parametrize("slot", ["cpu"])
def test_a_streamed_publish_from_the_gpu_lands_whole_before_it_returns(slot):
    registry = InProcessRegistry()
    specs = [spec_of(n, t, "bfloat16") for n, t in params(0).items()]
    with SnapshotPublisher(
        registry, FakeTransport(), specs, device="cuda:0", slot_device=slot, stream=True, bucket_bytes=1 << 20
    ) as snap:
        marks = []
        real = registry.mark

        async def spy(version, committed):
            marks.append(committed)
            await real(version, committed)

        registry.mark = spy
        for version in (1, 2):
            marks.clear()
            tensors = params(version)
            want = {n: t.to(torch.bfloat16).cpu() for n, t in tensors.items()}
            ticket = snap.publish(version, tensors.items())
            for t in tensors.values():  # the trainer's next step, on its own stream, at once
                t.add_(1000.0)
            assert ticket.result(timeout=30).version == version
            puller = Puller(registry, FakeTransport())
            pulled = snap._portal.call(puller.pull)
            got = as_tensors(pulled.layout, pulled.region)
            for name, w in want.items():
                assert torch.equal(got[name], w), name
        # Marks only grow (copies this small may all land before the first look: then the
        # commit alone says so).
        assert len(pulled.layout.buckets) > 8 and marks == sorted(marks)
