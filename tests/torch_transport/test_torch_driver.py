"""What the conformance suite does not cover of the torch driver: the deployment's shape
(a served registry, a trainer process publishing into several slots, this process pulling
every version through one reader endpoint), a crashed peer, and error translation."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from weightpull import InvalidArgumentError, Puller, TransportError, create_transport, list_transports
from weightpull.drivers.testing.conformance import ProcessPeer
from weightpull.drivers.torch_transport import TorchTransport, torch_errors
from weightpull.drivers.zmq_registry.client import ZmqRegistry
from weightpull.errors import PeerGoneError, RegionNotRegisteredError

from ..conftest import host_tensors
from ..served import SECRET, ServedRegistry, env

pytestmark = pytest.mark.anyio
SIZES = (300_000, 3000, 70_000)

TRAINER = textwrap.dedent(f"""
    import sys, anyio
    from weightpull import Publisher, create_transport
    from weightpull.drivers.zmq_registry.client import ZmqRegistry
    from tests.conftest import host_tensors

    async def main():
        registry = ZmqRegistry(sys.argv[1])
        publisher = Publisher(registry, create_transport("torch"), num_slots=2, rollout_dtype=None,
                              bucket_bytes=64 << 10, name="trainer")
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.serve)  # the first read of a slot needs our endpoint's progress
            while line := await anyio.to_thread.run_sync(sys.stdin.readline):
                version = int(line)
                result = await publisher.publish(version, host_tensors(version, sizes={SIZES!r}))
                print("published", version, result.slot, flush=True)
            tg.cancel_scope.cancel()
        await publisher.aclose()
        await publisher.transport.aclose()
        await registry.aclose()

    anyio.run(main)
""")


def test_available_with_torch_2_15():
    (info,) = [i for i in list_transports() if i.name == "torch"]
    assert info.available and info.extra == "torch-transport", info.reason
    assert isinstance(create_transport("torch"), TorchTransport)


async def test_a_trainer_process_publishes_into_two_slots_and_one_endpoint_pulls_them(tmp_path):
    server = ServedRegistry(tmp_path)
    server.start()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, server.address],
        env=env(),
        text=True,
        cwd=Path(__file__).parents[2],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    registry = ZmqRegistry(server.address, secret=SECRET)
    transport = TorchTransport()
    puller = Puller(registry, transport, holder="replica-0")
    slots = set()
    try:
        for version in (1, 2, 3):
            trainer.stdin.write(f"{version}\n")
            trainer.stdin.flush()
            line = (await anyio.to_thread.run_sync(trainer.stdout.readline)).split()
            assert line[:2] == ["published", str(version)], line
            slots.add(int(line[2]))
            pulled = await puller.pull()
            assert pulled.version == version and pulled.manifest.transport == "torch"
            for name, t in host_tensors(version, sizes=SIZES).items():
                assert bytes(pulled.view(name)) == t.data
        assert slots == {0, 1}
        # Both slots, every bucket, through the one endpoint connected to the trainer.
        assert len(transport._peers) == 1
    finally:
        trainer.stdin.close()
        await anyio.to_thread.run_sync(trainer.wait, 60)
        await puller.aclose()
        await transport.aclose()
        await registry.aclose()
        server.stop()
    assert trainer.returncode == 0


async def test_a_crashed_peer_is_gone_at_once_not_after_a_timeout():
    peer = ProcessPeer("torch")
    reader = TorchTransport(timeout=600)  # a hang would show as one
    try:
        remote = reader.connect(await peer.alloc(1 << 20, seed=3))
        local = reader.allocate(1 << 20)
        await reader.read(remote, 0, local, 0, 1 << 20)
        os.kill(peer.process.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(peer.process.join)
        with anyio.fail_after(20):
            with pytest.raises(PeerGoneError, match="disconnected"):
                await reader.read(remote, 0, local, 0, 1 << 20)
            with pytest.raises(PeerGoneError):
                await reader.read(remote, 100, local, 0, 10)
            with pytest.raises(PeerGoneError):
                reader.connect(remote.descriptor)
    finally:
        peer.close()
        with anyio.fail_after(20):
            await reader.aclose()


def _named(name: str, base: type = Exception) -> Exception:
    return type(name, (base,), {})("NIXL_ERR")


@pytest.mark.parametrize(
    ("error", "ours"),
    [
        (_named("nixlRemoteDisconnectError"), PeerGoneError),
        (_named("nixlNotFoundError"), RegionNotRegisteredError),
        (RuntimeError("memory has been unregistered"), RegionNotRegisteredError),
        (_named("nixlBackendError"), TransportError),
        (RuntimeError("transport is closed"), TransportError),
        (TimeoutError("transport wait timed out"), TransportError),
        (ValueError("view exceeds the registered memory"), InvalidArgumentError),
    ],
)
def test_torch_and_nixl_errors_become_the_projects(error, ours):
    with pytest.raises(ours, match="reading x") as info:
        with torch_errors("reading x"):
            raise error
    assert info.value.__cause__ is error
    with pytest.raises(KeyError):  # neither torch's nor NIXL's: left alone
        with torch_errors("reading x"):
            raise KeyError("k")


def test_bad_options_and_memory():
    t = TorchTransport()
    with pytest.raises(InvalidArgumentError, match="cannot allocate on 'tpu'"):
        t.allocate(16, "tpu")
    with pytest.raises(InvalidArgumentError, match="as a torch tensor only"):
        t.register(bytearray(16), device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="descriptor"):
        t.connect(b'{"torch_transport": "tcp", "buffer": null, "nbytes": 0}')
