"""A trainer in a process of its own, for tests/test_trust_processes.py. It publishes over
nixl into the served registry at argv[1] as the publisher principal its $WEIGHTPULL_KEY
names (`--stream`: with `Publisher(stream=True)`), one command per stdin line:

    publish STEP   publish host_tensors(STEP); print "published VERSION STEP"
    stall STEP     begin publishing host_tensors(STEP), then stall after STALL_AFTER of its
                   tensors (one a bucket): print "stalled VERSION" and wait forever, its
                   event loop, registry heartbeat and nixl progress still running

It prints "ready NAME" once it can take commands, and ends at the end of stdin (or a
SIGKILL, which is what the tests send it mid-copy).

    python -m tests.trust_publisher ADDRESS [--stream]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import anyio

from weightpull import Publisher, create_transport
from weightpull.drivers.zmq_registry.client import ZmqRegistry
from weightpull.layout import Placement
from weightpull.tensors import HostTensor, HostTensorAdapter
from weightpull.transport import Region

from .conftest import host_tensors

SIZES = (40_000,) * 6  # six buckets of one tensor each
BUCKET_BYTES = 64 << 10
STALL_AFTER = 3
HEARTBEAT = 0.2  # well inside the tests' liveness TTL


class StallingAdapter(HostTensorAdapter):
    """Copies as the host adapter does, one tensor at a time; with `stall`, stops for good
    before the tensor numbered STALL_AFTER, saying so on stdout."""

    def __init__(self, publisher: Publisher) -> None:
        self.publisher = publisher
        self.stall = False
        self.written = 0

    async def write(self, items: Sequence[tuple[HostTensor, Placement]], region: Region) -> None:
        for item in items:
            if self.stall and self.written == STALL_AFTER:
                print("stalled", self.publisher.last_version, flush=True)
                await anyio.sleep_forever()
            await super().write([item], region)
            self.written += 1


async def main(address: str, stream: bool) -> None:
    async with ZmqRegistry(address, heartbeat=HEARTBEAT) as registry:
        publisher = Publisher(
            registry, create_transport("nixl"), rollout_dtype=None, bucket_bytes=BUCKET_BYTES, stream=stream
        )
        adapter = StallingAdapter(publisher)
        publisher.adapter = adapter
        async with publisher:  # serves nixl's progress while it runs
            print("ready", publisher.name, flush=True)
            while line := await anyio.to_thread.run_sync(sys.stdin.readline):
                command, step = line.split()
                adapter.stall, adapter.written = command == "stall", 0
                result: Any = await publisher.publish(int(step), host_tensors(int(step), SIZES))
                print("published", result.version, result.manifest.step, flush=True)
        await publisher.transport.aclose()


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], "--stream" in sys.argv[2:])
