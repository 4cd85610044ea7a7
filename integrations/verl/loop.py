"""weightpull's own event loop, in a thread of the verl worker's process.

verl drives an engine from its Ray actor's event loop, and a trainer step or a replica's
generation may hold that loop for seconds. The publisher's slots must stay served (some
transports finish a reader's read only while the owner makes progress) and a prefetch
must keep reading meanwhile, so both live on this loop instead, which nothing of verl's
blocks. verl's side reaches it through an anyio blocking portal: `call` from sync code,
`run` from verl's asyncio code.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import AbstractContextManager
from typing import Any, TypeVar

from anyio.from_thread import BlockingPortal, start_blocking_portal

T = TypeVar("T")

_lock = threading.Lock()
_shared: Loop | None = None


class Loop:
    """A blocking portal on a thread of its own; `close` stops the loop and its tasks."""

    def __init__(self) -> None:
        self._cm: AbstractContextManager[BlockingPortal] | None = start_blocking_portal("asyncio")
        self.portal: BlockingPortal = self._cm.__enter__()

    def call(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on the loop and wait for it (from sync code, off the loop)."""
        return self.portal.call(fn, *args)

    def start(self, fn: Callable[..., Awaitable[T]], *args: Any) -> Future[T]:
        """Start `fn(*args)` on the loop; its result as a future."""
        return self.portal.start_task_soon(fn, *args)

    async def run(self, fn: Callable[..., Awaitable[T]], *args: Any) -> T:
        """Run `fn(*args)` on the loop, awaited from another asyncio loop (verl's) without
        blocking it. Cancelling the await cancels the task there."""
        future = self.start(fn, *args)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            future.cancel()
            raise

    def enter(self, cm: Any) -> Any:
        """Enter an async context manager on the loop and keep it entered (its tasks run
        there) until `exit` is called with what this returns."""
        sync_cm = self.portal.wrap_async_context_manager(cm)
        sync_cm.__enter__()
        return sync_cm

    def close(self) -> None:
        cm, self._cm = self._cm, None
        if cm is not None:
            cm.__exit__(None, None, None)


def shared() -> Loop:
    """The process's one loop, started on first use: a worker that both publishes and
    receives (a colocated test) shares it."""
    global _shared
    with _lock:
        if _shared is None or _shared._cm is None:
            _shared = Loop()
        return _shared
