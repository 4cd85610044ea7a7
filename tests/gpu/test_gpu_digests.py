"""wsum64 digests computed on a GPU (weightpull.integrations.torch_digests): the same bits
as the host's, on a bucket of hundreds of MiB and on odd sizes and offsets; and a
publisher whose slots are on the GPU recording them, checked by a host mirror's pull."""

from __future__ import annotations

import os

import pytest
import torch

from weightpull import InProcessRegistry, Publisher, Puller, create_transport
from weightpull.digests import WSUM64, digest, wsum64_hex, wsum64_reference
from weightpull.integrations.torch_digests import _COLS, wsum64, wsum64_digests
from weightpull.integrations.torch_snapshot import SnapshotPublisher, spec_of
from weightpull.transport import Region

pytestmark = pytest.mark.anyio
_ROW = 8 * _COLS
SHAPES = [("embed", (1000, 512)), *[(f"layer{i}.w", (512, 384 + i)) for i in range(12)], ("norm", (511,))]


def reference(data: bytes) -> str:
    return wsum64_hex(*wsum64_reference(data))


def on_gpu(data: bytes) -> torch.Tensor:
    host = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return host.to("cuda:0")


@pytest.mark.parametrize("fill", [None, 0xFF])
def test_a_bucket_of_hundreds_of_mib_digests_as_on_the_host(fill):
    """Random bytes, and all ones (every sum and product overflows). The host's numpy sum,
    which tests/test_digests.py holds to the reference, is the oracle at this size."""
    nbytes = (300 << 20) + 8 * 1234 + 5  # a tail of words and of bytes
    gen = torch.Generator(device="cuda:0").manual_seed(7)
    if fill is None:
        data = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda:0", generator=gen)
    else:
        data = torch.full((nbytes,), fill, dtype=torch.uint8, device="cuda:0")
    host = data.cpu().numpy().tobytes()
    assert wsum64(data) == digest(host, WSUM64)
    tail = host[-(3 * _ROW + 13) :]  # and a piece of it against the pure reference itself
    assert wsum64(data[-len(tail) :]) == reference(tail)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, _ROW - 1, _ROW, _ROW + 5, 5 * _ROW + 8 * 17 + 3])
def test_odd_sizes_digest_as_the_reference(nbytes):
    data = os.urandom(nbytes)
    assert wsum64(on_gpu(data)) == reference(data)


def test_spans_of_a_gpu_slot_at_any_offset():
    data = os.urandom(4 * _ROW + 99)
    slot = on_gpu(data)
    spans = [(0, 256), (3, _ROW + 1), (256, 0), (1000, 2 * _ROW + 7), (len(data) - 5, 5)]
    got = wsum64_digests(Region(slot.numel(), "cuda:0", slot), spans)
    assert got == [reference(data[o : o + n]) for o, n in spans]


def params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device="cuda:0").manual_seed(seed)
    return {n: torch.randn(s, device="cuda:0", generator=gen) for n, s in SHAPES}


def slot_digests(publisher, result) -> tuple[str, ...]:
    """The reference digests of the slot's bytes, copied to the host."""
    raw = publisher.slots[result.slot].region.memory.cpu().numpy().tobytes()
    return tuple(reference(raw[b.offset : b.offset + b.nbytes]) for b in result.manifest.layout.buckets)


async def test_a_gpu_slot_records_wsum64_digests_of_its_bytes_and_a_host_mirror_checks_them():
    registry, transport = InProcessRegistry(), create_transport("cuda_ipc")
    publisher = Publisher(
        registry,
        transport,
        bucket_bytes=1 << 20,
        device="cuda:0",
        digests=WSUM64,
        digester=wsum64_digests,
    )
    for version in (1, 2):
        result = await publisher.publish(version, params(version))
        assert len(result.manifest.layout.buckets) > 2
        assert result.manifest.digests == slot_digests(publisher, result)
        host = Puller(registry, transport, device="cpu")
        assert host.verify_digests
        pulled = await host.pull()  # checks each bucket against the GPU's digests
        assert pulled.version == version
        await host.aclose()
    await publisher.aclose()
    await transport.aclose()


@pytest.mark.parametrize("stream", [False, True])
def test_a_snapshot_publisher_with_gpu_slots_records_wsum64_digests(stream):
    registry, transport = InProcessRegistry(), create_transport("cuda_ipc")
    specs = [spec_of(n, t, "bfloat16") for n, t in params(0).items()]
    with SnapshotPublisher(
        registry,
        transport,
        specs,
        device="cuda:0",
        slot_device="cuda:0",
        stream=stream,
        digests=WSUM64,
        bucket_bytes=1 << 20,
    ) as snap:
        for version in (1, 2):
            tensors = params(version)
            ticket = snap.publish(version, tensors.items())
            for t in tensors.values():  # the trainer's next step, at once
                t.add_(1000.0)
            result = ticket.result(timeout=60)
            assert result.manifest.digests == slot_digests(snap.publisher, result)
            assert (snap._portal.call(registry.get, version)).digests == result.manifest.digests
