"""A device's copy stream, and the one poller that tells each waiting read its copy landed."""

from __future__ import annotations

import contextlib
import ctypes
import time
from collections import deque

import anyio
import attrs

from weightpull.errors import TransportError

from .driver_api import EVENT_DISABLE_TIMING, NOT_READY, STREAM_NON_BLOCKING, cuda

_SPIN_S = 0.002


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
