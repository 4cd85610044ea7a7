"""The worker side's mirrors and background pulls, without vLLM: a pulled version lands
in the spare mirror only, and a torn pull is never handed on."""

import anyio
import pytest

pytest.importorskip("torch")

from tests.conftest import host_tensors, settle  # noqa: E402
from weightpull import InProcessRegistry, Publisher  # noqa: E402
from weightpull.drivers.fake import FakeTransport  # noqa: E402
from weightpull.errors import TornReadError  # noqa: E402
from weightpull.integrations.vllm.mirrors import BackgroundPulls, checkpoint_weights  # noqa: E402
from weightpull.layout import TensorSpec  # noqa: E402

pytestmark = pytest.mark.anyio


def as_bytes(pulled) -> dict[str, bytes]:
    return {name: bytes(t.numpy().tobytes()) for name, t in checkpoint_weights(pulled)}


async def test_versions_alternate_between_two_mirrors_and_a_torn_pull_goes_no_further():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048)
    reader = FakeTransport()

    async def setup():
        return registry, reader

    pulls = await anyio.to_thread.run_sync(lambda: BackgroundPulls(setup, holder="r0", ttl=0.5))
    try:
        await publisher.publish(1, host_tensors(1))
        pulls.prefetch(1)
        pulls.prefetch(1)  # asking again for the pull under way does nothing
        assert (await anyio.to_thread.run_sync(settle, pulls))["pulled"] == 1
        first = pulls.take(1)
        pulls.pair.promote(first)
        assert as_bytes(first) == {n: t.data for n, t in host_tensors(1).items()}

        await publisher.publish(2, host_tensors(2))
        reader.faults.tear_reads, reader.faults.freeze = 1, 1.0  # frozen past the lease
        pulls.prefetch(2)
        status = await anyio.to_thread.run_sync(settle, pulls)
        assert status["error"]["type"] == "TornReadError" and status["serving"] == 1
        with pytest.raises(TornReadError):
            pulls.take(2)

        pulls.prefetch(2)  # again: a failed pull is retried
        assert (await anyio.to_thread.run_sync(settle, pulls))["pulled"] == 2
        second = pulls.take(2)
        assert second.region is not first.region  # the spare: the serving copy is intact
        assert as_bytes(first) == {n: t.data for n, t in host_tensors(1).items()}
        assert as_bytes(second) == {n: t.data for n, t in host_tensors(2).items()}
        pulls.pair.promote(second)
        assert pulls.status()["serving"] == 2
    finally:
        await anyio.to_thread.run_sync(pulls.close)


def test_the_mirrors_go_where_the_spec_says():
    """ "cuda" is the worker's own GPU; a worker without one is told so up front."""
    import torch

    from weightpull.errors import InvalidArgumentError
    from weightpull.integrations.vllm.worker import mirror_device

    assert mirror_device("cpu", torch.device("cuda:1")) == "cpu"
    assert mirror_device("cuda", torch.device("cuda:1")) == "cuda:1"
    assert mirror_device("cuda:0", None) == "cuda:0"
    with pytest.raises(InvalidArgumentError, match="this worker runs on cpu"):
        mirror_device("cuda", torch.device("cpu"))
    with pytest.raises(InvalidArgumentError, match="no device"):
        mirror_device("cuda", None)


async def test_background_pulls_keep_both_mirrors_on_the_device_asked_for():
    async def setup():
        return InProcessRegistry(), FakeTransport()

    pulls = await anyio.to_thread.run_sync(lambda: BackgroundPulls(setup, holder="r0", device="cpu"))
    try:
        assert [p.device for p in pulls.pair.pullers] == ["cpu", "cpu"]
    finally:
        await anyio.to_thread.run_sync(pulls.close)


async def test_prepare_sizes_both_mirrors_and_maps_the_reserved_slots_in_the_background():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048)
    tensors = host_tensors(1)
    await publisher.reserve([TensorSpec(n, t.dtype, t.shape) for n, t in tensors.items()])
    reader = FakeTransport()

    async def setup():
        return registry, reader

    pulls = await anyio.to_thread.run_sync(lambda: BackgroundPulls(setup, holder="r0", ttl=0.5))
    try:
        mapped = await anyio.to_thread.run_sync(lambda: pulls.prepare().result(10))
        assert mapped == 2 * len(publisher.slots)  # each mirror's puller maps every reserved slot
        mirrors = [p.mirror for p in pulls.pair.pullers]
        assert all(m is not None and m.nbytes == publisher.reservation.nbytes for m in mirrors)
        await publisher.publish(1, tensors)
        pulls.prefetch(1)
        assert (await anyio.to_thread.run_sync(settle, pulls))["pulled"] == 1
        first = pulls.take(1)
        assert first.region in mirrors  # pulled into a mirror made ahead
        assert as_bytes(first) == {n: t.data for n, t in tensors.items()}
    finally:
        await anyio.to_thread.run_sync(pulls.close)
