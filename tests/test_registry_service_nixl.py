"""The whole deployment's shape, each part in its own process: the registry served over
ZeroMQ, a trainer publishing into nixl-registered slots, and a replica (this process)
pulling them one-sidedly over nixl, checked byte for byte."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from weightpull import Puller, create_transport, list_transports

pytest.importorskip("zmq")
if not any(d.name == "nixl" and d.available for d in list_transports()):
    pytest.skip("the nixl driver is not available here", allow_module_level=True)

from weightpull.drivers.zmq_registry.client import ZmqRegistry  # noqa: E402

from .conftest import host_tensors  # noqa: E402
from .served import SECRET, ServedRegistry, env  # noqa: E402

pytestmark = pytest.mark.anyio
SIZES = (300_000, 3000, 70_000)

TRAINER = textwrap.dedent(f"""
    import sys, anyio
    from weightpull import Publisher, create_transport
    from weightpull.drivers.zmq_registry.client import ZmqRegistry
    from tests.conftest import host_tensors

    async def main():
        registry = ZmqRegistry(sys.argv[1])
        publisher = Publisher(registry, create_transport("nixl"), rollout_dtype=None, bucket_bytes=64 << 10,
                              name="trainer")
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.transport.serve)  # replicas' reads need our agent's progress
            while line := await anyio.to_thread.run_sync(sys.stdin.readline):
                version = int(line)
                await publisher.publish(version, host_tensors(version, sizes={SIZES!r}))
                print("published", version, flush=True)
            tg.cancel_scope.cancel()
        await publisher.aclose()
        await publisher.transport.aclose()
        await registry.aclose()

    anyio.run(main)
""")


async def test_publish_and_pull_across_processes_over_nixl(tmp_path):
    server = ServedRegistry(tmp_path)
    server.start()
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, server.address],
        env=env(),
        text=True,
        cwd=Path(__file__).parent.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    registry = ZmqRegistry(server.address, secret=SECRET)
    transport = create_transport("nixl")
    puller = Puller(registry, transport, holder="replica-0")

    async def publish(version: int) -> None:
        trainer.stdin.write(f"{version}\n")
        trainer.stdin.flush()
        assert (await anyio.to_thread.run_sync(trainer.stdout.readline)).split() == ["published", str(version)]

    try:
        for version in (1, 2, 3):
            await publish(version)
            pulled = await puller.pull()
            assert pulled.version == version and pulled.manifest.transport == "nixl"
            assert len(pulled.layout.buckets) == 3  # one read per bucket
            for name, t in host_tensors(version, sizes=SIZES).items():
                assert bytes(pulled.view(name)) == t.data
            await registry.report_serving("replica-0", version)
        status = await registry.status()
        assert status.newest_ready == 3 and status.serving == {"replica-0": 3} and status.leases == ()
    finally:
        trainer.stdin.close()
        await anyio.to_thread.run_sync(trainer.wait, 30)
        await puller.aclose()
        await transport.aclose()
        await registry.aclose()
        server.stop()
    assert trainer.returncode == 0
