"""The Transport ABC: move bytes one-sidedly between registered regions.

A driver registers memory, exports a descriptor for it, connects to a peer's descriptor
and reads from it. Nothing else: leases, layouts and retries live above, in the core.
Drivers translate their library's failures into `TransportError` subclasses.
"""

from __future__ import annotations

import ctypes
import mmap
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Self

import anyio
import attrs

from .errors import InvalidArgumentError, RegionNotRegisteredError, TransportError


@attrs.define(eq=False)
class Region:
    """Memory registered with a transport. `view` is set for host memory; `memory`
    keeps the owning object (a bytearray, a pinned or device tensor...) alive."""

    nbytes: int
    device: str
    memory: Any
    view: memoryview | None = None
    handle: Any = None  # the driver's own registration

    def host_view(self) -> memoryview:
        if self.view is None:
            raise InvalidArgumentError(f"region on {self.device} has no host view")
        return self.view


@attrs.define(eq=False)
class Remote:
    """A peer's region, as `connect` imported it from a descriptor."""

    nbytes: int
    descriptor: bytes
    handle: Any = None


class Transport(ABC):
    """One endpoint of a transport. Async reads; everything else is quick and sync."""

    name: ClassVar[str]
    # Reads land in GPU memory at device speed by the driver's own means. A puller keeps a
    # GPU mirror of any other driver's reads through pinned host memory (`HostStaged`).
    reads_into_gpu: ClassVar[bool] = False
    # `allocate` may take seconds (page-locking, registering gigabytes): publishers and
    # pullers call it in a worker thread, off the event loop. A driver whose allocation is
    # instant (the fake one) says False, and keeps fake-clock runs deterministic.
    slow_allocate: ClassVar[bool] = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this driver cannot run here (no GPU, too old a library...), or None."""
        return None

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        """Allocate and register `nbytes`. Drivers override this for pinned or device
        memory; the default is anonymous host memory, which the OS zeroes lazily, so a
        large slot costs nothing until it is written (no stall of the event loop)."""
        if device != "cpu":
            raise InvalidArgumentError(f"{self.name} transport cannot allocate on {device!r}")
        return self.register(mmap.mmap(-1, nbytes) if nbytes else bytearray())

    @abstractmethod
    def register(self, memory: Any, device: str = "cpu") -> Region:
        """Register memory the caller owns (any contiguous writable buffer on the host)."""

    @abstractmethod
    def deregister(self, region: Region) -> None:
        """Undo `register`; peers reading it get `RegionNotRegisteredError`."""

    @abstractmethod
    def export(self, region: Region) -> bytes:
        """A descriptor a peer in any process can `connect` to."""

    @abstractmethod
    def connect(self, descriptor: bytes) -> Remote:
        """Import a peer's descriptor. Cheap to repeat; drivers may cache."""

    def disconnect(self, remote: Remote) -> None:  # noqa: B027 - optional hook
        """Forget a peer region; drivers with per-peer state override this."""

    @abstractmethod
    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        """Copy `nbytes` from `remote` at `remote_offset` into `local` at `local_offset`."""

    async def read_many(self, reads: Sequence[tuple[Remote, int, Region, int, int]]) -> None:
        """Make every `(remote, remote_offset, local, local_offset, nbytes)` read, concurrently;
        return once all landed. A driver whose reads are cheap to queue (device copies)
        overrides it to queue them all and wait once: a task per read costs more than a
        device copy of a bucket."""
        async with anyio.create_task_group() as tg:
            for r in reads:
                tg.start_soon(self.read, *r)

    async def serve(self) -> None:  # noqa: B027 - optional hook
        """Help peers' reads of this endpoint's memory along, until cancelled. Drivers whose
        reads need the owner's own progress (NIXL's first connection, GPU memory over tcp)
        loop here; the default has nothing to do and returns at once. The transport starts
        no task: its owner runs this one (`async with Publisher(...)` does)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release every registration and connection."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        with anyio.CancelScope(shield=True):  # released even when the block was cancelled
            await self.aclose()


class RegionTable:
    """What most drivers keep about themselves: the regions this endpoint registered
    (by handle) and whether it is closed. Mixed into a driver beside `Transport`."""

    name: ClassVar[str]
    _regions: dict[Any, Region]
    _closed: bool

    def _mine(self, region: Region, doing: str) -> Any:
        """The region's handle, if this endpoint registered it."""
        if self._regions.get(region.handle) is not region:
            raise RegionNotRegisteredError(
                f"cannot {doing} a local region this {self.name} transport has not registered"
            )
        return region.handle

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"this {self.name} transport is closed")


class WrappedTransport(Transport):
    """A transport that passes everything to `inner`. Wrappers (injected faults, GPU
    staging) subclass it and override only what they change; manifests name the inner
    driver, so a wrapped reader pulls what a plain publisher of that driver published."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.name = inner.name  # type: ignore[misc]

    @property  # a class attribute of drivers; a wrapper's is its inner driver's
    def reads_into_gpu(self) -> bool:  # type: ignore[override]
        return self.inner.reads_into_gpu

    @property
    def slow_allocate(self) -> bool:  # type: ignore[override]
        return self.inner.slow_allocate

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        return self.inner.allocate(nbytes, device)

    def register(self, memory: Any, device: str = "cpu") -> Region:
        return self.inner.register(memory, device)

    def deregister(self, region: Region) -> None:
        self.inner.deregister(region)

    def export(self, region: Region) -> bytes:
        return self.inner.export(region)

    def connect(self, descriptor: bytes) -> Remote:
        return self.inner.connect(descriptor)

    def disconnect(self, remote: Remote) -> None:
        self.inner.disconnect(remote)

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        await self.inner.read(remote, remote_offset, local, local_offset, nbytes)

    async def serve(self) -> None:
        await self.inner.serve()

    async def aclose(self) -> None:
        await self.inner.aclose()


def check_span(what: str, offset: int, nbytes: int, size: int) -> None:
    """Raise unless [offset, offset + nbytes) lies inside a region of `size` bytes."""
    if offset < 0 or nbytes < 0 or offset + nbytes > size:
        raise RegionNotRegisteredError(
            f"{what} range [{offset}, {offset + nbytes}) lies outside the registered {size} bytes"
        )


def writable_bytes(driver: str, memory: Any) -> memoryview:
    """`memory` (a buffer) as a writable byte view, or `InvalidArgumentError` naming why
    `driver` cannot register it: readers write into what is registered."""
    try:
        view = memoryview(memory).cast("B")
    except TypeError as exc:
        raise InvalidArgumentError(f"{driver} transport cannot register {type(memory).__name__}: {exc}") from exc
    if view.readonly:
        raise InvalidArgumentError(f"{driver} transport needs writable memory")
    return view


def address_of(view: memoryview) -> int:
    """Where a writable byte view's memory starts (0 when empty)."""
    return ctypes.addressof((ctypes.c_char * view.nbytes).from_buffer(view)) if view.nbytes else 0
