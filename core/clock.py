"""Time, injected: the only way the core reads or waits on time.

`MonotonicClock` is the real one. `FakeClock` moves only when a test advances it (or
when `autojump` sees every task blocked), so leases, timeouts and renewals are tested
without sleeping.
"""

from __future__ import annotations

import heapq
import itertools
import math
import time
from collections.abc import Awaitable, Callable
from typing import Protocol, TypeVar, runtime_checkable

import anyio
import anyio.lowlevel

T = TypeVar("T")


@runtime_checkable
class Clock(Protocol):
    """What the core reads and waits on time through: any object with `now` and `sleep`
    (`MonotonicClock`, `FakeClock`, `ScaledClock`, or one of a framework's)."""

    def now(self) -> float:
        """Seconds on a monotonic scale; only differences mean anything."""

    async def sleep(self, seconds: float) -> None:
        """Wait `seconds` on this clock (a checkpoint when <= 0)."""


class MonotonicClock:
    """The real clock: `time.monotonic()`, and anyio's sleep. The default everywhere."""

    def now(self) -> float:
        return time.monotonic()

    async def sleep(self, seconds: float) -> None:
        await anyio.sleep(max(0.0, seconds))

    def __repr__(self) -> str:
        return "MonotonicClock()"


class ScaledClock:
    """A clock that runs at `rate` seconds per second of `base`: a host whose clock runs
    fast or slow against the registry's, for tests and fuzzing (leases and stalls are
    judged on the registry's clock whatever this one says).

    Args:
        base: The clock it runs against.
        rate: Its seconds per second of `base`: 2.0 runs twice as fast.

    Raises:
        ValueError: `rate` is not a positive finite number.
    """

    def __init__(self, base: Clock, rate: float) -> None:
        if not (isinstance(rate, (int, float)) and math.isfinite(rate) and rate > 0):
            raise ValueError(f"rate must be a positive finite number, got {rate!r}")
        self.base, self.rate = base, float(rate)

    def now(self) -> float:
        return self.base.now() * self.rate

    async def sleep(self, seconds: float) -> None:
        await self.base.sleep(seconds / self.rate)

    def __repr__(self) -> str:
        return f"ScaledClock({self.base!r}, rate={self.rate:g})"


class FakeClock:
    """A clock that tests move by hand (`advance`, or `autojump` in the background).
    Sleepers wake in deadline order.

    Args:
        start: Its first `now()`.
    """

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)
        self._sleepers: list[tuple[float, int, anyio.Event]] = []
        self._seq = itertools.count()
        self._new_sleeper: anyio.Event | None = None

    def now(self) -> float:
        return self._now

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await anyio.lowlevel.checkpoint()
            return
        event = anyio.Event()
        heapq.heappush(self._sleepers, (self._now + seconds, next(self._seq), event))
        if self._new_sleeper is not None:
            self._new_sleeper.set()
        try:
            await event.wait()
        finally:
            event.set()  # a cancelled sleeper is no deadline for autojump to jump to

    def advance(self, seconds: float) -> None:
        """Move time forward and wake every sleeper now due. Never yields, so a caller
        can also use it to model a process that froze for `seconds`.

        Args:
            seconds: How far; 0 wakes whoever is due now.

        Raises:
            ValueError: `seconds` is negative.
        """
        if seconds < 0:
            raise ValueError(f"a clock cannot go back (advance by {seconds})")
        self._now += seconds
        while self._sleepers and self._sleepers[0][0] <= self._now:
            heapq.heappop(self._sleepers)[2].set()

    def next_deadline(self) -> float | None:
        """The earliest deadline a sleeper waits for, or None when none sleeps."""
        while self._sleepers and self._sleepers[0][2].is_set():
            heapq.heappop(self._sleepers)
        return self._sleepers[0][0] if self._sleepers else None

    async def autojump(self) -> None:
        """Run as a background task: whenever every other task is blocked, jump to the
        next sleeper's deadline (trio's MockClock autojump, on anyio)."""
        while True:
            await anyio.wait_all_tasks_blocked()
            # Again, once the callbacks already queued have run: a task that just ended
            # wakes the one awaiting it only through them, and until they run, that one
            # looks blocked (seen as a task group lingering a jump past its last child).
            await anyio.wait_all_tasks_blocked()
            deadline = self.next_deadline()
            if deadline is None:
                self._new_sleeper = anyio.Event()
                await self._new_sleeper.wait()
                self._new_sleeper = None
            else:
                self.advance(max(0.0, deadline - self._now))

    def __repr__(self) -> str:
        return f"FakeClock(now={self._now})"


async def within(clock: Clock, seconds: float | None, fn: Callable[[], Awaitable[T]]) -> tuple[bool, T | None]:
    """Run `fn()` for at most `seconds` on `clock`: (True, result), or (False, None) when
    time ran out first. `None` means no limit."""
    if seconds is None:
        return True, await fn()
    done: list[T] = []
    async with anyio.create_task_group() as tg:

        async def body() -> None:
            done.append(await fn())
            tg.cancel_scope.cancel()

        async def timer() -> None:
            await clock.sleep(seconds)
            tg.cancel_scope.cancel()

        tg.start_soon(body)
        tg.start_soon(timer)
    return (True, done[0]) if done else (False, None)
