"""A device's copy stream, and the one poller that tells each waiting read its copy landed."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque
from typing import Any

import anyio
import attrs

from weightpull.errors import TransportError

from .driver_api import EVENT_DISABLE_TIMING, NOT_READY, STREAM_NON_BLOCKING, cuda

_SPIN_S = 0.002
_MEMORYTYPE_UNIFIED = 4  # a pointer in the unified address space: device or mapped host


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D, as cuMemcpy2DAsync_v2 takes it."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_memcpy_2d: Any = None


def _copy_2d_fn() -> Any:
    """cuMemcpy2DAsync_v2 from the driver library (driver_api binds the 1-D calls only)."""
    global _memcpy_2d
    if _memcpy_2d is None:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
        fn.argtypes, fn.restype = [ctypes.POINTER(Memcpy2D), ctypes.c_void_p], ctypes.c_int
        _memcpy_2d = fn
    return _memcpy_2d


@attrs.define(eq=False)
class Wait:
    """A queued copy: its event, and its result once landed."""

    event: ctypes.c_void_p
    result: int | None = None  # the event's CUresult
    wake: anyio.Event | None = None  # set while a fence waits on it without polling


class Lane:
    """A device's copy stream. Copies on it land in the order they were queued, so one
    poller marks every copy that landed, oldest first, and wakes whoever waits on them;
    when its own copy landed it hands polling on to one still waiting.

    The poller spins (yields without sleeping) while copies keep landing: an asyncio sleep
    shorter than a millisecond lasts a millisecond, longer than a 64 MiB device copy. After
    `_SPIN_S` without progress it sleeps a millisecond at a time."""

    def __init__(self, device: int) -> None:
        self.device = device
        cu = cuda()
        self.stream = ctypes.c_void_p()
        with cu.on(device):
            cu.check(cu.cuStreamCreate(ctypes.byref(self.stream), STREAM_NON_BLOCKING), "creating a copy stream")
            self.context = cu._contexts[device]
        self._free: list[ctypes.c_void_p] = []
        self._all: list[ctypes.c_void_p] = []
        self._queue: deque[Wait] = deque()  # copies not yet seen landed, oldest first
        self._waiting: dict[Wait, None] = {}  # fences asleep, oldest first
        self._polling = False

    def copy(self, dst: int, src: int, nbytes: int) -> Wait:
        """Queue a copy and an event after it; no wait. Raises with CUDA's error name.
        (An event per copy, not per batch: each one landing keeps the poller spinning.)"""
        cu = cuda()
        cu.cuCtxPushCurrent_v2(self.context)
        try:
            if not self._free:
                event = ctypes.c_void_p()
                cu.check(cu.cuEventCreate(ctypes.byref(event), EVENT_DISABLE_TIMING), "creating an event")
                self._all.append(event)
                self._free.append(event)
            event = self._free[-1]
            cu.check(cu.cuMemcpyAsync(dst, src, nbytes, self.stream), f"queueing a copy of {nbytes} bytes")
            cu.check(cu.cuEventRecord(event, self.stream), "queueing its event")
            self._free.pop()
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        wait = Wait(event)
        self._queue.append(wait)
        return wait

    def copy_2d(self, dst: int, dst_pitch: int, src: int, src_pitch: int, width: int, height: int) -> Wait:
        """Queue one 2-D copy (`height` rows of `width` bytes, each side's rows a pitch
        apart) and an event after it; pitches must be at least `width`."""
        cu = cuda()
        params = Memcpy2D(
            srcMemoryType=_MEMORYTYPE_UNIFIED,
            srcDevice=src,
            srcPitch=src_pitch,
            dstMemoryType=_MEMORYTYPE_UNIFIED,
            dstDevice=dst,
            dstPitch=dst_pitch,
            WidthInBytes=width,
            Height=height,
        )
        cu.cuCtxPushCurrent_v2(self.context)
        try:
            if not self._free:
                event = ctypes.c_void_p()
                cu.check(cu.cuEventCreate(ctypes.byref(event), EVENT_DISABLE_TIMING), "creating an event")
                self._all.append(event)
                self._free.append(event)
            event = self._free[-1]
            cu.check(
                _copy_2d_fn()(ctypes.byref(params), self.stream),
                f"queueing a 2-D copy of {height} rows of {width} bytes",
            )
            cu.check(cu.cuEventRecord(event, self.stream), "queueing its event")
            self._free.pop()
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        wait = Wait(event)
        self._queue.append(wait)
        return wait

    def drain(self) -> None:
        """Block until every copy queued so far landed (milliseconds): a read that failed
        half-queued returns only once nothing more lands in its caller's memory."""
        cu = cuda()
        with contextlib.suppress(TransportError), cu.on(self.device):
            cu.cuStreamSynchronize(self.stream)

    async def fence(self, wait: Wait) -> None:
        """Return once the copy landed (and so every copy queued before it)."""
        while wait.result is None:
            if self._polling:  # another fence polls: sleep until it wakes us
                wait.wake = anyio.Event()
                self._waiting[wait] = None
                try:
                    await wait.wake.wait()
                except BaseException:  # cancelled, perhaps just as it was woken to poll
                    self._waiting.pop(wait, None)
                    self._hand_on()
                    raise
                self._waiting.pop(wait, None)
                continue
            self._polling = True
            try:
                spun_since = time.monotonic()
                while wait.result is None:
                    if self._land():
                        spun_since = time.monotonic()
                    if wait.result is None:
                        await anyio.sleep(0 if time.monotonic() - spun_since < _SPIN_S else 0.001)
            finally:
                self._polling = False
                self._hand_on()  # done or cancelled: one still waiting polls next

    def _hand_on(self) -> None:
        if not self._polling:
            for other in self._waiting:
                if other.result is None and other.wake is not None:
                    other.wake.set()
                    return

    def _land(self) -> bool:
        """Mark every copy that landed, oldest first, and wake their fences."""
        cu = cuda()
        landed = False
        cu.cuCtxPushCurrent_v2(self.context)
        try:
            while self._queue:
                result = cu.cuEventQuery(self._queue[0].event)
                if result == NOT_READY:
                    break
                wait = self._queue.popleft()
                wait.result = result
                self._free.append(wait.event)
                if wait.wake is not None:
                    wait.wake.set()
                landed = True
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        return landed

    def close(self) -> None:
        cu = cuda()
        with cu.on(self.device):
            for event in self._all:
                cu.cuEventDestroy_v2(event)
            cu.cuStreamDestroy_v2(self.stream)
