"""How `make test` spreads the suite over its two pytest-xdist workers (tests/conftest.py
installs it). Each file's tests run on one worker, in order, so module-scoped fixtures
start once, as in a serial run; the files that start vLLM engines (each takes both cores,
and test_vllm.py's four start under a deadline) form one unit, run first and one at a time,
while the other worker takes the rest, then the tail: tests that start vLLM too but wait
on it with no tight deadline, each a unit of its own, queued last so that whichever worker
is free takes the next (without them, the vLLM unit ends alone, minutes after the rest). A scheduler of its
own, as xdist's `loadgroup` cannot mark groups under pytest 9.

It also mends two faults of xdist 3.8's `LoadScopeScheduling` that turn a crashed worker
into a run that never ends (CI then reports a timeout, not the test that crashed): the
dead worker's finished files go back on the queue as empty units that are never marked
done (pytest-xdist#1378), and a replacement worker handed one unit of one test waits for
a second that never comes (#1327). Imported only under xdist."""

from __future__ import annotations

from xdist.scheduler import LoadScopeScheduling

TAIL_FILES = ("test_loop_demo.py", "test_demo_processes.py")


def starts_vllm(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.startswith("test_vllm")


def order(path: str) -> int:
    """Where a file's tests go in the queue: the vLLM unit, the rest, the tail."""
    return 0 if starts_vllm(path) else 2 if path.rsplit("/", 1)[-1] in TAIL_FILES else 1


class ByFile(LoadScopeScheduling):
    def _split_scope(self, nodeid: str) -> str:
        path = nodeid.split("::", 1)[0]
        return ("vllm", path, nodeid)[order(path)]

    def remove_node(self, node):
        """The test the worker died on (reported failed, not run again), with only the
        unfinished tests of its units back on the queue."""
        workload = self.assigned_work.pop(node)
        pending = [nodeid for unit in workload.values() for nodeid, done in unit.items() if not done]
        if not pending:
            return None
        crashed = pending[0]
        for unit in workload.values():
            if crashed in unit:
                unit[crashed] = True
        self.workqueue.update({scope: unit for scope, unit in workload.items() if not all(unit.values())})
        for other in self.assigned_work:
            self._reschedule(other)
        return crashed

    def _reschedule(self, node) -> None:
        """Enough work that the worker can run what it holds: it runs a test only once it
        holds the next one too, or is told to shut down."""
        super()._reschedule(node)
        while self.workqueue and not node.shutting_down and self._pending_of(self.assigned_work[node]) <= 2:
            super()._reschedule(node)
        if not self.workqueue:
            super()._reschedule(node)  # shuts it down: its last test runs
