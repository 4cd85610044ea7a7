"""Runs a command the way a terminal runs a job, under a subreaper, so that a test finds
every process the command started, even those left behind by a process that died
(orphans go to the nearest subreaper, not to init): `Job(args)` runs `python -m weightpull
ARGS` so, and `Job.left` lists what still runs below.

The reaper itself (`python -m tests.reaper ARGV...`) makes itself a subreaper
(PR_SET_CHILD_SUBREAPER), starts ARGV in a process group of its own with Ctrl-C at its
default (as a shell starts a job), its stdout and stderr the reaper's, and says on stdout
`reaper: pid PID`, then `reaper: exit CODE` once ARGV's process ended; it reaps whatever
ends below it, and stays until its stdin closes.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36
ROOT = Path(__file__).resolve().parents[1]


def below(pid: int) -> dict[int, str]:
    """Every live process below `pid`, with its command line."""
    parent, state = {}, {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parent[int(entry)], state[int(entry)] = int(fields[1]), fields[0]
    found, todo = {}, [pid]
    while todo:
        p = todo.pop()
        for child in [c for c, pp in parent.items() if pp == p]:
            todo.append(child)
            if state[child] not in "ZX":
                try:
                    found[child] = open(f"/proc/{child}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:120]
                except OSError:
                    pass
    return found


class Job:
    """`python -m weightpull ARGS` as a terminal job, below a subreaper; its output is
    read as it comes (a process left behind would hold the pipes open)."""

    def __init__(self, args: tuple[str, ...]) -> None:
        self.reaper = subprocess.Popen(
            [sys.executable, "-m", "tests.reaper", sys.executable, "-m", "weightpull", *args],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._said: list[str] = []  # the reaper's own lines
        for stream, lines in ((self.reaper.stdout, self.stdout), (self.reaper.stderr, self.stderr)):
            threading.Thread(target=self._read, args=(stream, lines), daemon=True).start()
        self.pid = int(self._line("pid", 30))

    def _read(self, stream, lines: list[str]) -> None:
        for line in iter(stream.readline, ""):
            (self._said if line.startswith("reaper: ") else lines).append(line)

    def _line(self, what: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while not (said := [s for s in self._said if s.startswith(f"reaper: {what} ")]):
            if time.monotonic() > deadline:
                raise AssertionError(f"the command did not say {what!r} within {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.05)
        return said[0].split()[2]

    def until(self, ready, timeout: float = 360.0) -> None:
        """Until `ready` (a line's text on stderr, or a test of the job) holds."""
        deadline = time.monotonic() + timeout
        while not (any(ready in line for line in self.stderr) if isinstance(ready, str) else ready(self)):
            if self._said[1:] or time.monotonic() > deadline:
                raise AssertionError(f"never saw {ready!r}:\n{self.output()}")
            time.sleep(0.1)

    def exit_status(self, timeout: float = 90.0) -> int:
        return int(self._line("exit", timeout))

    def left(self, within: float) -> dict[int, str]:
        """What still runs below the reaper `within` seconds from now (or less, once nothing)."""
        deadline = time.monotonic() + within
        while (left := below(self.reaper.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        return left

    def output(self) -> str:
        return "".join(self.stderr)[-6000:]

    def close(self) -> None:
        for pid in below(self.reaper.pid):  # what the command left: never past the test
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        assert self.reaper.stdin is not None
        self.reaper.stdin.close()
        self.reaper.wait(10)


def main(argv: list[str]) -> None:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    job = subprocess.Popen(argv, process_group=0, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    os.write(1, f"reaper: pid {job.pid}\n".encode())  # one write: never inside a line of the job's
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()
    while True:
        try:
            pid, status = os.wait()
        except ChildProcessError:  # nothing below us now
            time.sleep(0.05)
            continue
        if pid == job.pid:
            os.write(1, f"reaper: exit {os.waitstatus_to_exitcode(status)}\n".encode())


if __name__ == "__main__":
    main(sys.argv[1:])
