"""GPU mirrors through pinned host memory, for transports whose own GPU path is slow.

`HostStaged(transport)` wraps any driver. A GPU region it allocates or registers gets a
pinned host shadow, registered with the inner driver: each read lands in the shadow over
the inner driver's host-to-host path, then a copy on a side stream moves that span to the
GPU while the puller's next bucket is being read. So a pull pipelines the host read and
the host-to-device copy bucket by bucket. Host regions pass straight through.

On a machine where NIXL's UCX reads into GPU memory fall back to tcp emulation (under
1 GB/s), this is the fast path: NIXL host-to-host into the pinned shadow, then ~50 GB/s
to the GPU.
"""

from __future__ import annotations

from typing import Any

import anyio
import attrs
import torch

from weightpull.errors import InvalidArgumentError
from weightpull.transport import Region, Remote, Transport, WrappedTransport, check_span

_POLL_S = 0.0001  # how often a read waits on its copy's CUDA event


@attrs.define(eq=False)
class _Staged:
    shadow: Region  # the inner driver's registration of `host`
    host: torch.Tensor  # pinned, as long as the GPU region


class HostStaged(WrappedTransport):
    """A GPU mirror for any driver: reads land in pinned host memory registered with
    `inner`, then copy to the GPU region (a puller wraps a driver that cannot read into
    GPU memory itself in one).

    Args:
        inner: The driver that reads.
    """

    reads_into_gpu = True  # its own copies land each read on the GPU

    def __init__(self, inner: Transport) -> None:
        super().__init__(inner)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._staged: dict[Region, _Staged] = {}

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return None if torch.cuda.is_available() else "no CUDA device"

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        if device == "cuda" or device.startswith("cuda:"):
            return self.register(torch.empty(nbytes, dtype=torch.uint8, device=device), device)
        return self.inner.allocate(nbytes, device)

    def register(self, memory: Any, device: str = "cpu") -> Region:
        if not (isinstance(memory, torch.Tensor) and memory.is_cuda):
            return self.inner.register(memory, device)
        if not memory.is_contiguous():
            raise InvalidArgumentError("HostStaged needs a contiguous GPU tensor")
        flat = memory.view(torch.uint8).view(-1)
        host = torch.empty(flat.numel(), dtype=torch.uint8, pin_memory=True)
        shadow = self.inner.register(host.numpy())
        region = Region(nbytes=flat.numel(), device=str(flat.device), memory=flat, handle=shadow)
        self._staged[region] = _Staged(shadow, host)
        return region

    def deregister(self, region: Region) -> None:
        staged = self._staged.pop(region, None)
        self.inner.deregister(staged.shadow if staged else region)

    def export(self, region: Region) -> bytes:
        if region in self._staged:
            raise InvalidArgumentError(
                "a staged GPU region is a reader's mirror; publish from host or plain GPU memory"
            )
        return self.inner.export(region)

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        if local not in self._staged:
            return await self.inner.read(remote, remote_offset, local, local_offset, nbytes)
        check_span("local", local_offset, nbytes, local.nbytes)
        await self.inner.read(remote, remote_offset, self._staged[local].shadow, local_offset, nbytes)
        await self.to_device(local, local_offset, nbytes)

    async def to_device(self, region: Region, offset: int, nbytes: int) -> None:
        """Copy a span of `region`'s pinned shadow to the GPU on a side stream; return once
        it landed. Concurrent calls queue on the stream, back to back."""
        staged = self._staged.get(region)
        if staged is None:
            raise InvalidArgumentError("to_device needs a GPU region this HostStaged registered")
        check_span("local", offset, nbytes, region.nbytes)
        span = slice(offset, offset + nbytes)
        device = region.memory.device
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        with torch.cuda.stream(self._streams[device]):
            region.memory[span].copy_(staged.host[span], non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        while not done.query():  # the next bucket's host read runs meanwhile
            await anyio.sleep(_POLL_S)

    async def aclose(self) -> None:
        self._staged.clear()
        await self.inner.aclose()
