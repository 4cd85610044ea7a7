"""Figures a trainer's logger takes: `Publisher.metrics()` and `Puller.metrics()`, flat
dicts per step; and the served registry's Prometheus endpoint, scraped over HTTP."""

from __future__ import annotations

import urllib.request

import anyio
import pytest

from weightpull import InvalidArgumentError, Publisher, RegistryError, TornReadError, WhenFull
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport
from weightpull.errors import NoFreeSlotError

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio

NBYTES = 6656  # host_tensors' three tensors as laid out in a slot, aligned
# What a pull of them reads: each bucket of world's 2048-byte buckets, from its first
# tensor's start to its last's end: t0 and t1 (at 1024, 300 bytes), then t2 (5000 bytes).
READ = 1324 + 5000


def flat(metrics: dict) -> None:
    assert all(isinstance(k, str) and type(v) in (int, float) for k, v in metrics.items()), metrics


async def test_publisher_metrics_name_the_last_publish_and_count_outcomes(world):
    pub = world.publisher(when_full="skip")
    assert pub.metrics() == {"publish/published": 0, "publish/skipped": 0, "publish/failed": 0}
    await pub.publish(1, host_tensors(1))
    lease = await world.registry.acquire(1, ttl=60, holder="r")
    await pub.publish(2, host_tensors(2))
    m = pub.metrics()
    flat(m)
    assert m["publish/version"] == 2 and m["publish/bytes"] == NBYTES and m["publish/block_s"] >= 0
    assert m["publish/published"] == 2

    # Both slots taken now: v1 is leased, v2 the newest.
    skipped = await pub.publish(3, host_tensors(3))
    assert skipped.skipped
    m = pub.metrics()
    assert m["publish/version"] == 3 and "publish/bytes" not in m and m["publish/skipped"] == 1

    pub.when_full = WhenFull.FAIL
    with pytest.raises(NoFreeSlotError):
        await pub.publish(4, host_tensors(4))
    assert pub.metrics()["publish/failed"] == 1 and pub.metrics()["publish/version"] == 3
    await world.registry.release(lease)


async def test_publisher_block_seconds_include_the_wait_for_a_slot(world):
    pub = world.publisher(when_full="wait")  # waits out the lease (the default skips after 1 s)
    await pub.publish(1, host_tensors(1))
    await pub.publish(2, host_tensors(2))
    await world.registry.acquire(2, ttl=7, holder="r")
    async with autojump(world.clock):
        await pub.publish(3, host_tensors(3))  # into v1's slot, free at once
        assert pub.metrics()["publish/block_s"] == 0
        await pub.publish(4, host_tensors(4))  # v2 leased, v3 the newest: waits out the lease
    assert pub.metrics()["publish/block_s"] == pytest.approx(7, abs=0.1)


async def test_puller_metrics_per_pull(world):
    pub = world.publisher(num_slots=4)
    bandwidth = NBYTES / 2.0  # 3328 B/s: a read of READ bytes takes 1.90 s
    puller = world.puller(world.transport(faults=FakeFaults(bandwidth=bandwidth)), ttl=1.5)
    assert puller.metrics() == {
        "pull/pulls": 0,
        "pull/failed": 0,
        "pull/torn_reads": 0,
        "pull/stalls": 0,
        "pull/borrows": 0,
        "pull/patched": 0,
        "pull/unpatched": 0,
    }
    await pub.publish(1, host_tensors(1))
    async with autojump(world.clock):
        await puller.pull()
        m = puller.metrics()
        flat(m)
        assert m["pull/version"] == 1 and m["pull/bytes"] == NBYTES
        seconds = READ / bandwidth
        assert m["pull/seconds"] == pytest.approx(seconds)
        assert m["pull/gbps"] == pytest.approx(NBYTES / seconds / 1e9)  # the version's bytes over the pull's time
        assert m["pull/lease_renewals"] >= 3  # every 0.5 s of a 1.90 s read
        assert "pull/versions_behind" not in m  # nothing held before: unknown

        await pub.publish(2, host_tensors(2))
        await pub.publish(3, host_tensors(3))
        await puller.pull()
        assert puller.metrics()["pull/versions_behind"] == 2  # held v1 when v3 was the newest
        await puller.pull(3)
        assert "pull/versions_behind" not in puller.metrics()  # a given version: the newest is unknown

        puller.transport.faults.tear_reads, puller.transport.faults.freeze = 1, 5.0
        with pytest.raises(TornReadError):
            await puller.pull()
    m = puller.metrics()
    assert (m["pull/pulls"], m["pull/failed"], m["pull/torn_reads"], m["pull/stalls"]) == (3, 1, 1, 0)
    assert m["pull/version"] == 3  # the last good pull's figures stay


# -- the served registry's Prometheus endpoint ---------------------------------------------------


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_the_served_registry_offers_its_status_to_prometheus(monkeypatch):
    pytest.importorskip("prometheus_client")
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.client import ZmqRegistry
    from weightpull.drivers.zmq_registry.server import RegistryServer

    for name in ("WEIGHTPULL_KEY", "WEIGHTPULL_SERVER_KEY", "WEIGHTPULL_SECRET"):
        monkeypatch.delenv(name, raising=False)  # the client speaks plainly, as the dev server does
    server = RegistryServer("tcp://127.0.0.1:0", insecure_dev=True, metrics_port=0)
    fabric = FakeFabric()
    async with anyio.create_task_group() as tg:
        address = await tg.start(server.serve)
        assert server.metrics_url.startswith("http://127.0.0.1:") and server.metrics_url.endswith("/metrics")
        registry = ZmqRegistry(address)
        pub = Publisher(registry, FakeTransport(fabric=fabric), rollout_dtype=None, num_slots=3, name="trainer")
        await pub.publish(1, host_tensors(1))
        await pub.publish(2, host_tensors(2))
        await registry.report_serving("replica-0", 1)
        lease = await registry.acquire(None, ttl=60, holder="replica-1")

        m = await anyio.to_thread.run_sync(scrape, server.metrics_url)
        assert m["weightpull_registry_versions", (("state", "READY"),)] == 1
        assert m["weightpull_registry_versions", (("state", "RETIRED"),)] == 1
        assert m["weightpull_registry_versions", (("state", "WRITING"),)] == 0
        assert m["weightpull_registry_newest_ready_version", ()] == 2
        assert (
            m["weightpull_registry_version_state", (("publisher", "trainer"), ("state", "READY"), ("version", "2"))]
            == 1
        )
        assert (
            m["weightpull_registry_version_state", (("publisher", "trainer"), ("state", "RETIRED"), ("version", "1"))]
            == 1
        )
        assert m["weightpull_registry_version_bytes", (("version", "2"),)] == NBYTES
        assert m["weightpull_registry_version_live_leases", (("version", "2"),)] == 1
        assert m["weightpull_registry_live_leases", ()] == 1
        assert m["weightpull_registry_leases_by_holder", (("holder", "replica-1"),)] == 1
        assert m["weightpull_replica_serving_version", (("replica", "replica-0"),)] == 1
        assert m["weightpull_replica_versions_behind", (("replica", "replica-0"),)] == 1
        assert m["weightpull_registry_requests_total", ()] >= 6  # begin, commit (x2), report, acquire

        await registry.release(lease)  # read afresh at every scrape
        m = await anyio.to_thread.run_sync(scrape, server.metrics_url)
        assert m["weightpull_registry_live_leases", ()] == 0
        await pub.aclose()
        await registry.aclose()
        url = server.metrics_url
        tg.cancel_scope.cancel()
    assert server.metrics_url is None
    with pytest.raises(OSError):  # stopped with the server
        await anyio.to_thread.run_sync(scrape, url)


def test_a_bad_metrics_port_is_refused():
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.server import RegistryServer

    for bad in (-1, 70000, "9100"):
        with pytest.raises(InvalidArgumentError, match="metrics_port"):
            RegistryServer("tcp://127.0.0.1:0", metrics_port=bad)


async def test_a_busy_metrics_port_is_a_registry_error():
    pytest.importorskip("prometheus_client")
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.server import RegistryServer

    first = RegistryServer("tcp://127.0.0.1:0", metrics_port=0)
    async with anyio.create_task_group() as tg:
        await tg.start(first.serve)
        port = int(first.metrics_url.rsplit(":", 1)[1].split("/")[0])
        second = RegistryServer("tcp://127.0.0.1:0", metrics_port=port)
        with pytest.raises(RegistryError, match=f"cannot serve metrics on 127.0.0.1:{port}"):
            await second.serve()
        tg.cancel_scope.cancel()


def test_registry_serve_metrics_port_prints_where_to_scrape():
    pytest.importorskip("prometheus_client")
    pytest.importorskip("zmq")
    import json
    import subprocess
    import sys

    from .served import env

    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "weightpull",
            "registry",
            "serve",
            "--bind",
            "tcp://127.0.0.1:0",
            "--metrics-port",
            "0",
            "--json",
        ],
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        ready = json.loads(proc.stdout.readline())
        assert ready["metrics"].startswith("http://127.0.0.1:")
        m = scrape(ready["metrics"])
        assert m["weightpull_registry_versions", (("state", "READY"),)] == 0
        assert m["weightpull_registry_live_leases", ()] == 0
    finally:
        proc.terminate()
        assert proc.wait(10) == 0
