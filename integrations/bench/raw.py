"""The same bytes without weightpull: the `raw` figure each bench sets beside a pull.

A driver's own reader of a whole exported region where the bench has one (nixl: one agent,
one prepared transfer, polled as fast as it can), else one read of the whole slot through
the driver (no lease, no buckets). The drivers carry nothing of this: it is the bench's.
"""

from __future__ import annotations

import base64
import ctypes
import json
import mmap
import os
import time
import uuid
from typing import Any

import anyio

from weightpull.errors import TransportError
from weightpull.manifest import Manifest
from weightpull.transport import Region, Transport


class NixlRead:
    """One NIXL agent reading one peer region whole, polling as fast as it can: the
    limit a weightpull pull over NIXL is measured against."""

    def __init__(self, descriptor: bytes, device: str = "cpu", pinned: bool = False) -> None:
        from weightpull.drivers.nixl import nixl_api

        api = nixl_api()
        d = json.loads(descriptor)
        nbytes = int(d["len"])
        if device == "cpu" and not pinned:
            self.memory: Any = mmap.mmap(-1, nbytes)
            view = memoryview(self.memory)
            addr, dev, mem = ctypes.addressof((ctypes.c_char * nbytes).from_buffer(view)), 0, "DRAM"
        else:
            import torch

            if device == "cpu":
                self.memory = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            else:
                self.memory = torch.empty(nbytes, dtype=torch.uint8, device=device)
            addr, dev = self.memory.data_ptr(), self.memory.device.index or 0
            mem = "VRAM" if self.memory.is_cuda else "DRAM"
        self.nbytes = nbytes
        config = api.nixl_agent_config(enable_prog_thread=False, backends=["UCX"])
        self.agent = api.nixl_agent(f"raw-{os.getpid()}-{uuid.uuid4().hex[:8]}", config)
        self.agent.register_memory([(addr, nbytes, dev, "")], mem)
        peer = self.agent.add_remote_agent(base64.b64decode(d["md"]))
        local = self.agent.get_xfer_descs([(addr, nbytes, dev)], mem)
        remote = self.agent.get_xfer_descs([(int(d["addr"]), nbytes, int(d["dev"]))], d["mem"])
        self.xfer = self.agent.initialize_xfer("READ", local, remote, peer)

    def read(self) -> float:
        """Seconds one whole read took."""
        start = time.perf_counter()
        state = self.agent.transfer(self.xfer)
        while state == "PROC":
            state = self.agent.check_xfer_state(self.xfer)
        if state != "DONE":
            raise TransportError(f"raw NIXL read ended {state}")
        return time.perf_counter() - start

    def close(self) -> None:
        self.xfer.release()


OWN_READERS: dict[str, type[NixlRead]] = {"nixl": NixlRead}


def own_reader(transport: str) -> type[NixlRead] | None:
    """The driver's own whole-region reader, where the bench has one."""
    return OWN_READERS.get(transport)


class RawRead:
    """Per version: the driver's own read of the slot, else one whole-slot read through
    the driver itself. `pinned`: the own reader lands in page-locked memory, as a staged
    mirror's host leg does."""

    def __init__(self, transport_name: str, transport: Transport, pinned: bool = False) -> None:
        self.own, self.transport, self.pinned = own_reader(transport_name), transport, pinned
        self._readers: dict[bytes, Any] = {}
        self.name = f"{transport_name}'s own read" if self.own else "one whole-slot read"

    async def seconds(self, manifest: Manifest, region: Region) -> float:
        source = manifest.source
        if self.own is not None:  # the host leg alone, where the mirror is staged
            if source not in self._readers:
                self._readers[source] = self.own(source, device="cpu", pinned=self.pinned)
                await anyio.to_thread.run_sync(self._readers[source].read)  # warm: its buffer's first touch
            return await anyio.to_thread.run_sync(self._readers[source].read)
        if source not in self._readers:
            self._readers[source] = self.transport.connect(source)
        started = time.perf_counter()
        await self.transport.read(self._readers[source], 0, region, 0, manifest.nbytes)
        return time.perf_counter() - started

    def close(self) -> None:
        for reader in self._readers.values():
            if self.own is not None:
                reader.close()
            else:
                self.transport.disconnect(reader)
