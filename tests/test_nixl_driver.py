"""What the conformance suite does not cover of the nixl driver: its registry entry, why it
is unavailable, error translation, reuse of prepared transfers, loopback, a crashed peer,
and a publish and pull between two processes."""

import os
import signal
import subprocess
import sys

import anyio
import pytest

from weightpull import (
    InProcessRegistry,
    InvalidArgumentError,
    Publisher,
    Puller,
    TransportError,
    create_transport,
    list_transports,
)
from weightpull.drivers import nixl as nixl_driver
from weightpull.drivers.nixl import NixlTransport, nixl_errors
from weightpull.drivers.testing.conformance import ProcessPeer, pattern
from weightpull.errors import PeerGoneError, RegionNotRegisteredError
from weightpull.integrations.bench.pull import BenchConfig, PublisherProcess, digest

pytestmark = pytest.mark.anyio


def test_builtin_and_available():
    (info,) = [i for i in list_transports() if i.name == "nixl"]
    assert info.origin == "builtin" and info.extra == "nixl" and info.available, info.reason
    assert isinstance(create_transport("nixl"), NixlTransport)


def test_unavailable_reason_names_the_modules_and_the_extra(monkeypatch):
    monkeypatch.setattr(nixl_driver, "_api", None)
    monkeypatch.setattr(nixl_driver, "API_MODULES", ("weightpull_no_nixl._api",))
    reason = NixlTransport.unavailable_reason()
    assert "weightpull_no_nixl._api" in reason and "pip install 'weightpull[nixl]'" in reason


def _nixl_exception(name):
    return type(name, (Exception,), {})("NIXL_ERR")


@pytest.mark.parametrize(
    ("nixl_name", "ours"),
    [
        ("nixlRemoteDisconnectError", PeerGoneError),
        ("nixlNotFoundError", RegionNotRegisteredError),
        ("nixlBackendError", TransportError),
    ],
)
def test_nixl_errors_become_the_projects(nixl_name, ours):
    with pytest.raises(ours, match="reading x") as info:
        with nixl_errors("reading x"):
            raise _nixl_exception(nixl_name)
    assert type(info.value.__cause__).__name__ == nixl_name
    with pytest.raises(KeyError):  # not NIXL's: left alone
        with nixl_errors("reading x"):
            raise KeyError("k")


def test_bad_options_and_memory():
    with pytest.raises(InvalidArgumentError, match="threads"):
        NixlTransport(threads=0)
    t = NixlTransport()
    with pytest.raises(InvalidArgumentError, match="cannot allocate on 'tpu'"):
        t.allocate(16, "tpu")
    with pytest.raises(InvalidArgumentError, match="as a torch tensor only"):
        t.register(bytearray(16), device="cuda:0")


async def test_prepared_transfers_are_reused_and_dropped_with_their_regions():
    owner, reader = NixlTransport(), NixlTransport()
    try:
        src = owner.register(bytearray(pattern(8192, 1)))
        remote = reader.connect(owner.export(src))
        local = reader.allocate(8192)
        async with anyio.create_task_group() as tg:
            tg.start_soon(owner.serve)  # the first read's wire-up needs the owner's progress
            for _ in range(3):
                await reader.read(remote, 0, local, 0, 4096)
                await reader.read(remote, 4096, local, 4096, 4096)
            tg.cancel_scope.cancel()
        assert bytes(local.host_view()) == pattern(8192, 1)
        handles = {id(x.handle) for x in reader._xfers.values()}
        assert len(reader._xfers) == len(handles) == 2  # one per span, reposted each time
        reader.deregister(local)
        assert not reader._xfers
    finally:
        await owner.aclose()
        await reader.aclose()


async def test_loopback_reads_of_our_own_regions():
    t = NixlTransport()
    try:
        src = t.register(bytearray(pattern(4096, 2)))
        remote = t.connect(t.export(src))
        dst = t.allocate(4096)
        await t.read(remote, 0, dst, 0, 4096)
        assert bytes(dst.host_view()) == pattern(4096, 2)
    finally:
        await t.aclose()


async def test_a_crashed_peer_is_gone():
    peer = ProcessPeer("nixl")
    reader = NixlTransport()
    try:
        remote = reader.connect(await peer.alloc(1 << 20, seed=3))
        local = reader.allocate(1 << 20)
        await reader.read(remote, 0, local, 0, 1 << 20)
        os.kill(peer.process.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(peer.process.join)
        with pytest.raises(PeerGoneError, match="disconnected"):
            await reader.read(remote, 0, local, 0, 1 << 20)
        with pytest.raises(PeerGoneError):
            reader.connect(remote.descriptor)
    finally:
        peer.close()
        await reader.aclose()


async def test_publish_in_one_process_pull_in_another():
    """The real deployment's shape: the publisher's process serves, this one pulls."""
    cfg = BenchConfig(transport="nixl", size=3 << 20, bucket_bytes=1 << 20)
    proc = PublisherProcess(cfg)
    try:
        manifest, want = await anyio.to_thread.run_sync(proc.ready)
        registry = InProcessRegistry()
        await registry.begin(1, publisher=manifest.publisher, slot=manifest.slot)
        await registry.commit(manifest)
        transport = create_transport("nixl")
        puller = Puller(registry, transport)
        for _ in range(2):
            pulled = await puller.pull()
            assert digest(pulled.region.host_view()[: cfg.size]) == want
        assert len(manifest.layout.buckets) == 3 and len(transport._xfers) == 3
        await puller.aclose()
        await transport.aclose()
    finally:
        await anyio.to_thread.run_sync(proc.stop)


async def test_publisher_serve_delegates_to_the_transport():
    registry = InProcessRegistry()
    publisher = Publisher(registry, NixlTransport(), rollout_dtype=None)
    with anyio.move_on_after(0.02) as scope:
        await publisher.serve()
    assert scope.cancelled_caught  # nixl's serve runs until cancelled
    await publisher.transport.aclose()


def test_ucx_logs_go_to_stderr_not_stdout():
    """The demo and bench print JSON as stdout's last line; a UCX error (a peer that
    died) must not land after it."""
    code = (
        "import os; os.environ['UCX_LOG_LEVEL'] = 'info'\n"
        "from weightpull.drivers.nixl import NixlTransport\n"
        "t = NixlTransport(); t.export(t.allocate(4096)); print('done')\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_LOG_FILE"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "done\n" and "UCX" in out.stderr
