"""The processes a demo or a bench starts, stopped whenever it ends: done, failed, sent
SIGINT or SIGTERM (to it alone, or to its whole process group), or killed outright.

A signal to the demo's process group never reaches children in sessions of their own
(where they run so that a terminal's Ctrl-C reaches the demo alone, which stops them in
order), and Python's default SIGTERM ends a process without running its `finally`
blocks. So `Children`, used as `with Children() as children:` (in the main thread, and
inside `anyio.run` for an async demo, so that it wraps asyncio's own Ctrl-C handling):

- starts each child (`popen`) with `PR_SET_PDEATHSIG` (Linux): the kernel kills it when
  the demo dies, even by SIGKILL. A child started otherwise calls `die_with_parent`
  itself, first thing (a `multiprocessing` one runs as `child_main`);
- on the way out (`stop`) sends SIGTERM to every process started while the block ran
  (the children, their process groups, whatever they and libraries such as vLLM started
  in turn), then SIGKILL to what is left after `grace` seconds;
- turns SIGTERM and SIGHUP into a Ctrl-C (KeyboardInterrupt, or asyncio's cancellation
  of the main task), so the demo's own clean-up runs (its processes stopped in order,
  temporary files, network namespaces); if that has not ended the demo `unwind_s` later,
  or a second signal comes, it stops every child and exits at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import inspect
import logging
import multiprocessing.resource_tracker
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _prctl() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()  # looked up once: a child calls it between fork and exec, where little may run


def die_with_parent(parent: int | None = None) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux; elsewhere
    nothing). `parent`: the pid its parent had; if the parent died before this call (this
    process was handed to another), exit now. The kernel watches the parent *thread* that
    started this process: start children from a thread that lives as long as the parent."""
    if _PRCTL is not None:
        _PRCTL(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(1)


def parent_pid() -> int | None:
    """This process's pid, for a child to die with (`child_main`), when the calling thread
    may start one that does: the main thread. The kernel watches the thread that started
    a child, and any other (a worker thread of `anyio.to_thread`) may end first; then
    None, and the child is stopped by `Children` alone."""
    return os.getpid() if threading.current_thread() is threading.main_thread() else None


def child_main(parent: int | None, target: Callable[..., Any], *args: Any) -> Any:
    """`target(*args)` as a `multiprocessing` child that dies with its parent: pass it as
    the Process's target, with `(parent_pid(), target, *args)` as its arguments."""
    if parent is not None:
        die_with_parent(parent)
    return target(*args)


def _stat(pid: int) -> list[str]:
    """The fields of /proc/PID/stat after the command's name: state, ppid, pgrp, ..."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _processes() -> dict[int, list[str]]:
    """Every process on the machine, with its stat fields (Linux: /proc)."""
    out = {}
    with contextlib.suppress(OSError):
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                with contextlib.suppress(OSError, IndexError):
                    out[int(entry)] = _stat(int(entry))
    return out


def descendants(pid: int, table: dict[int, list[str]] | None = None) -> list[int]:
    """Every live descendant of `pid`, children first."""
    table = _processes() if table is None else table
    children: dict[int, list[int]] = {}
    for p, fields in table.items():
        if fields[0] not in ("Z", "X"):
            children.setdefault(int(fields[1]), []).append(p)
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        return _stat(pid)[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _ends_by_itself() -> set[int]:
    """Children that end when this process does, and must not be killed before: the
    multiprocessing resource tracker (killed, it would leave shared memory behind)."""
    pid = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    return {pid} if pid else set()


class Children:
    """Owns the processes a demo or bench starts (see the module's docstring)."""

    def __init__(self, grace: float = 5.0, unwind_s: float = 60.0) -> None:
        self.grace, self.unwind_s = grace, unwind_s
        self._procs: list[subprocess.Popen[Any]] = []
        self._before: set[int] = set()  # descendants that were there already: not ours
        self._previous: dict[int, Any] = {}
        self._lock = threading.RLock()  # a signal's handler may stop the children while `popen` holds it
        self._signalled: int | None = None
        self._watchdog: threading.Timer | None = None
        self._task: asyncio.Task[Any] | None = None  # the event loop's main task, inside one
        self._cancelled = False  # a signal cancelled it

    def popen(self, argv: Sequence[str], **options: Any) -> subprocess.Popen[Any]:
        """`subprocess.Popen(argv, **options)`, the child made to die with this process.
        From the main thread only: the kernel kills a child when the thread that started
        it ends, so one started from another thread is only stopped by `stop`."""
        parent = parent_pid()
        proc = subprocess.Popen(
            list(argv), preexec_fn=None if parent is None else (lambda: die_with_parent(parent)), **options
        )
        with self._lock:
            self._procs.append(proc)
        return proc

    def stop(self) -> None:
        """SIGTERM every process started while the block ran (in any process group),
        SIGKILL what is left after `grace` seconds, and reap the children. Safe to call
        again, and from a signal handler."""
        with self._lock:
            procs = list(self._procs)
        table = _processes()
        ours = os.getpgrp()
        pids = {p.pid for p in procs if p.poll() is None}
        pids |= set(descendants(os.getpid(), table)) - self._before - _ends_by_itself()
        for pid in list(pids):
            pids.update(descendants(pid, table))
        groups = {int(table[p][2]) for p in pids if p in table} - {ours}
        pids |= {p for p, fields in table.items() if int(fields[2]) in groups and fields[0] not in ("Z", "X")}
        for sig, wait in ((signal.SIGTERM, self.grace), (signal.SIGKILL, 5.0)):
            for group in groups:
                with contextlib.suppress(OSError):
                    os.killpg(group, sig)
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, sig)
            deadline = time.monotonic() + wait
            while any(_alive(pid) for pid in pids) and time.monotonic() < deadline:
                for p in procs:
                    p.poll()  # reaps it
                time.sleep(0.02)
            pids = {pid for pid in pids if _alive(pid)}
            if not pids:
                break
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(1)

    def __enter__(self) -> Children:
        self._before = set(descendants(os.getpid()))
        try:  # inside an event loop: its main task is what a signal cancels
            self._task = asyncio.current_task()
        except RuntimeError:
            self._task = None
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                if sig == signal.SIGINT and signal.getsignal(sig) == signal.SIG_IGN:
                    continue  # started in the background, where Ctrl-C is not for us
                self._previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc_info: object) -> None:
        try:
            self.stop()
        finally:
            if self._watchdog is not None:  # unwound in time
                self._watchdog.cancel()
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()
        if self._cancelled and exc_type is not None:
            raise KeyboardInterrupt  # the cancellation was ours: end as a Ctrl-C ends

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        """Unwind as Ctrl-C does, bounded by `unwind_s`; a second signal ends it now."""
        if self._signalled is not None:
            self._force(signum)
        self._signalled = signum
        self._watchdog = threading.Timer(self.unwind_s, self._force, (signum,))
        self._watchdog.daemon = True
        self._watchdog.start()
        interrupt = self._previous.get(signal.SIGINT)
        if interrupt is None and self._task is not None:
            # Ctrl-C is ignored here (a background job, a pytest-xdist worker), so asyncio
            # installed no handler of its own: cancel the main task as asyncio's would. A
            # KeyboardInterrupt raised in whichever task runs now would leave anyio's cancel
            # scopes in the wrong tasks.
            self._cancelled = True
            self._task.get_loop().call_soon_threadsafe(self._task.cancel)
            return
        interrupt = interrupt or signal.default_int_handler
        if callable(interrupt):  # Python's (KeyboardInterrupt), or asyncio's (cancels the main task)
            interrupt(signal.SIGINT, frame)
        else:
            raise KeyboardInterrupt

    def _force(self, signum: int) -> None:
        log.warning("stopping every process this started, and exiting (%s)", signal.Signals(signum).name)
        self.stop()
        os._exit(128 + signum)


def owns_children(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run inside `with Children():` (a coroutine function inside its event loop, so
    that Ctrl-C stays asyncio's): for a bench whose processes are started deep inside it
    (`multiprocessing`), where "every process started while the block ran" names them."""
    if inspect.iscoroutinefunction(fn):

        @functools.wraps(fn)
        async def owning(*args: Any, **kwargs: Any) -> Any:
            with Children():
                return await fn(*args, **kwargs)

        return owning

    @functools.wraps(fn)
    def owning_sync(*args: Any, **kwargs: Any) -> Any:
        with Children():
            return fn(*args, **kwargs)

    return owning_sync
