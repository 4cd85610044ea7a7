"""Background tasks owned by an async context manager (a publisher serving its
transport, a served registry's heartbeat): the block's own exception comes out as it is."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterable
from typing import Any, TypeVar

import anyio
from anyio.abc import TaskGroup

from .errors import first_error

T = TypeVar("T")


async def each_at_once(run: Callable[[T], Coroutine[Any, Any, Any]], items: Iterable[T]) -> None:
    """`run(item)` for every item, concurrently; the first failure is raised as itself
    (the rest are cancelled), not wrapped in a task group's exception group."""
    try:
        async with anyio.create_task_group() as tg:
            for item in items:
                tg.start_soon(run, item)
    except BaseExceptionGroup as group:
        raise first_error(group) from None


async def close_owned(tasks: TaskGroup, exc_info: tuple[Any, ...]) -> bool | None:
    """Cancel `tasks`, which an `async with` block owned, and wait for them. The block's
    own exception propagates as it is; if a task failed (which cancels the block), its
    error does; if both did, a group of the two."""
    tasks.cancel_scope.cancel()
    try:
        return await tasks.__aexit__(*exc_info)
    except BaseExceptionGroup as group:
        if len(group.exceptions) > 1:
            raise  # the block and a task both failed
        if group.exceptions[0] is exc_info[1]:
            return False  # the block's own exception: let it go on, unwrapped
        raise group.exceptions[0] from None
