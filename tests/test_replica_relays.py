"""A vLLM replica as a relay, without vLLM: `PullSpec`'s relay options, checked when it
is made; the options as each worker hands them to its pullers; and the worker's two
mirrors relaying over the fake transport: the serving mirror serves readers while the
spare takes the next version, and a mirror is written again only once no lease reads it,
even when the pull that waited for them was cancelled."""

from __future__ import annotations

import time

import anyio
import attrs
import pytest

pytest.importorskip("torch")

from tests.conftest import host_tensors, settle  # noqa: E402
from weightpull import InProcessRegistry, Publisher, Puller  # noqa: E402
from weightpull.drivers.fake import FakeTransport  # noqa: E402
from weightpull.errors import InvalidArgumentError  # noqa: E402
from weightpull.integrations.vllm import PullSpec, WeightpullWorker  # noqa: E402
from weightpull.integrations.vllm.mirrors import BackgroundPulls, checkpoint_weights  # noqa: E402
from weightpull.integrations.vllm.worker import relaying  # noqa: E402

pytestmark = pytest.mark.anyio

ADDRESS = "tcp://127.0.0.1:5603"


# -- PullSpec ------------------------------------------------------------------------------


def test_the_relay_options_default_to_a_plain_replica():
    spec = PullSpec(ADDRESS, "r0")
    assert (spec.host, spec.relay, spec.relay_cap, spec.stream) == (None, False, None, None)
    assert relaying(attrs.asdict(spec)) == {}  # its pullers are made as before


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"host": ""}, "PullSpec.host must be"),
        ({"host": 7}, "PullSpec.host must be"),
        ({"host": "h1", "relay": 1}, "PullSpec.relay must be True or False"),
        ({"host": "h1", "relay": True, "relay_cap": 0}, "PullSpec.relay_cap must be a positive int"),
        ({"host": "h1", "relay": True, "relay_cap": True}, "PullSpec.relay_cap must be a positive int"),
        ({"host": "h1", "relay": True, "relay_cap": 1.5}, "PullSpec.relay_cap must be a positive int"),
        ({"host": "h1", "stream": "yes"}, "PullSpec.stream must be"),
        ({"relay": True}, "PullSpec.relay needs PullSpec.host"),
        ({"host": "h1", "relay": True, "stream": False}, "leave PullSpec.stream unset or True"),
        ({"host": "h1", "relay_cap": 2}, "PullSpec.relay_cap caps a relay's readers"),
        ({"host": "h1", "sharded": "yes"}, "PullSpec.sharded must be 'auto'"),
        ({"host": "h1", "spare_mirror": None}, "PullSpec.spare_mirror must be True or False"),
    ],
)
def test_a_bad_relay_option_is_refused_naming_it(options, field):
    with pytest.raises(InvalidArgumentError, match=field.replace("(", r"\(").replace(")", r"\)")):
        PullSpec(ADDRESS, "r0", **options)


def test_sliced_pulls_stream_and_relay_as_whole_ones_do():
    spec = PullSpec(ADDRESS, "tp2", host="h1", relay=True, relay_cap=2, sharded=True)
    assert relaying(attrs.asdict(spec)) == {"host": "h1", "stream": True, "relay": True, "relay_cap": 2}


def test_the_options_reach_each_workers_pullers_as_the_puller_takes_them():
    relay = PullSpec(ADDRESS, "r0", host="h1", relay=True, relay_cap=3)
    assert relaying(attrs.asdict(relay)) == {"host": "h1", "stream": True, "relay": True, "relay_cap": 3}
    reader = PullSpec(ADDRESS, "r1", host="h1")  # a reader that takes relays as they fill
    assert relaying(attrs.asdict(reader)) == {"host": "h1", "stream": True, "relay": False, "relay_cap": None}
    whole = PullSpec(ADDRESS, "r2", host="h1", stream=False)  # only relays that hold a version whole
    assert relaying(attrs.asdict(whole))["stream"] is False
    assert relaying(attrs.asdict(PullSpec(ADDRESS, "r3", stream=True))) == {"stream": True}
    assert PullSpec(ADDRESS, "r4", host="h1", mirror_device="cpu").host == "h1"


def test_gpu_mirrors_read_from_relays_checked_by_the_torch_digester():
    """A GPU mirror checks a relay's bytes against the publisher's wsum64 digests where it
    lies: `host` goes with `mirror_device="cuda"`, and each worker's pullers of a GPU
    mirror get the torch digester, a rank's slice's too (a host mirror's are checked on
    the CPU)."""
    from weightpull.integrations.torch_delta import patch_region
    from weightpull.integrations.torch_digests import wsum64_digests
    from weightpull.integrations.vllm.mirrors import MirrorPair
    from weightpull.integrations.vllm.worker import digesting

    assert PullSpec(ADDRESS, "r0", host="h1", relay=True, mirror_device="cuda").mirror_device == "cuda"
    assert digesting("cuda:0") == {"digester": wsum64_digests, "patcher": patch_region}
    assert digesting("cuda:0", whole=False) == {"digester": wsum64_digests}
    assert digesting("cpu") == {}
    pair = MirrorPair(InProcessRegistry(), FakeTransport(), holder="r0", host="h1", digester=wsum64_digests)
    assert [p.digester for p in pair.pullers] == [wsum64_digests] * 2


def test_each_worker_of_a_relaying_engine_offers_under_its_own_name():
    """Offers are kept per (version, holder): tensor-parallel workers that each relay a
    whole copy must not share one name."""

    class Config:
        world_size = 2

    worker = WeightpullWorker()
    spec = attrs.asdict(PullSpec(ADDRESS, "r0", host="h1", relay=True))
    assert worker._weightpull_holder(spec) == "r0"  # no parallel config: one worker
    worker.parallel_config, worker.rank = Config(), 1  # type: ignore[attr-defined]
    assert worker._weightpull_holder(spec) == "r0/rank1"
    assert worker._weightpull_holder(attrs.asdict(PullSpec(ADDRESS, "r0", host="h1"))) == "r0"  # a reader


# -- the worker's mirrors as a relay -------------------------------------------------------


def as_bytes(pulled) -> dict[str, bytes]:
    return {name: bytes(t.numpy().tobytes()) for name, t in checkpoint_weights(pulled)}


def exact(pulled, version: int) -> bool:
    return as_bytes(pulled) == {n: t.data for n, t in host_tensors(version).items()}


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("timed out")
        time.sleep(0.01)


async def relay_pulls(registry, **relay) -> BackgroundPulls:
    async def setup():
        return registry, FakeTransport()

    return await anyio.to_thread.run_sync(
        lambda: BackgroundPulls(setup, holder="relay", ttl=2.0, **relaying({"host": "h1", "relay": True, **relay}))
    )


async def pull(pulls: BackgroundPulls, version: int, *, promote: bool = True):
    pulls.prefetch(version)
    status = await anyio.to_thread.run_sync(settle, pulls)
    assert status["pulled"] == version, status
    pulled = pulls.take(version)
    if promote:
        pulls.pair.promote(pulled)
    return pulled


async def test_a_relaying_replicas_serving_mirror_serves_readers_while_the_spare_takes_the_next():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, num_slots=3, digests=True)
    pulls = await relay_pulls(registry, relay_cap=2)
    try:
        assert [(p.host, p.stream, p.relay, p.relay_cap) for p in pulls.pair.pullers] == [("h1", True, True, 2)] * 2
        await publisher.publish(1, host_tensors(1))
        first = await pull(pulls, 1)
        assert exact(first, 1) and pulls.status()["offered"] == [1]
        [offer] = (await registry.status()).offers
        assert (offer.holder, offer.host, offer.cap) == ("relay", "h1", 2)
        assert offer.landed == offer.buckets == 2  # held whole

        # A reader on the relay's host is handed the relay, and its copy is exact.
        await publisher.transport.aclose()  # the trainer's slot is gone: only the relay can serve v1
        assert exact_view(await Puller(registry, FakeTransport(), host="h1", holder="reader").pull(1), 1)
        held = await registry.acquire(1, ttl=30.0, holder="slow-reader", host="h1")
        assert held.source == "relay"

        publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, digests=True)
        await publisher.publish(2, host_tensors(2))
        started = time.monotonic()
        second = await pull(pulls, 2)  # into the spare at once: v1's reader holds the other
        assert time.monotonic() - started < 1.5
        assert second.region is not first.region and exact(second, 2) and exact(first, 1)
        assert pulls.status()["offered"] == [1, 2]

        # v3 goes into v1's mirror: its offer is withdrawn, and the pull waits for the lease.
        await publisher.publish(3, host_tensors(3))
        pulls.prefetch(3)
        await anyio.sleep(0.5)
        assert pulls.status()["pending"] == 3 and await registry.readers_at(1, "relay") == 1
        assert [o.version for o in (await registry.status()).offers] == [2]  # no new reader is sent to v1
        assert exact(first, 1)  # never written under its reader
        await registry.release(held)
        assert (await anyio.to_thread.run_sync(settle, pulls))["pulled"] == 3
        third = pulls.take(3)
        assert third.region is first.region and exact(third, 3) and exact(second, 2)
        pulls.pair.promote(third)
    finally:
        await anyio.to_thread.run_sync(pulls.close)
    assert (await registry.status()).offers == ()  # closed: nothing is offered from memory that is gone


def exact_view(pulled, version: int) -> bool:
    return all(bytes(pulled.view(n)) == t.data for n, t in host_tensors(version).items())


async def test_a_mirror_stays_kept_for_its_readers_when_the_pull_that_waited_is_cancelled():
    """The agent's next prefetch of another version cancels the one under way: if that
    one was waiting for a relay's readers, the next still waits for them."""
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, num_slots=4, digests=True)
    pulls = await relay_pulls(registry)
    try:
        await publisher.publish(1, host_tensors(1))
        first = await pull(pulls, 1)
        held = await registry.acquire(1, ttl=30.0, holder="slow-reader", host="h1")
        assert held.source == "relay"
        await publisher.publish(2, host_tensors(2))
        await pull(pulls, 2)
        await publisher.publish(3, host_tensors(3))
        pulls.prefetch(3)  # into v1's mirror: waits for the lease
        await anyio.sleep(0.3)
        await publisher.publish(4, host_tensors(4))
        pulls.prefetch(4)  # cancels the pull of v3 mid-wait
        await anyio.sleep(0.5)
        assert pulls.status()["pending"] == 4 and await registry.readers_at(1, "relay") == 1
        assert exact(first, 1)
        await registry.release(held)
        assert (await anyio.to_thread.run_sync(settle, pulls))["pulled"] == 4
        assert exact(pulls.take(4), 4)
    finally:
        await anyio.to_thread.run_sync(pulls.close)


async def test_a_relay_closing_withdraws_its_offers_and_waits_for_its_readers_a_ttl_at_most():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, digests=True)
    pulls = await relay_pulls(registry)
    await publisher.publish(1, host_tensors(1))
    await pull(pulls, 1)
    held = await registry.acquire(1, ttl=30.0, holder="slow-reader", host="h1")
    started = time.monotonic()
    await anyio.to_thread.run_sync(pulls.close)
    assert 1.5 < time.monotonic() - started < 5.0  # the relay's TTL (2 s), then the mirror goes
    assert (await registry.status()).offers == ()
    await registry.release(held)


async def test_a_replica_that_names_a_host_without_relaying_offers_nothing():
    registry = InProcessRegistry()
    publisher = Publisher(registry, FakeTransport(), rollout_dtype=None, bucket_bytes=2048, digests=True)

    async def setup():
        return registry, FakeTransport()

    spec = attrs.asdict(PullSpec(ADDRESS, "r1", host="h1"))
    pulls = await anyio.to_thread.run_sync(lambda: BackgroundPulls(setup, holder="r1", **relaying(spec)))
    try:
        await publisher.publish(1, host_tensors(1))
        assert exact(await pull(pulls, 1), 1)
        assert pulls.status()["offered"] == [] and (await registry.status()).offers == ()
    finally:
        await anyio.to_thread.run_sync(pulls.close)
