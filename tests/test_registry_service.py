"""The registry served over ZeroMQ: a real `weightpull registry serve` process, and
publishers, pullers and command lines as its clients in other processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import anyio
import pytest

from weightpull import (
    InProcessRegistry,
    InvalidArgumentError,
    Lease,
    Manifest,
    Publisher,
    Puller,
    RegistryStatus,
    TornReadError,
    VersionState,
    WeightpullError,
    plan_layout,
)
from weightpull.errors import AuthenticationError, MalformedMessageError, NoFreeSlotError, RegistryUnavailableError
from weightpull.layout import TensorSpec

pytest.importorskip("zmq")
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport  # noqa: E402
from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402

from .conftest import host_tensors  # noqa: E402
from .served import SECRET, ServedRegistry, cli, env  # noqa: E402

pytestmark = pytest.mark.anyio


@pytest.fixture
def server(tmp_path):
    served = ServedRegistry(tmp_path)
    served.start()
    yield served
    if served.alive():
        served.stop()


def client(server: ServedRegistry, **kw) -> ZmqRegistry:
    kw.setdefault("secret", SECRET)
    kw.setdefault("timeout", 0.5)
    kw.setdefault("retry_for", 10.0)
    return ZmqRegistry(server.address, **kw)


def manifest(version: int, slot: int = 0, publisher: str = "p") -> Manifest:
    return Manifest(version, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", slot, publisher)


def comparable(status) -> dict:
    """A status without the fields that move with time."""
    d = status.to_dict()
    for v in d["versions"]:
        v.pop("age")
    for lease in d["leases"]:
        lease.pop("expires_in")
    d.pop("alive", None)  # an embedded registry judges no liveness; a served one does
    return d


def assert_pulled(pulled, version: int) -> None:
    assert pulled.version == version
    for name, t in host_tensors(version).items():
        assert bytes(pulled.view(name)) == t.data


def test_serve_says_where_it_listens_and_stops_cleanly(server):
    assert server.address.startswith("tcp://127.0.0.1:") and not server.address.endswith(":0")
    assert server.stop(signal.SIGTERM) == 0


def test_the_development_mode_serves_loopback_only_and_says_so(tmp_path):
    refused = cli("registry", "serve", "--insecure-dev", "--bind", "tcp://0.0.0.0:0", secret=None)
    assert refused.returncode == 2 and "refusing to serve on tcp://0.0.0.0:0 without authentication" in refused.stderr
    served = ServedRegistry(tmp_path, secret=None)  # --insecure-dev
    served.start()
    try:
        assert "warning: --insecure-dev: no authentication and no encryption" in served.log()
        shown = cli("status", "--registry", served.address, "--json", secret=None)
        assert shown.returncode == 0 and json.loads(shown.stdout)["newest_ready"] is None
    finally:
        served.stop()


async def scenario(reg, other) -> list:
    """Every operation, and most ways to get one wrong; each outcome as plain values."""
    out: list = []

    async def step(awaitable):
        try:
            result = await awaitable
        except WeightpullError as exc:
            out.append(type(exc).__name__)
            return None
        if isinstance(result, Lease):
            out.append(("lease", result.version, result.holder, result.ttl))
        elif isinstance(result, RegistryStatus):
            out.append(comparable(result))
        else:
            out.append(result.to_dict() if isinstance(result, Manifest) else result)
        return result

    await step(reg.acquire(ttl=5.0, holder="r0"))
    await step(reg.newest())
    await step(reg.begin(1, publisher="p", slot=0))
    await step(reg.begin(1, publisher="p", slot=1))
    await step(reg.begin(2, publisher="p", slot=0))
    await step(reg.commit(manifest(1)))
    await step(reg.get(1))
    lease = await step(reg.acquire(ttl=5.0, holder="r0"))
    await step(reg.is_valid(lease))
    await step(reg.renew(lease))
    await step(reg.acquire(7, ttl=5.0, holder="r0"))
    await step(reg.begin(2, publisher="p", slot=1))
    await step(reg.get(2))
    await step(reg.commit(manifest(2, slot=1)))
    await step(reg.acquire(1, ttl=5.0, holder="r1"))
    await step(reg.reclaim(1))
    await step(reg.reclaim(2))
    await step(reg.release(lease))
    await step(reg.release(lease))
    await step(reg.is_valid(lease))
    await step(reg.renew(lease))
    await step(reg.renew(Lease("nobody-1", 2, "x", 5.0, 0.0)))
    await step(reg.reclaim(1))
    await step(reg.get(1))
    await step(reg.begin(3, publisher="p", slot=0))
    await step(reg.abort(3, "disk full"))
    await step(reg.abort(3))
    await step(reg.commit(manifest(3)))
    await step(reg.acquire(ttl=0, holder="r0"))
    await step(reg.acquire(ttl=5.0, holder=""))
    await step(reg.retire(2))
    await step(reg.acquire(ttl=5.0, holder="r0"))
    await step(reg.wait_for_version(4, timeout=0.2))

    async def commit_4_soon():
        await other.begin(4, publisher="q", slot=0)
        await other.commit(manifest(4, publisher="q"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(commit_4_soon)
        await step(reg.wait_for_version(4, timeout=5.0))
    await step(reg.report_serving("r0", 2))
    await step(reg.report_serving("", 2))
    held = await step(reg.acquire(ttl=5.0, holder="r2"))
    await step(reg.release_checked(held))  # True: it held until then
    await step(reg.release_checked(held))  # False: ended already
    await step(reg.status())
    return out


async def test_served_registry_answers_as_the_embedded_one_does(server):
    """Same results, same typed errors: only latency tells them apart."""
    embedded = InProcessRegistry()
    served, other = client(server), client(server)
    expected = await scenario(embedded, embedded)
    assert await scenario(served, other) == expected
    assert expected[2:4] == [1, 2]  # begin gives the number asked while free, else the next
    assert "InvalidTransitionError" in expected
    with pytest.raises(MalformedMessageError) as wrong_type:
        await served.acquire(ttl="5", holder="r0")  # type: ignore[arg-type]
    assert isinstance(wrong_type.value, InvalidArgumentError)  # as embedded refuses it
    for c in (served, other):
        await c.aclose()


LEASE_HOLDER = textwrap.dedent("""
    import anyio, sys
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    async def main():
        reg = ZmqRegistry(sys.argv[1])
        lease = await reg.acquire(ttl=30.0, holder="other-process")
        print(lease.version, flush=True)
        await anyio.to_thread.run_sync(sys.stdin.readline)
        await reg.release(lease)
        print("released", flush=True)

    anyio.run(main)
""")


async def test_publish_and_pull_across_processes(server):
    """The registry in one process; the trainer and two replicas in this one (the fake
    transport's memory lives here); another process holding a lease; `weightpull
    status` in a third."""
    fabric = FakeFabric()
    publisher = Publisher(
        client(server),
        FakeTransport(fabric=fabric),
        num_slots=2,
        when_full="fail",
        rollout_dtype=None,
        bucket_bytes=2048,
        name="trainer",
    )
    pullers = [Puller(client(server), FakeTransport(fabric=fabric), holder=f"replica-{i}", ttl=5.0) for i in range(2)]
    await publisher.publish(1, host_tensors(1))
    await publisher.publish(2, host_tensors(2))
    for p in pullers:
        assert_pulled(await p.pull(), 2)

    holder = subprocess.Popen(
        [sys.executable, "-c", LEASE_HOLDER, server.address],
        env=env(),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert (await anyio.to_thread.run_sync(holder.stdout.readline)).strip() == "2"
        await publisher.publish(3, host_tensors(3))  # into v1's slot
        with pytest.raises(NoFreeSlotError, match="leased by other-process"):
            await publisher.publish(4, host_tensors(4))  # v2's slot is leased by the other process
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert (await anyio.to_thread.run_sync(holder.stdout.readline)).strip() == "released"
    finally:
        holder.stdin.close()
        assert holder.wait(10) == 0
    await publisher.publish(5, host_tensors(5))
    for p in pullers:
        assert_pulled(await p.pull(), 5)
        await p.registry.report_serving(p.holder, 5)

    await publisher.registry.keepalive((publisher.name,))  # what its heartbeat sends every second
    shown = await anyio.to_thread.run_sync(lambda: cli("status", "--registry", server.address, "--json"))
    assert shown.returncode == 0, shown.stderr
    status = json.loads(shown.stdout)
    assert status["run"] == server.epoch and status["newest_ready"] == 5
    assert status["serving"] == {"replica-0": 5, "replica-1": 5} and status["leases"] == []
    assert {(v["version"], v["state"]) for v in status["versions"]} == {(3, "RETIRED"), (5, "READY")}
    human = await anyio.to_thread.run_sync(lambda: cli("status", "--registry", server.address))
    assert "newest READY: v5" in human.stdout and "replica-1  v5" in human.stdout
    publishers = [line for line in human.stdout.splitlines() if line.startswith(f"  {publisher.name} ")][0]
    assert publishers.split()[1:3] == ["v5", "READY"]  # each publisher's newest version, and its state
    assert "s left" in publishers  # and how long its liveness has left
    for p in pullers:
        await p.aclose()
        await p.registry.aclose()
    await publisher.aclose()
    await publisher.registry.aclose()


async def test_a_wrong_or_missing_secret_is_refused(server):
    owner = client(server)
    await owner.begin(1, publisher="p", slot=0)
    await owner.commit(manifest(1))
    before = comparable(await owner.status())
    for secret in (b"not-the-secret", b""):
        intruder = client(server, secret=secret)
        for attempt in (
            intruder.status(),
            intruder.acquire(ttl=5.0, holder="x"),
            intruder.begin(2, publisher="x", slot=1),
            intruder.report_serving("x", 1),
        ):
            with pytest.raises(AuthenticationError, match="do not share a secret"):
                await attempt
        await intruder.aclose()
    assert comparable(await owner.status()) == before
    assert server.log().count("AuthenticationError") >= 8

    shown = await anyio.to_thread.run_sync(lambda: cli("status", "--registry", server.address, secret=b"wrong"))
    assert shown.returncode == 1 and "do not share a secret" in shown.stderr and shown.stdout == ""
    await owner.aclose()


async def test_a_timed_out_request_is_resent_and_answered_once(server):
    class Counting(ZmqRegistry):
        attempts = 0
        resent = anyio.Event()

        async def _exchange(self, req, timeout):
            self.attempts += 1
            if self.attempts == 3:
                self.resent.set()
            return await super()._exchange(req, timeout)

    reg = client(server, timeout=0.2)
    await reg.begin(1, publisher="p", slot=0)
    await reg.commit(manifest(1))
    counting = Counting(server.address, secret=SECRET, timeout=0.2, retry_for=10.0)
    await counting.ping()
    counting.attempts = 0
    server.send_signal(signal.SIGSTOP)  # the request reaches a frozen server: no reply in time
    try:
        async with anyio.create_task_group() as tg:

            async def thaw():
                await counting.resent.wait()
                server.send_signal(signal.SIGCONT)

            tg.start_soon(thaw)
            lease = await counting.acquire(ttl=30.0, holder="once")
    finally:
        server.send_signal(signal.SIGCONT)
    assert counting.attempts >= 3
    status = await reg.status()
    assert [(x.id, x.holder) for x in status.leases] == [(lease.id, "once")]  # acquired once
    await reg.aclose()
    await counting.aclose()


async def test_a_registry_that_never_answers_is_reported_unavailable(tmp_path):
    reg = ZmqRegistry("tcp://127.0.0.1:9", secret=SECRET, timeout=0.1, retry_for=0.3)
    with pytest.raises(RegistryUnavailableError, match="did not answer status within 0.3 s") as info:
        await reg.status()
    assert isinstance(info.value, TimeoutError)
    await reg.aclose()


async def test_a_restart_mid_job_recovers(server):
    """The server dies mid-read and comes back empty, as a new run. The read in flight is
    rejected as torn; the trainer's client re-announces its newest version into the new
    run unprompted (its heartbeat), so replicas recover before the next publish."""
    fabric = FakeFabric()
    trainer = client(server, heartbeat=0.05)
    publisher = Publisher(
        trainer, FakeTransport(fabric=fabric), num_slots=2, rollout_dtype=None, bucket_bytes=2048, name="trainer"
    )
    replica = client(server)
    reading = anyio.Event()

    class Slow(FakeTransport):
        async def read(self, *args):
            reading.set()
            await super().read(*args)

    nbytes = sum(len(t.data) for t in host_tensors(1).values())
    slow = Slow(fabric=fabric, faults=FakeFaults(bandwidth=nbytes / 3.0))  # a pull takes ~3 s
    puller = Puller(replica, slow, holder="replica-0", ttl=1.0)
    await publisher.publish(1, host_tensors(1))
    await publisher.publish(2, host_tensors(2))
    first_run = server.epoch

    async def restart_once_reading():
        await reading.wait()
        server.stop(signal.SIGKILL)
        await anyio.to_thread.run_sync(server.start)

    async with anyio.create_task_group() as tg:
        tg.start_soon(restart_once_reading)
        with pytest.raises(TornReadError):
            await puller.pull()
    assert server.epoch != first_run

    # Nothing is published meanwhile: v2 comes back from the trainer's client alone.
    slow.faults.bandwidth = None
    assert (await replica.wait_for_version(2, timeout=10.0)).version == 2
    assert_pulled(await puller.pull(), 2)
    await publisher.publish(3, host_tensors(3))  # v1's slot: unknown to the new run, so free
    assert_pulled(await puller.pull(), 3)
    status = await replica.status()
    assert replica.epoch == trainer.epoch == server.epoch
    assert [(v.version, v.state) for v in status.versions] == [(2, VersionState.RETIRED), (3, VersionState.READY)]
    for c in (trainer, replica):
        await c.aclose()
    await puller.aclose()
    await publisher.aclose()


async def test_a_restart_between_begin_and_commit_loses_nothing(server):
    reg = client(server, heartbeat=None)  # the replay happens on the next call
    await reg.begin(1, publisher="p", slot=0)
    await reg.commit(manifest(1))
    await reg.report_serving("r0", 1)
    await reg.begin(2, publisher="p", slot=1)
    server.stop(signal.SIGKILL)
    await anyio.to_thread.run_sync(server.start)
    await reg.commit(manifest(2, slot=1))  # v2 was begun again in the new run, then committed
    status = await reg.status()
    assert [(v.version, v.state) for v in status.versions] == [(1, VersionState.RETIRED), (2, VersionState.READY)]
    assert status.serving == {"r0": 1}
    await reg.aclose()


def test_status_with_nothing_at_its_default_address_says_how_to_point_it_and_bench_prints_its_figures():
    shown = cli("status", "--timeout", "0.3")
    assert shown.returncode == 1 and "pass --registry ADDRESS or set $WEIGHTPULL_REGISTRY" in shown.stderr
    bench = cli("bench", "registry", "--clients", "8", "--seconds", "0.5", "--json")
    assert bench.returncode == 0, bench.stderr
    figures = json.loads(bench.stdout)
    assert figures["clients"] == 8 and figures["round_trips"] > 0
    assert figures["round_trips_per_s"] > 0 and 0 < figures["p50_ms"] <= figures["p99_ms"] <= figures["max_ms"]


def test_registry_bench_the_old_spelling_still_runs_and_warns():
    bench = cli("registry", "bench", "--clients", "2", "--seconds", "0.2", "--json")
    assert bench.returncode == 0, bench.stderr
    assert (
        "warning: `weightpull registry bench` is deprecated" in bench.stderr
        and "`weightpull bench registry`" in bench.stderr
    )
    assert json.loads(bench.stdout)["clients"] == 2


async def test_a_server_of_an_earlier_release_is_asked_is_valid_then_release(monkeypatch):
    """`release_checked` is new: a server without it says so, and the client says None and
    leaves the lease alone, so a reader asks is_valid, then releases, as before."""
    from weightpull.drivers.zmq_registry import wire
    from weightpull.drivers.zmq_registry.server import RegistryServer

    monkeypatch.setattr(wire, "OPS", {k: v for k, v in wire.OPS.items() if k != "release_checked"})
    async with anyio.create_task_group() as tg:
        address = await tg.start(RegistryServer("tcp://127.0.0.1:0", insecure_dev=True).serve)
        async with ZmqRegistry(address, timeout=0.5, retry_for=5.0) as reg:
            await reg.begin(1, publisher="p", slot=0)
            await reg.commit(manifest(1))
            lease = await reg.acquire(ttl=5.0, holder="r0")
            assert await reg.release_checked(lease) is None
            assert await reg.is_valid(lease)  # left alone
            assert await reg.release_checked(lease) is None  # remembered: not asked again
            await reg.release(lease)
            assert not await reg.is_valid(lease)
        tg.cancel_scope.cancel()
