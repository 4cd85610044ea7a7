"""Faults injected around any transport: `FaultyTransport(inner, faults)`.

The wrapper passes everything to `inner` and applies `Faults` to each read: latency, a
bandwidth cap, reads that fail halfway, and torn reads, where the reader freezes
mid-copy (past its lease, given a long enough `freeze`) and the bytes after the freeze
differ, as if the publisher's next write had landed. The fake driver applies the same
`Faults` through the same `FaultInjector`, so a test or a fuzzing run describes its
faults once, whatever driver carries the bytes.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence

import attrs

from weightpull.clock import Clock, MonotonicClock
from weightpull.errors import TransportError
from weightpull.tasks import each_at_once
from weightpull.transport import Read2D, Region, Remote, Transport, WrappedTransport, check_2d

CHUNK = 16 << 20  # a capped link paces (and can be cancelled) chunk by chunk
_SCRIBBLE = 64  # bytes of a torn read that come out different

Copy = Callable[[int, int], Awaitable[None]]  # moves bytes [start, stop) of one read


@attrs.define
class Faults:
    """Faults a test or the demo turns on, live. Counters count down as they fire."""

    delay: float = 0.0  # seconds added to every read, on the transport's clock
    bandwidth: float | None = None  # bytes per second over all of a reader's reads
    fail_reads: int = 0  # the next N reads fail halfway with TransportError
    tear_reads: int = 0  # the next N reads are torn (see `freeze`)
    freeze: float = 0.0  # at a torn read, the reader stalls this long mid-copy
    reads: int = 0  # reads started, for tests and the demo's report


def row_runs(width: int, start: int, stop: int) -> list[tuple[int, int, int, int]]:
    """Bytes [start, stop) of a 2-D read's rows laid end to end, as (first row, column,
    bytes per row, rows): a partial first row, the whole rows, a partial last row. Faults
    cut a read at byte counts; this maps the cuts back onto rows."""
    out: list[tuple[int, int, int, int]] = []
    if not width or stop <= start:
        return out
    row, col = divmod(start, width)
    if col:
        n = min(width - col, stop - start)
        out.append((row, col, n, 1))
        start += n
        row += 1
    whole = (stop - start) // width
    if whole:
        out.append((row, 0, width, whole))
        start += whole * width
        row += whole
    if stop > start:
        out.append((row, 0, stop - start, 1))
    return out


class FaultInjector:
    """Applies `Faults` to the reads of one endpoint. It models the endpoint's one link,
    so concurrent reads share its bandwidth."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self._link_free_at = 0.0

    async def read(self, faults: Faults, nbytes: int, copy: Copy, dst: memoryview | None) -> None:
        """Move `nbytes` with `copy`, faults applied; `dst` (the destination's host view,
        if any) is where a torn read scribbles."""
        faults.reads += 1
        if faults.delay:
            await self.clock.sleep(faults.delay)
        half = nbytes // 2
        if faults.fail_reads > 0:
            faults.fail_reads -= 1
            await self._move(faults, copy, 0, half)
            raise TransportError(f"injected failure after {half} of {nbytes} bytes")
        if faults.tear_reads > 0:
            faults.tear_reads -= 1
            await self._move(faults, copy, 0, half)
            self._freeze(faults.freeze)
            await self._move(faults, copy, half, nbytes)
            if dst is not None:  # the publisher's next write landed while we stood still
                torn = dst[half : half + _SCRIBBLE]
                torn[:] = bytes(b ^ 0xFF for b in torn)
            return
        await self._move(faults, copy, 0, nbytes)

    async def _move(self, faults: Faults, copy: Copy, start: int, stop: int) -> None:
        if not faults.bandwidth:
            if stop > start:
                await copy(start, stop)
            return
        for at in range(start, stop, CHUNK):
            n = min(CHUNK, stop - at)
            await copy(at, at + n)
            now = self.clock.now()
            self._link_free_at = max(now, self._link_free_at) + n / faults.bandwidth
            await self.clock.sleep(self._link_free_at - now)

    def _freeze(self, seconds: float) -> None:
        """Stand still without yielding, as a stopped process does: no renewal runs. A
        clock moved by hand (a `FakeClock`, or a view of one) just jumps."""
        advance = getattr(self.clock, "advance", None)
        if advance is not None:
            advance(seconds)
        elif seconds > 0:
            time.sleep(seconds)


class FaultyTransport(WrappedTransport):
    """`inner`, with `faults` applied to every read. Manifests name `inner`'s driver, so
    a faulty reader pulls what a healthy publisher of that driver published."""

    def __init__(self, inner: Transport, faults: Faults | None = None, *, clock: Clock | None = None) -> None:
        super().__init__(inner)
        self.faults = faults or Faults()
        self.clock = clock or MonotonicClock()
        self._injector = FaultInjector(self.clock)

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        async def copy(start: int, stop: int) -> None:
            await self.inner.read(remote, remote_offset + start, local, local_offset + start, stop - start)

        dst = None if local.view is None else local.view[local_offset : local_offset + nbytes]
        await self._injector.read(self.faults, nbytes, copy, dst)

    @property
    def native_2d(self) -> bool:  # type: ignore[override]  # its 2-D reads are its inner driver's
        return self.inner.native_2d

    async def read_2d_many(self, reads: Sequence[Read2D]) -> None:
        """Each 2-D read faulted as one read of its bytes (rows end to end), and passed
        to `inner`'s own 2-D reads. A torn one scribbles nowhere: its rows are apart."""

        for read in reads:
            check_2d(read)

        async def one(read: Read2D) -> None:
            remote, r_off, r_pitch, local, l_off, l_pitch, width, height = read

            async def copy(start: int, stop: int) -> None:
                await self.inner.read_2d_many(
                    [
                        (
                            remote,
                            r_off + row * r_pitch + col,
                            r_pitch,
                            local,
                            l_off + row * l_pitch + col,
                            l_pitch,
                            n,
                            rows,
                        )
                        for row, col, n, rows in row_runs(width, start, stop)
                    ]
                )

            await self._injector.read(self.faults, width * height, copy, None)

        await each_at_once(one, reads)

    def __repr__(self) -> str:
        return f"FaultyTransport({self.inner!r}, {self.faults!r})"
