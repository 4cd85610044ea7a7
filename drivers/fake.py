"""The `fake` driver: in-process memory, with fault knobs.

Every `FakeTransport` of a process attaches to a shared `FakeFabric`, so a publisher and
its pullers in one process read each other's regions as real peers would. The knobs in
`FakeFaults` inject what real transports do: latency, a slow reader, failed reads, and a
torn read, where the reader freezes past any lease while the publisher's next write
lands in the middle of the copy. They are `weightpull.drivers.faulty.Faults`, applied
by the same code that `FaultyTransport` wraps around any other driver.
"""

from __future__ import annotations

import ctypes
import itertools
import json
import os
import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.lowlevel

from weightpull.clock import Clock, FakeClock, MonotonicClock
from weightpull.drivers.faulty import CHUNK, FaultInjector, Faults, row_runs
from weightpull.errors import (
    InvalidArgumentError,
    PeerGoneError,
    RegionNotRegisteredError,
    TransportError,
)
from weightpull.tasks import each_at_once
from weightpull.transport import Read2D, Region, Remote, Transport, check_2d, check_span, span_2d, writable_bytes

_fabrics: weakref.WeakValueDictionary[str, FakeFabric] = weakref.WeakValueDictionary()


def _memmove(dst: memoryview, src: memoryview) -> None:
    """memcpy without the GIL, as a NIC's DMA would copy: the event loop keeps running."""
    n = len(src)
    ctypes.memmove((ctypes.c_char * n).from_buffer(dst), (ctypes.c_char * n).from_buffer(src), n)


class FakeFabric:
    """The shared memory space of a set of fake transports (one per process by default):
    a fake transport reads only regions of its own fabric, as a real one reads only what
    its network reaches."""

    _default: FakeFabric | None = None

    def __init__(self) -> None:
        self.id = uuid.uuid4().hex
        self.regions: dict[int, Region] = {}
        self.owners: dict[int, str] = {}  # region id -> owning transport id
        self.closed: set[str] = set()  # transports that have closed ("exited")
        self._ids = itertools.count(1)
        _fabrics[self.id] = self

    @classmethod
    def default(cls) -> FakeFabric:
        """The process's fabric, which fake transports share unless given another."""
        if cls._default is None:
            cls._default = cls()
        return cls._default

    def new_id(self) -> int:
        return next(self._ids)


FakeFaults = Faults  # the fake's knobs: the faults any driver can be wrapped in


class FakeTransport(Transport):
    """The `fake` driver: in-process host memory, with fault knobs (`Faults`: a delay,
    a bandwidth, failed and torn reads), for tests and the demo. Its reads reach the
    regions of its fabric, in this process; its faults are those `FaultyTransport` wraps
    any driver in."""

    name = "fake"
    native_2d = True
    slow_allocate = False  # a bytearray: instant, and fake-clock runs stay deterministic

    def __init__(
        self,
        *,
        clock: Clock | None = None,
        faults: FakeFaults | None = None,
        fabric: FakeFabric | None = None,
        offload: bool | None = None,
    ) -> None:
        """Make an endpoint on `fabric`.

        Args:
            clock: The clock its injected latencies run on.
            faults: The faults it injects (none by default).
            fabric: The memory space it shares with other fake transports (default: the
                process's).
            offload: Copy in worker threads, off the event loop (the default on a real
                clock); under a `FakeClock` copies run inline and take no time, so tests
                replay.
        """
        self.clock = clock or MonotonicClock()
        self.offload = not isinstance(self.clock, FakeClock) if offload is None else offload
        self.faults = faults or FakeFaults()
        self.fabric = fabric or FakeFabric.default()
        self.id = uuid.uuid4().hex
        self._mine: dict[int, Region] = {}
        self._closed = False
        self._injector = FaultInjector(self.clock)

    # -- registration ---------------------------------------------------------------------

    def register(self, memory: Any, device: str = "cpu") -> Region:
        self._check_open()
        if device != "cpu":
            raise InvalidArgumentError(f"fake transport holds host memory only, not {device!r}")
        view = writable_bytes("fake", memory)
        region = Region(nbytes=view.nbytes, device="cpu", memory=memory, view=view, handle=self.fabric.new_id())
        self.fabric.regions[region.handle] = region
        self.fabric.owners[region.handle] = self.id
        self._mine[region.handle] = region
        return region

    def deregister(self, region: Region) -> None:
        if self._mine.pop(region.handle, None) is not None:
            self.fabric.regions.pop(region.handle, None)
            self.fabric.owners.pop(region.handle, None)

    def export(self, region: Region) -> bytes:
        if region.handle not in self._mine:
            raise RegionNotRegisteredError("cannot export a region this transport did not register")
        return json.dumps(
            {
                "fabric": self.fabric.id,
                "owner": self.id,
                "region": region.handle,
                "nbytes": region.nbytes,
                "pid": os.getpid(),
            }
        ).encode()

    def connect(self, descriptor: bytes) -> Remote:
        try:
            d = json.loads(descriptor)
            fabric = _fabrics.get(d["fabric"])
            remote = Remote(int(d["nbytes"]), descriptor, handle=(fabric, d["owner"], int(d["region"])))
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"not a fake-transport descriptor: {descriptor[:80]!r}") from exc
        if fabric is None:
            pid = d.get("pid")
            if pid is not None and pid != os.getpid():  # the usual slip: a fake used across processes
                raise PeerGoneError(
                    f"that descriptor was exported by process {pid}, and the fake transport works within one "
                    "process only: across processes use nixl, or cuda_ipc on one host (`weightpull drivers` "
                    "lists those that load here)"
                )
            raise PeerGoneError(
                "that descriptor's fabric is gone: every fake transport that shared it has been "
                "collected (the fake transport works within one process only)"
            )
        return remote

    def view(self, remote: Remote, device: str = "cpu") -> Region | None:
        """The peer's bytes themselves, read-only (one process: one memory)."""
        if device != "cpu":
            return None
        source = self._peer(remote)
        view = source.host_view()[: remote.nbytes].toreadonly()
        return Region(nbytes=view.nbytes, device="cpu", memory=source.memory, view=view)

    # -- reading -------------------------------------------------------------------------

    def _peer(self, remote: Remote) -> Region:
        """The peer's region `remote` names, while it is registered and its owner open."""
        self._check_open()
        fabric, owner, region_id = remote.handle
        if owner in fabric.closed:
            raise PeerGoneError(f"peer {owner[:8]} has exited")
        source = fabric.regions.get(region_id)
        if source is None:
            raise RegionNotRegisteredError(f"remote region {region_id} is not registered")
        return source

    def _source(self, remote: Remote, local: Region) -> Region:
        """The peer's region a read of `remote` into `local` copies from, once both hold."""
        source = self._peer(remote)
        if self._mine.get(local.handle) is not local:
            raise RegionNotRegisteredError("the local region is not registered with this transport")
        return source

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        source = self._source(remote, local)
        check_span("remote", remote_offset, nbytes, source.nbytes)
        check_span("local", local_offset, nbytes, local.nbytes)

        src = source.host_view()[remote_offset : remote_offset + nbytes]
        dst = local.host_view()[local_offset : local_offset + nbytes]

        async def copy(start: int, stop: int) -> None:
            await self._copy(src[start:stop], dst[start:stop])

        await self._injector.read(self.faults, nbytes, copy, dst)

    async def read_2d_many(self, reads: Sequence[Read2D]) -> None:
        """Each 2-D read's rows copied by one call (in a worker thread when offloading),
        its faults applied once to its bytes laid end to end."""

        for read in reads:  # every read checked before any lands
            check_2d(read)
            remote, r_off, r_pitch, local, l_off, l_pitch, width, height = read
            source = self._source(remote, local)
            check_span("remote", *span_2d(r_off, r_pitch, width, height), source.nbytes)
            check_span("local", *span_2d(l_off, l_pitch, width, height), local.nbytes)

        async def one(read: Read2D) -> None:
            remote, r_off, r_pitch, local, l_off, l_pitch, width, height = read
            src, dst = self._source(remote, local).host_view(), local.host_view()

            def rows(start: int, stop: int) -> None:
                for row, col, n, count in row_runs(width, start, stop):
                    for i in range(row, row + count):
                        s, d = r_off + i * r_pitch + col, l_off + i * l_pitch + col
                        dst[d : d + n] = src[s : s + n]  # rows are short: a slice copy costs less than ctypes

            async def copy(start: int, stop: int) -> None:
                if self.offload:
                    await anyio.to_thread.run_sync(rows, start, stop)
                else:
                    rows(start, stop)
                    await anyio.lowlevel.checkpoint()

            await self._injector.read(self.faults, width * height, copy, None)

        await each_at_once(one, reads)

    async def _copy(self, src: memoryview, dst: memoryview) -> None:
        """Copy in chunks, yielding between them, so reads stay cancellable."""
        for start in range(0, len(src), CHUNK):
            n = min(CHUNK, len(src) - start)
            if self.offload:
                await anyio.to_thread.run_sync(_memmove, dst[start : start + n], src[start : start + n])
            else:
                dst[start : start + n] = src[start : start + n]
                await anyio.lowlevel.checkpoint()

    # -- lifetime ------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError("this fake transport is closed")

    async def aclose(self) -> None:
        for region in list(self._mine.values()):
            self.deregister(region)
        self.fabric.closed.add(self.id)
        self._closed = True
