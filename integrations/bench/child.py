"""The benches' other side, the trainer or publisher, in a process of its own, as in
deployment (or in a thread, for drivers whose peers share one process), spoken to over a
pipe.

The child's function gets its end of the pipe and answers with tuples whose first item
names the reply (`("ready", ...)`); a failure in it reaches the parent as
`("error", "Type: message")`, which `expect` raises as a `RuntimeError` saying what failed.
`stop()` sends `("stop",)`.
"""

from __future__ import annotations

import multiprocessing
import threading
from collections.abc import Callable
from typing import Any

from weightpull.integrations.processes import child_main, parent_pid


def _main(target: Callable[..., None], conn: Any, *args: Any) -> None:
    """The child's body (a process of its own, or a thread)."""
    try:
        target(conn, *args)
    except Exception as exc:  # the parent names it; a traceback here would break one-line errors
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
    except BaseException as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        raise


class Child:
    """`target(conn, *args)` in a spawned process, or a thread when `thread` is true;
    `name` is what errors call it ("the publisher process")."""

    def __init__(self, name: str, target: Callable[..., None], *args: Any, thread: bool = False) -> None:
        ctx = multiprocessing.get_context("spawn")  # no CUDA context or event loop forked
        self.name = name
        self.conn, child = ctx.Pipe()
        if thread:
            self.worker: Any = threading.Thread(target=_main, args=(target, child, *args), daemon=True)
            self.worker.start()
        else:
            # Started from the main thread, it dies with this process, even one killed
            # outright: its pipe alone would not end a child that never reads it.
            self.worker = ctx.Process(target=child_main, args=(parent_pid(), _main, target, child, *args), daemon=True)
            self.worker.start()
            child.close()  # so that a child that dies reads as EOF here, not as a hang

    def expect(self, what: str, timeout: float = 600.0) -> tuple[Any, ...]:
        """The rest of the child's next reply, which must be `what`."""
        if not self.conn.poll(timeout):
            raise RuntimeError(f"{self.name} sent nothing for {timeout:.0f} s (waiting for {what!r})")
        try:
            status, *rest = self.conn.recv()
        except EOFError:
            code = getattr(self.worker, "exitcode", None)
            raise RuntimeError(f"{self.name} died (exit code {code}, waiting for {what!r})") from None
        if status != what:
            raise RuntimeError(f"{self.name} failed: {rest[0]}")
        return tuple(rest)

    def ask(self, request: tuple[Any, ...], reply: str) -> tuple[Any, ...]:
        self.conn.send(request)
        return self.expect(reply)

    def stop(self, reply: str | None = None, timeout: float = 60.0) -> tuple[Any, ...] | None:
        """Tell it to stop and wait for it (then kill it); its `reply`, if it was still well."""
        out = None
        try:
            self.conn.send(("stop",))
            if reply is not None:
                out = self.expect(reply)
        except (OSError, RuntimeError):
            pass
        self.worker.join(timeout)
        if isinstance(self.worker, multiprocessing.process.BaseProcess) and self.worker.is_alive():
            self.worker.kill()
        return out
