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

from .errors import InvalidArgumentError, RegionNotRegisteredError, TransportError, first_error


@attrs.define(eq=False)
class Region:
    """Memory registered with a transport (what `Transport.allocate` and `register` return).

    Attributes:
        nbytes: Its size in bytes.
        device: Where it lies: "cpu" or a device such as "cuda:0".
        memory: The owning object (a bytearray, an mmap, a pinned or device tensor...),
            kept alive as long as the region.
        view: A writable byte view of host memory; None for device memory.
        handle: The driver's own registration.
    """

    nbytes: int
    device: str
    memory: Any
    view: memoryview | None = None
    handle: Any = None  # the driver's own registration

    def host_view(self) -> memoryview:
        """The region's bytes, for host memory.

        Raises:
            InvalidArgumentError: The region lies on a device and has no host view.
        """
        if self.view is None:
            raise InvalidArgumentError(f"region on {self.device} has no host view")
        return self.view


@attrs.define(eq=False)
class Remote:
    """A peer's region, as `Transport.connect` imported it from a descriptor.

    Attributes:
        nbytes: The size the descriptor claims; the peer's driver refuses reads past what
            it registered.
        descriptor: The bytes the peer's `Transport.export` made.
        handle: The driver's own import of it.
    """

    nbytes: int
    descriptor: bytes
    handle: Any = None


_ROWS_AT_ONCE = 4096  # rows the default 2-D read hands `read_many` at a time

# (remote, remote_offset, remote_pitch, local, local_offset, local_pitch, width, height)
Read2D = tuple[Remote, int, int, Region, int, int, int, int]


def check_2d(read: Read2D) -> None:
    """Raise unless a 2-D read's sizes make sense: rows apart on the local side never
    overlap (each byte landed once)."""
    _, r_off, r_pitch, _, l_off, l_pitch, width, height = read
    if min(r_off, r_pitch, l_off, l_pitch, width, height) < 0:
        raise InvalidArgumentError(f"a 2-D read's offsets, pitches and sizes must be >= 0, got {read[1:3]}, {read[4:]}")
    if height > 1 and l_pitch < width:
        raise InvalidArgumentError(
            f"a 2-D read's local pitch {l_pitch} is less than its width {width}: rows would overlap"
        )


def rows_of(read: Read2D) -> list[tuple[Remote, int, Region, int, int]]:
    """A 2-D read as plain reads, one per row."""
    check_2d(read)
    remote, r_off, r_pitch, local, l_off, l_pitch, width, height = read
    return [(remote, r_off + i * r_pitch, local, l_off + i * l_pitch, width) for i in range(height)] if width else []


def span_2d(offset: int, pitch: int, width: int, height: int) -> tuple[int, int]:
    """(first byte, bytes to the end of the last row) that a 2-D read touches on one side."""
    return offset, (height - 1) * pitch + width if width and height else 0


class Transport(ABC):
    """One endpoint of a transport: registers memory, exports descriptors of it, and reads
    a peer's registered memory one-sidedly. Async reads; everything else is quick and sync.

    A driver subclasses it, names itself in `name` and registers with
    `register_transport` (or the entry-point group `weightpull.transports`); the
    conformance suite (`weightpull.drivers.testing`) checks what every driver must do.
    Drivers translate their library's failures into `TransportError` subclasses:
    `RegionNotRegisteredError` for a range or region not registered, `PeerGoneError` when
    the peer's process is gone, `InvalidArgumentError` for memory or a descriptor it cannot
    take, `TransportError` once closed.

    Attributes:
        name: The driver's name, as `create_transport` takes it and manifests record it.
        reads_into_gpu: Reads land in GPU memory at device speed by the driver's own means
            (else a puller stages a GPU mirror through pinned host memory).
        slow_allocate: `allocate` may take seconds, so callers run it in a worker thread.
        native_2d: `read_2d_many` posts a 2-D read's rows as one request.
    """

    name: ClassVar[str]
    # Reads land in GPU memory at device speed by the driver's own means. A puller keeps a
    # GPU mirror of any other driver's reads through pinned host memory (`HostStaged`).
    reads_into_gpu: ClassVar[bool] = False
    # `allocate` may take seconds (page-locking, registering gigabytes): publishers and
    # pullers call it in a worker thread, off the event loop. A driver whose allocation is
    # instant (the fake one) says False, and keeps fake-clock runs deterministic.
    slow_allocate: ClassVar[bool] = True
    # `read_2d_many` posts a 2-D read's rows as one request, not one read per row.
    native_2d: ClassVar[bool] = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why this driver cannot run here (no GPU, too old a library...).

        Returns:
            The reason, for a user; None where it can run.
        """
        return None

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        """Allocate and register `nbytes`. Drivers override this for pinned or device
        memory; the default is anonymous host memory, which the OS zeroes lazily, so a
        large slot costs nothing until it is written (no stall of the event loop).

        Args:
            nbytes: The size in bytes.
            device: "cpu", or a device the driver can allocate on.

        Returns:
            The registered region.

        Raises:
            InvalidArgumentError: The driver cannot allocate on `device`.
        """
        if device != "cpu":
            raise InvalidArgumentError(f"{self.name} transport cannot allocate on {device!r}")
        return self.register(mmap.mmap(-1, nbytes) if nbytes else bytearray())

    @abstractmethod
    def register(self, memory: Any, device: str = "cpu") -> Region:
        """Register memory the caller owns, so that peers can read it once exported.

        Args:
            memory: Any contiguous writable buffer on the host (or a device tensor, for a
                driver that takes them).
            device: Where `memory` lies.

        Returns:
            The registered region; it keeps `memory` alive.

        Raises:
            InvalidArgumentError: `memory` is read-only, not a buffer, or on a device the
                driver cannot register.
        """

    @abstractmethod
    def deregister(self, region: Region) -> None:
        """Undo `register` (twice is harmless); later reads of it by peers raise
        `RegionNotRegisteredError`.

        Args:
            region: A region this endpoint registered.
        """

    @abstractmethod
    def export(self, region: Region) -> bytes:
        """A descriptor of `region` that a peer in any process can `connect` to.

        Args:
            region: A region this endpoint registered.

        Returns:
            The descriptor's bytes (what slots and manifests carry).

        Raises:
            RegionNotRegisteredError: This endpoint has not registered `region` (or
                deregistered it).
        """

    @abstractmethod
    def connect(self, descriptor: bytes) -> Remote:
        """Import a peer's descriptor. Cheap to repeat; drivers may cache.

        Args:
            descriptor: What the peer's `export` made.

        Returns:
            The peer's region, to read from.

        Raises:
            InvalidArgumentError: `descriptor` is not one of this driver's.
        """

    def disconnect(self, remote: Remote) -> None:  # noqa: B027 - optional hook
        """Forget a peer region; drivers with per-peer state override this.

        Args:
            remote: What `connect` returned.
        """

    def prepare(self, remote: Remote, device: str = "cpu") -> None:  # noqa: B027 - optional hook
        """Do now what the first read from `remote` into `device` memory would (map it,
        page-lock it), so that the first version moves as quickly as the rest. It may take
        seconds: pullers call it from a worker thread, ahead of any version. Nothing by
        default.

        Args:
            remote: What `connect` returned.
            device: Where reads from it will land.
        """

    def view(self, remote: Remote, device: str = "cpu") -> Region | None:
        """`remote`'s memory itself, mapped into this process so that `device` reads it in
        place (no copy): a GPU slot on this host for a CUDA device, a host slot for "cpu".
        None where this driver only copies (the default), or not into `device`. The region
        is the peer's: read it, never write it, and only while a lease holds its version
        (`Puller.borrow`).

        Args:
            remote: What `connect` returned.
            device: Where it would be read.

        Returns:
            The peer's memory as a region of this process, or None.
        """
        return None

    @abstractmethod
    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        """Copy `nbytes` from `remote` at `remote_offset` into `local` at `local_offset`,
        one-sidedly: the peer's process takes no part beyond its `serve` loop, where its
        driver needs one.

        Args:
            remote: The peer's region (`connect`).
            remote_offset: Where in it the bytes start.
            local: A region this endpoint registered.
            local_offset: Where in it they land.
            nbytes: How many bytes.

        Raises:
            RegionNotRegisteredError: A span lies outside what either side registered, or
                `local` is not this endpoint's.
            PeerGoneError: The peer's process is gone.
            TransportError: This endpoint is closed, or the library failed.
        """

    async def read_many(self, reads: Sequence[tuple[Remote, int, Region, int, int]]) -> None:
        """Make every `(remote, remote_offset, local, local_offset, nbytes)` read, concurrently;
        return once all landed. A driver whose reads are cheap to queue (device copies)
        overrides it to queue them all and wait once: a task per read costs more than a
        device copy of a bucket.

        Args:
            reads: Each read's `read` arguments.

        Raises:
            TransportError: The first read that failed, as `read` raises it.
        """
        async with anyio.create_task_group() as tg:
            for r in reads:
                tg.start_soon(self.read, *r)

    async def read_2d(
        self,
        remote: Remote,
        remote_offset: int,
        remote_pitch: int,
        local: Region,
        local_offset: int,
        local_pitch: int,
        width: int,
        height: int,
    ) -> None:
        """Copy `height` rows of `width` bytes: row i from `remote` at `remote_offset + i *
        remote_pitch` into `local` at `local_offset + i * local_pitch` (a row-parallel
        share of a weight is a column band: rows apart on both sides).

        Args:
            remote: The peer's region (`connect`).
            remote_offset: Where the first row starts in it.
            remote_pitch: Bytes from one row's start to the next's, there.
            local: A region this endpoint registered.
            local_offset: Where the first row lands in it.
            local_pitch: Bytes from one row's start to the next's, here (at least `width`).
            width: Bytes a row.
            height: Rows.

        Raises:
            InvalidArgumentError: A negative size, or local rows that would overlap.
            TransportError: As `read` raises it.
        """
        await self.read_2d_many(
            [(remote, remote_offset, remote_pitch, local, local_offset, local_pitch, width, height)]
        )

    async def read_2d_many(self, reads: Sequence[Read2D]) -> None:
        """Make every 2-D read (see `read_2d`), concurrently. The default makes one plain
        read per row through `read_many`; a driver that can post many rows as one
        request (a descriptor list, a 2-D device copy) overrides it and says so in
        `native_2d`.

        Args:
            reads: Each read's `read_2d` arguments, as a tuple.

        Raises:
            InvalidArgumentError: A read's sizes make no sense (see `read_2d`).
            TransportError: The first read that failed, as `read` raises it.
        """
        rows = [row for read in reads for row in rows_of(read)]
        try:
            for i in range(0, len(rows), _ROWS_AT_ONCE):  # a row-parallel share is ~10^5 rows: not all at once
                await self.read_many(rows[i : i + _ROWS_AT_ONCE])
        except BaseExceptionGroup as group:  # the failure itself, as a plain read raises it
            raise first_error(group) from None

    async def serve(self) -> None:  # noqa: B027 - optional hook
        """Help peers' reads of this endpoint's memory along, until cancelled. Drivers whose
        reads need the owner's own progress (NIXL's first connection, GPU memory over tcp)
        loop here; the default has nothing to do and returns at once. The transport starts
        no task: its owner runs this one (`async with Publisher(...)` does)."""

    async def aclose(self) -> None:  # noqa: B027 - optional hook
        """Release every registration and connection (twice is harmless); later reads
        raise `TransportError`."""

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

    def prepare(self, remote: Remote, device: str = "cpu") -> None:
        self.inner.prepare(remote, device)

    def view(self, remote: Remote, device: str = "cpu") -> Region | None:
        return self.inner.view(remote, device)

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


def fault_in(region: Region) -> None:
    """Touch every page of a host region now (with zeros), so that its first copy does
    not page-fault through gigabytes: drivers may map host memory lazily (mmap). Slow
    for gigabytes, so run it where a slot is reserved, in a worker thread."""
    if region.view is not None and region.nbytes and not region.view.readonly:
        ctypes.memset(address_of(region.view), 0, region.nbytes)
