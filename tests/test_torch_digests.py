"""wsum64 with torch tensor ops (weightpull.integrations.torch_digests), on CPU torch,
against the pure-Python reference; and the digester a publisher's device slot uses.
tests/gpu/test_gpu_digests.py checks the same on a CUDA device."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightpull import InProcessRegistry, InvalidArgumentError
from weightpull.digests import WSUM64, digest, wsum64_hex, wsum64_reference
from weightpull.drivers.fake import FakeTransport
from weightpull.integrations import torch_digests
from weightpull.integrations.torch_digests import wsum64, wsum64_digests
from weightpull.integrations.torch_snapshot import SnapshotPublisher, spec_of
from weightpull.transport import Region, WrappedTransport

_ROW = 8 * torch_digests._COLS


def reference(data: bytes) -> str:
    return wsum64_hex(*wsum64_reference(data))


def as_tensor(data: bytes) -> torch.Tensor:
    return torch.tensor(list(data), dtype=torch.uint8)


@pytest.mark.parametrize("nbytes", [0, 1, 7, 8, 9, 15, _ROW - 1, _ROW, _ROW + 8, _ROW + 13, 3 * _ROW + 5])
def test_torch_wsum64_equals_the_reference_at_the_edges(nbytes):
    data = os.urandom(nbytes)
    assert wsum64(as_tensor(data)) == reference(data)


@settings(deadline=None, max_examples=40)  # the reference takes a while over megabytes
@given(st.integers(0, 4 * _ROW + 7), st.sampled_from([0x00, 0x80, 0xFF, None]), st.randoms())
def test_torch_wsum64_equals_the_reference(nbytes, fill, rnd):
    """Random sizes, and words that overflow int64 in every sum and product."""
    data = bytes([fill]) * nbytes if fill is not None else rnd.randbytes(nbytes)
    assert wsum64(torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else as_tensor(b"")) == reference(data)


def test_a_tensor_of_any_dtype_is_digested_as_its_bytes():
    t = torch.randn(333, 7).to(torch.bfloat16)
    data = t.view(torch.uint8).numpy().tobytes()
    assert wsum64(t) == reference(data) == digest(data, WSUM64)


@pytest.mark.parametrize("skip", range(8))
def test_a_span_that_starts_off_a_word_is_digested_too(skip):
    data = os.urandom(_ROW + 21)
    slot = torch.zeros(skip + len(data), dtype=torch.uint8)
    slot[skip:] = as_tensor(data)
    assert wsum64(slot[skip:]) == reference(data)


def test_the_digester_gives_each_spans_digest():
    data = os.urandom(3 * _ROW + 100)
    spans = [(0, 256), (256, _ROW + 3), (_ROW + 512, 0), (_ROW + 768, 2 * _ROW - 701), (3, 4), (0, len(data))]
    want = [reference(data[o : o + n]) for o, n in spans]
    on_tensor = Region(len(data), "cpu", as_tensor(data))
    assert wsum64_digests(on_tensor, spans) == want
    buffer = bytearray(data)  # a host slot held as a buffer, with its view
    assert wsum64_digests(Region(len(data), "cpu", buffer, memoryview(buffer)), spans) == want
    assert wsum64_digests(on_tensor, []) == []
    with pytest.raises(InvalidArgumentError, match="outside"):
        wsum64_digests(on_tensor, [(len(data) - 3, 4)])


@settings(deadline=None, max_examples=50)
@given(st.binary(min_size=1, max_size=3 * _ROW + 64), st.data())
def test_the_digester_gives_any_spans_digests_at_once(data, draw):
    """Many buckets of any sizes and offsets, their sums made together."""
    cuts = sorted(draw.draw(st.lists(st.integers(0, len(data)), max_size=8)))
    spans = [(a, b - a) for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    spans = draw.draw(st.permutations(spans))
    region = Region(len(data), "cpu", torch.frombuffer(bytearray(data), dtype=torch.uint8))
    assert wsum64_digests(region, spans) == [reference(data[o : o + n]) for o, n in spans]


class DeviceSlots(WrappedTransport):
    """Slots "on a device" that are host memory: the device-slot path, on a CPU."""

    def allocate(self, nbytes: int, device: str = "cpu"):
        return self.inner.allocate(nbytes, "cpu")


def test_a_snapshot_publisher_passes_the_torch_digester_for_its_slots():
    registry = InProcessRegistry()
    tensors = {"w": torch.randn(300, 100), "b": torch.randn(77), "i": torch.arange(1001, dtype=torch.int32)}
    specs = [spec_of(n, t, "bfloat16") for n, t in tensors.items()]
    transport = DeviceSlots(FakeTransport())
    with SnapshotPublisher(registry, transport, specs, slot_device="cuda:0", digests=WSUM64, bucket_bytes=4096) as snap:
        assert snap.publisher.digester is wsum64_digests
        result = snap.publish(1, tensors.items()).result(timeout=30)
        view = snap.publisher.slots[result.slot].region.host_view()
        buckets = [bytes(view[b.offset : b.offset + b.nbytes]) for b in result.manifest.layout.buckets]
        assert len(buckets) == 3 and any(len(b) % 8 for b in buckets)
        assert result.manifest.digests == tuple(reference(b) for b in buckets)
