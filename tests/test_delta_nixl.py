"""Deltas between processes: the registry served over ZeroMQ, a trainer process publishing
versions with deltas into nixl-registered slots, and a replica (this process) that reads
the first whole and each later one as its delta alone, one-sidedly over nixl, patched and
checked byte for byte."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

from weightpull import Puller, create_transport, list_transports
from weightpull.transport import WrappedTransport

pytest.importorskip("zmq")
if not any(d.name == "nixl" and d.available for d in list_transports()):
    pytest.skip("the nixl driver is not available here", allow_module_level=True)

from weightpull.registry import connect_registry  # noqa: E402

from .served import ServedRegistry, env, make_keys  # noqa: E402
from .test_delta import exact  # noqa: E402

pytestmark = pytest.mark.anyio

TRAINER = textwrap.dedent("""
    import sys, anyio
    from weightpull import Publisher, create_transport
    from weightpull.registry import connect_registry
    from tests.test_delta import model

    async def main():
        registry = connect_registry(sys.argv[1], key=sys.argv[2], server_key=sys.argv[3])
        publisher = Publisher(registry, create_transport("nixl"), bucket_bytes=4096, name="trainer",
                              digests="wsum64", deltas=True)
        async with anyio.create_task_group() as tg:
            tg.start_soon(publisher.transport.serve)  # replicas' reads need our agent's progress
            while line := await anyio.to_thread.run_sync(sys.stdin.readline):
                result = await publisher.publish(int(line), model(int(line)))
                print("published", result.manifest.delta.nbytes if result.manifest.delta else 0, flush=True)
            tg.cancel_scope.cancel()
        await publisher.aclose()
        await publisher.transport.aclose()
        await registry.aclose()

    anyio.run(main)
""")


class Counting(WrappedTransport):
    """The nixl driver, counting the bytes read."""

    read_bytes = 0

    async def read(self, remote, remote_offset, local, local_offset, nbytes):
        self.read_bytes += nbytes
        await self.inner.read(remote, remote_offset, local, local_offset, nbytes)


async def test_a_replica_reads_each_later_version_as_its_delta_over_nixl(tmp_path):
    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "replica"))
    server = ServedRegistry(tmp_path, keys=keys)
    server.start()
    trainer_key = server.key("trainer")
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, server.address, trainer_key["key"], trainer_key["server_key"]],
        env=env(secret=None),
        text=True,
        cwd=Path(__file__).parent.parent,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    registry = connect_registry(server.address, **server.key("replica"))
    transport = Counting(create_transport("nixl"))
    puller = Puller(registry, transport)
    try:
        for version in (1, 2, 3):
            trainer.stdin.write(f"{version}\n")
            trainer.stdin.flush()
            said = (await anyio.to_thread.run_sync(trainer.stdout.readline)).split()
            assert said[0] == "published"
            before = transport.read_bytes
            pulled = await puller.pull()
            assert exact(pulled, version) and pulled.manifest.transport == "nixl"
            if version == 1:
                assert pulled.base is None and transport.read_bytes - before == sum(
                    b.nbytes for b in pulled.layout.buckets
                )
            else:  # the section alone crossed: 40 changed elements, not the 12 KB version
                assert pulled.base == version - 1 and transport.read_bytes - before == int(said[1]) < 400
    finally:
        trainer.stdin.close()
        trainer.wait(timeout=30)
        await puller.aclose()
        await transport.aclose()
        await registry.aclose()
        server.stop()
