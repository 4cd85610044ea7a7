"""How `make test` spreads the suite over its two pytest-xdist workers (tests/conftest.py
installs it). Each file's tests run on one worker, in order, so module-scoped fixtures
start once, as in a serial run; the files that start vLLM engines (each takes both cores,
and test_vllm.py's four start under a deadline) form one unit, run first and one at a time,
while the other worker takes the rest, then the tail: tests that start vLLM too but wait
on it with no tight deadline (the demos'), each a unit of its own, queued last, the
longest first (`TAIL_FIRST`), so that whichever worker is free takes the next (without them, the vLLM
unit ends alone, minutes after the rest). A scheduler of its own, as xdist's `loadgroup`
cannot mark groups under pytest 9.

It also mends two faults of xdist 3.8's `LoadScopeScheduling` that turn a crashed worker
into a run that never ends (CI then reports a timeout, not the test that crashed): the
dead worker's finished files go back on the queue as empty units that are never marked
done (pytest-xdist#1378), and a replacement worker handed one unit of one test waits for
a second that never comes (#1327). Imported only under xdist.

A test whose worker dies runs once more, on a fresh worker: a crash seen in CI twice (an
abort while collecting garbage, in tests that had nothing to do with it) came from what
earlier tests left in that process, not from the test it hit. Each crash is printed at the
end of the run with the worker's last words, and a test that crashes its worker twice
fails with them. xdist names only the test, and the interpreter's fatal-error dump (which
thread, in what) lies far up the log, interleaved with the other worker's progress: each
worker's stderr goes through `tee` into a file (`tee` outlives the worker, so nothing
written before the crash is lost) before pytest's faulthandler takes a copy of it, and the
report quotes that file's end."""

from __future__ import annotations

import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import attrs
from xdist.scheduler import LoadScopeScheduling

TAIL_FILES = ("test_loop_demo.py", "test_demo_processes.py", "test_vllm_demo.py")
# The tail's first tests, in this order: its longest (CI: 100-150, 55-80 and 58-76 s),
# as a long test taken last would end the run alone, each followed by one of its shortest
# (a command line refused: a second or two). A worker holds the test it runs next while it
# runs one: a worker starting a long test holds a short one, not the next long one, which
# the other worker takes (CI's run with the long ones back to back: the vLLM demo waited
# 150 s behind the loop demo while the other worker, done, stood idle for a minute).
TAIL_FIRST = (
    "::test_loop_demo_json",
    "::test_the_loop_needs_vllm_replicas",
    "::test_vllm_demo_json",
    "::test_kill_at_is_for_the_loop_alone",
    "[vllm-demo-pid-sigterm]",
)


def starts_vllm(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test_vllm") and name not in TAIL_FILES


def order(path: str) -> int:
    """Where a file's tests go in the queue: the vLLM unit, the rest, the tail."""
    return 0 if starts_vllm(path) else 2 if path.rsplit("/", 1)[-1] in TAIL_FILES else 1


def queue_key(nodeid: str) -> tuple[int, int]:
    """A test's place in the queue: `order`'s, and in the tail, `TAIL_FIRST` first."""
    where = order(nodeid.split("::", 1)[0])
    first = next((i for i, name in enumerate(TAIL_FIRST) if name in nodeid), len(TAIL_FIRST))
    return where, first if where == 2 else 0


@attrs.frozen
class Crash:
    test: str
    worker: str
    last_words: str
    run_again: bool


CRASHES: list[Crash] = []  # in the controller, this run's


class ByFile(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return ("vllm", path, nodeid)[order(path)]

    def remove_node(self, node):
        """The unfinished tests of the dead worker's units back on the queue, the one it died
        on among them the first time (None: nothing fails yet); the second time that test
        is reported failed and not run again."""
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]
        again = crashed not in {c.test for c in CRASHES}
        CRASHES.append(Crash(crashed, node.gateway.id, last_words(node.gateway.id), again))
        if not again:
            for unit in workload.values():
                if crashed in unit:
                    unit[crashed] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return None if again else crashed

    def _reschedule(self, node) -> None:
        """Enough work that the worker can run what it holds: it runs a test only once it
        holds the next one too, or is told to shut down. No more than that (xdist holds
        two more): a long test of the tail held behind the one running would wait there
        while the other worker, free, could have run it."""
        while self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) < 2:
            super()._reschedule(node)
        if not self.workqueue:
            super()._reschedule(node)  # shuts it down: its last test runs


def _stderr_log(controller_pid: int, worker: str) -> Path:
    return Path(tempfile.gettempdir()) / f"weightpull-tests-{controller_pid}-{worker}.stderr"


def keep_last_words(worker: str) -> None:
    """In a worker, before pytest's faulthandler copies fd 2: fd 2 through `tee` into a file
    the controller (this process' parent) reads if the worker crashes."""
    log = _stderr_log(os.getppid(), worker)
    log.unlink(missing_ok=True)
    stderr = os.dup(2)
    tee = subprocess.Popen(  # its own session: a Ctrl-C ends the worker, then tee at EOF
        ["tee", "-a", str(log)], stdin=subprocess.PIPE, stdout=stderr, start_new_session=True
    )
    os.close(stderr)  # tee holds it
    assert tee.stdin is not None
    os.dup2(tee.stdin.fileno(), 2)
    tee.stdin.close()  # fd 2 holds the pipe now


# Frames of the test runner itself, in every thread's stack: left out of the report.
RUNNER_FRAMES = re.compile(r'File ".*/site-packages/(pluggy|_pytest|xdist|execnet)/|File "<string>"')


def last_words(worker: str, lines: int = 120) -> str:
    """The end of a crashed worker's stderr, from the interpreter's fatal-error dump on (and a
    few lines before it: a C library's assertion comes just ahead), without the runner's
    own frames."""
    log = _stderr_log(os.getpid(), worker)
    time.sleep(0.5)  # tee writes what the worker wrote last
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(its stderr could not be read: {exc})"
    fatal = max((i for i, line in enumerate(text) if line.startswith("Fatal Python error")), default=None)
    start = max(0, len(text) - lines) if fatal is None else max(0, fatal - 8)
    kept = [line[:300] for line in text[start:] if not RUNNER_FRAMES.search(line)]
    return "\n".join(kept[:lines])


def forget_last_words() -> None:
    for log in Path(tempfile.gettempdir()).glob(f"weightpull-tests-{os.getpid()}-*.stderr"):
        log.unlink(missing_ok=True)


def report_crashes(terminal) -> None:
    """Every worker that died this run, with its last words, at the end of the run."""
    for crash in CRASHES:
        then = "run again on a fresh worker" if crash.run_again else "failed: it crashed its worker twice"
        terminal.section(f"worker {crash.worker} crashed running {crash.test} ({then})", sep="-", red=True)
        terminal.line(crash.last_words)
