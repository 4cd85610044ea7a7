"""Background tasks owned by an async context manager (a publisher serving its
transport, a served registry's heartbeat): the block's own exception comes out as it is."""

from __future__ import annotations

from typing import Any

from anyio.abc import TaskGroup


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
