"""`SnapshotPublisher`: the synchronous trainer's publisher. Its slots are reserved when it
starts; a streaming one casts straight into the slot and returns once the copies landed."""

import pytest
import torch

from weightpull import InProcessRegistry, PublishError, Puller, VersionState
from weightpull.drivers.fake import FakeTransport
from weightpull.integrations.torch_snapshot import SnapshotPublisher, spec_of
from weightpull.integrations.torch_tensors import as_tensors


def params(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layer.0.w": torch.randn(32, 32, generator=gen),
        "layer.0.b": torch.randn(32, generator=gen),
        "norm.weight": torch.ones(32),
    }


@pytest.fixture(params=[False, True], ids=["staged", "streamed"])
def snapshot(request):
    registry = InProcessRegistry()
    specs = [spec_of(n, t, "bfloat16") for n, t in params(0).items()]
    with SnapshotPublisher(registry, FakeTransport(), specs, stream=request.param, bucket_bytes=4096) as snap:
        yield snap, registry


def pull(snap, registry, **kw):
    """A replica's pull, run on the publisher's event loop (the embedded registry's)."""
    puller = Puller(registry, FakeTransport(), **kw)
    pulled = snap._portal.call(puller.pull)
    return {n: t.clone() for n, t in as_tensors(pulled.layout, pulled.region).items()}, pulled


def test_slots_are_reserved_when_it_starts(snapshot):
    snap, _ = snapshot
    sizes = {slot.region.nbytes for slot in snap.publisher.slots}
    assert None not in {slot.region for slot in snap.publisher.slots} and len(sizes) == 1
    assert sizes.pop() >= sum(s.nbytes for s in snap.specs)


def test_a_streaming_one_makes_its_slots_views_when_it_starts(snapshot):
    """A streamed publish casts into the slot's views: made at start, and the ones the
    first publish uses, so that it queues its casts as fast as the rest."""
    snap, _ = snapshot
    views = snap._adapter._views
    if not snap.stream:
        assert not views  # the staged one copies from staging, made when the version is
        return
    made = {id(slot.region): dict(views[id(slot.region)][1]) for slot in snap.publisher.slots}
    assert all(len(kept) == len(snap.specs) for kept in made.values())
    snap.publish(1, params(1).items()).result(timeout=10)
    used = views[id(snap.publisher.slots[0].region)][1]
    assert all(used[p] is made[id(snap.publisher.slots[0].region)][p] for p in used)


def test_each_version_arrives_cast_and_whole(snapshot):
    snap, registry = snapshot
    for version in (1, 2, 3):
        tensors = params(version)
        ticket = snap.publish(version, tensors.items())
        for t in tensors.values():  # the trainer's next step, as soon as publish returned
            t.add_(1000.0)
        assert ticket.result(timeout=10).version == version
        got, pulled = pull(snap, registry)
        assert pulled.version == version
        for name, t in params(version).items():
            assert torch.equal(got[name], t.to(torch.bfloat16)), name
    assert snap.blocking.count == 3


def test_a_streaming_publish_that_fails_midway_leaves_a_record(snapshot):
    snap, registry = snapshot
    snap.publish(1, params(1).items()).result(timeout=10)
    bad = dict(params(2))
    bad["layer.0.w"] = torch.randn(5, 5)  # not the shape the slots were laid out for
    with pytest.raises((PublishError, ValueError)):
        ticket = snap.publish(2, bad.items())
        ticket.result(timeout=10)
    status = snap._portal.call(registry.status)
    assert status.newest_ready == 1
    states = {v.version: v.state for v in status.versions}
    assert states.get(2, VersionState.ABORTED) is VersionState.ABORTED


def test_it_gives_its_publisher_the_torch_digester_and_encoder():
    from weightpull.integrations.torch_delta import encode_region
    from weightpull.integrations.torch_digests import wsum64_digests

    registry = InProcessRegistry()
    specs = [spec_of(n, t, "bfloat16") for n, t in params(0).items()]
    with SnapshotPublisher(registry, FakeTransport(), specs, bucket_bytes=4096, digests="wsum64", deltas=True) as snap:
        assert (snap.publisher.digester, snap.publisher.encoder) == (wsum64_digests, encode_region)
        tensors = params(1)
        snap.publish(1, tensors.items()).result(timeout=10)
        tensors["layer.0.w"][3, :4] += 1.0  # a step that changed 4 elements
        snap.publish(2, tensors.items()).result(timeout=10)  # host slots: encoded on the host, as ever
        got, pulled = pull(snap, registry)
        assert pulled.manifest.delta is not None and (pulled.manifest.delta.base, pulled.manifest.delta.changed) == (
            1,
            4,
        )
        assert torch.equal(got["layer.0.w"], tensors["layer.0.w"].to(torch.bfloat16))
