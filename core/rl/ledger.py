"""The prompt ledger: every prompt of a run, where it stands, surviving any process's death.

A prompt moves PENDING -> RUNNING (a rollout worker claimed it) -> DONE (its trajectories
are in) -> TRAINED (a training step consumed them), and back: RUNNING -> PENDING when its
generation was aborted, its worker died, or the ledger is recovered after a crash;
DONE -> PENDING when its group grew too stale to train on; TRAINED -> DONE when the
checkpoint that step went into was lost. Claims take the oldest pending prompt whose
`min_weight_version` the worker's replica serves, at most `max_inflight` running at once.

`Ledger` makes every decision; a `LedgerStore` only keeps rows and makes a group of
reads and writes atomic. `MemoryStore` is for one process and tests; `SqliteStore`
(stdlib sqlite3, WAL) is the default, shared by the trainer's and the rollout workers'
processes and kept next to the trainer's checkpoint.
"""

from __future__ import annotations

import contextlib
import enum
import json
import sqlite3
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import attrs

from ..clock import Clock, MonotonicClock
from ..errors import InvalidArgumentError, InvalidTransitionError
from .dispatcher import Prompt
from .staleness import Group, Trajectory


def _trajectories(value: Iterable[Trajectory]) -> tuple[Trajectory, ...]:
    return tuple(value)


class PromptState(enum.Enum):
    """Where a prompt is: pending -> running -> done -> trained, and back when it must run again."""

    PENDING = "pending"
    RUNNING = "running"
    DONE = "done"
    TRAINED = "trained"


@attrs.frozen
class Entry:
    """A prompt as the ledger holds it."""

    id: str
    seq: int  # arrival order, kept across retries: a prompt put back stays the oldest
    min_weight_version: int
    payload: Any = attrs.field(eq=False, repr=False)  # JSON-able: what the rollout worker runs
    group: str
    state: PromptState = PromptState.PENDING
    worker: str | None = None  # who runs it (RUNNING) or ran it (DONE, TRAINED)
    claimed_at: float | None = None
    result: tuple[Trajectory, ...] = attrs.field(default=(), converter=_trajectories, eq=False, repr=False)
    trained_step: int | None = None
    attempts: int = 0  # claims so far

    def prompt(self) -> Prompt:
        """The entry as the `Prompt` a rollout worker runs."""
        return Prompt(self.id, self.min_weight_version, self.payload, group=self.group)


@attrs.frozen
class Worker:
    """A rollout worker's last heartbeat: the producer the health check looks at."""

    name: str
    last_beat: float
    serving: int | None = None
    failure: str | None = None  # why it stopped, if it said so before going


class LedgerStore(Protocol):
    """Rows, and atomic groups of reads and writes; no decisions."""

    def transaction(self) -> contextlib.AbstractContextManager[None]:
        """Everything inside happens at once or not at all, excluding every other
        writer (other processes included); nests."""

    def next_seq(self) -> int: ...
    def get(self, prompt_id: str) -> Entry | None: ...
    def put(self, entry: Entry) -> None: ...
    def select(self, states: Collection[PromptState]) -> list[Entry]:
        """Entries in these states, oldest (lowest seq) first."""

    def count(self, state: PromptState) -> int: ...
    def put_worker(self, worker: Worker) -> None: ...
    def workers(self) -> list[Worker]: ...
    def close(self) -> None: ...


class MemoryStore:
    """A store in this process's memory: for tests, and for a loop in one process."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._workers: dict[str, Worker] = {}
        self._lock = threading.RLock()
        self._seq = 0

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            saved = (dict(self._entries), dict(self._workers), self._seq)
            try:
                yield
            except BaseException:
                self._entries, self._workers, self._seq = saved
                raise

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def get(self, prompt_id: str) -> Entry | None:
        return self._entries.get(prompt_id)

    def put(self, entry: Entry) -> None:
        self._entries[entry.id] = entry

    def select(self, states: Collection[PromptState]) -> list[Entry]:
        return sorted((e for e in self._entries.values() if e.state in states), key=lambda e: e.seq)

    def count(self, state: PromptState) -> int:
        return sum(e.state is state for e in self._entries.values())

    def put_worker(self, worker: Worker) -> None:
        self._workers[worker.name] = worker

    def workers(self) -> list[Worker]:
        return sorted(self._workers.values(), key=lambda w: w.name)

    def close(self) -> None:
        pass


def _trajectory_json(t: Trajectory) -> dict[str, Any]:
    return {
        "prompt_id": t.prompt_id,
        "tokens": t.tokens,
        "versions": t.versions,
        "group": t.group,
        "replica": t.replica,
    }


_SCHEMA = """
CREATE TABLE IF NOT EXISTS prompts (
    id TEXT PRIMARY KEY, seq INTEGER NOT NULL, min_weight_version INTEGER NOT NULL, payload TEXT NOT NULL,
    grp TEXT NOT NULL, state TEXT NOT NULL, worker TEXT, claimed_at REAL, result TEXT NOT NULL,
    trained_step INTEGER, attempts INTEGER NOT NULL
);
CREATE INDEX IF NOT EXISTS prompts_by_state ON prompts (state, seq);
CREATE TABLE IF NOT EXISTS workers (name TEXT PRIMARY KEY, last_beat REAL NOT NULL, serving INTEGER, failure TEXT);
"""
_COLUMNS = "id, seq, min_weight_version, payload, grp, state, worker, claimed_at, result, trained_step, attempts"


class SqliteStore:
    """The ledger in an SQLite file (WAL): several processes share it, and a transaction
    either reached the file or never happened, whichever process is killed when.

    `synchronous="NORMAL"` survives the death of any process; "FULL" also a power loss,
    at an fsync per transaction."""

    def __init__(self, path: str | Path, *, busy_timeout: float = 30.0, synchronous: str = "NORMAL") -> None:
        if synchronous not in ("NORMAL", "FULL"):
            raise InvalidArgumentError(f"synchronous must be NORMAL or FULL, got {synchronous!r}")
        self.path = Path(path)
        if not self.path.parent.is_dir():
            raise InvalidArgumentError(f"the ledger's directory {str(self.path.parent)!r} does not exist")
        # Autocommit mode: transactions are ours (BEGIN IMMEDIATE takes the write lock up
        # front, so two claims never read the same pending rows).
        self._db = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None, check_same_thread=False)
        self._lock = threading.RLock()
        self._depth = 0
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        with self.transaction():
            for statement in _SCHEMA.split(";"):
                if statement.strip():
                    self._db.execute(statement)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        with self._lock:
            if self._depth:
                self._depth += 1
                try:
                    yield
                finally:
                    self._depth -= 1
                return
            self._db.execute("BEGIN IMMEDIATE")
            self._depth = 1
            try:
                yield
            except BaseException:
                self._depth = 0
                self._db.execute("ROLLBACK")
                raise
            self._depth = 0
            self._db.execute("COMMIT")

    def next_seq(self) -> int:
        row = self._db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM prompts").fetchone()
        return int(row[0])

    def get(self, prompt_id: str) -> Entry | None:
        row = self._db.execute(f"SELECT {_COLUMNS} FROM prompts WHERE id = ?", (prompt_id,)).fetchone()
        return None if row is None else self._entry(row)

    def put(self, entry: Entry) -> None:
        self._db.execute(
            f"INSERT OR REPLACE INTO prompts ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                entry.id,
                entry.seq,
                entry.min_weight_version,
                json.dumps(entry.payload),
                entry.group,
                entry.state.value,
                entry.worker,
                entry.claimed_at,
                json.dumps([_trajectory_json(t) for t in entry.result]),
                entry.trained_step,
                entry.attempts,
            ),
        )

    def select(self, states: Collection[PromptState]) -> list[Entry]:
        marks = ", ".join("?" for _ in states)
        rows = self._db.execute(
            f"SELECT {_COLUMNS} FROM prompts WHERE state IN ({marks}) ORDER BY seq", [s.value for s in states]
        )
        return [self._entry(row) for row in rows]

    def count(self, state: PromptState) -> int:
        return int(self._db.execute("SELECT COUNT(*) FROM prompts WHERE state = ?", (state.value,)).fetchone()[0])

    def put_worker(self, worker: Worker) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO workers (name, last_beat, serving, failure) VALUES (?, ?, ?, ?)",
            (worker.name, worker.last_beat, worker.serving, worker.failure),
        )

    def workers(self) -> list[Worker]:
        rows = self._db.execute("SELECT name, last_beat, serving, failure FROM workers ORDER BY name")
        return [Worker(*row) for row in rows]

    def close(self) -> None:
        with self._lock:
            self._db.close()

    @staticmethod
    def _entry(row: Sequence[Any]) -> Entry:
        id_, seq, min_v, payload, group, state, worker, claimed_at, result, trained_step, attempts = row
        return Entry(
            id_,
            seq,
            min_v,
            json.loads(payload),
            group,
            PromptState(state),
            worker,
            claimed_at,
            [Trajectory(**t) for t in json.loads(result)],
            trained_step,
            attempts,
        )


def _check_int(what: str, value: object, least: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise InvalidArgumentError(f"{what} must be an int >= {least}, got {value!r}")
    return value


def claimable(pending: Sequence[Entry], running: int, max_inflight: int, serving: int, limit: int) -> list[Entry]:
    """The claim, decided: the oldest pending entries a replica serving `serving` can
    start, at most `limit`, without more than `max_inflight` running in all."""
    room = min(limit, max_inflight - running)
    if room <= 0:
        return []
    return [e for e in pending if e.min_weight_version <= serving][:room]


@attrs.frozen
class Recovered:
    """What `recover` put back: prompts that were running, and trained prompts whose
    training step the checkpoint resumed from does not hold."""

    requeued: tuple[str, ...]
    untrained: tuple[str, ...]


class Ledger:
    """Every prompt's state, through any process's death: the decoupled loop's book.

    Prompts go pending -> running (`claim`) -> done (`complete`) -> trained
    (`mark_trained`), and back to pending when an update aborted them (`release`), their
    worker died (`reclaim`), they grew too stale (`requeue`) or the trainer resumed from
    an older checkpoint (`recover`). Each change is one transaction of its store, so a
    prompt is never lost nor trained on twice. `Ledger.open(path)` keeps it in SQLite,
    shared by the trainer and the rollout workers' processes.

    Args:
        store: Where the rows live (`SqliteStore`, or `MemoryStore` in one process).
        max_inflight: Prompts running at once across all workers, at most; >= 1.
        clock: The clock of claims and heartbeats (default: `MonotonicClock`).

    Raises:
        InvalidArgumentError: `max_inflight` is not an int >= 1.
    """

    def __init__(self, store: LedgerStore, *, max_inflight: int, clock: Clock | None = None) -> None:
        self.store = store
        self.max_inflight = _check_int("max_inflight", max_inflight, 1)
        self.clock = clock or MonotonicClock()

    @classmethod
    def open(cls, path: str | Path, *, max_inflight: int, clock: Clock | None = None, **options: Any) -> Ledger:
        """A ledger in the SQLite file at `path` (made if missing).

        Args:
            path: The database file; every process of the loop opens the same one.
            max_inflight: Prompts running at once, at most; >= 1.
            clock: The clock of claims and heartbeats (default: `MonotonicClock`).
            **options: Passed to `SqliteStore`.

        Raises:
            InvalidArgumentError: `max_inflight` is not an int >= 1.
        """
        return cls(SqliteStore(path, **options), max_inflight=max_inflight, clock=clock)

    def close(self) -> None:
        self.store.close()

    def _fail(self, entry: Entry, event: str) -> InvalidTransitionError:
        return InvalidTransitionError("prompt", entry.state.value, event, repr(entry.id))

    def _entry(self, prompt_id: str) -> Entry:
        entry = self.store.get(prompt_id)
        if entry is None:
            raise InvalidArgumentError(f"the ledger holds no prompt {prompt_id!r}")
        return entry

    # -- the trainer's side ------------------------------------------------------------

    def enqueue(self, prompts: Iterable[Prompt]) -> int:
        """Add prompts as PENDING; how many were new. A prompt whose id the ledger holds
        already is left as it is: a trainer resumed from a checkpoint enqueues again what
        it had enqueued before it died, and nothing is doubled."""
        added = 0
        with self.store.transaction():
            for p in prompts:
                if not isinstance(p, Prompt):
                    raise InvalidArgumentError(f"enqueue takes Prompts, got {p!r}")
                try:
                    json.dumps(p.payload)
                except (TypeError, ValueError) as exc:
                    raise InvalidArgumentError(f"prompt {p.id!r}: its payload must be JSON-able ({exc})") from None
                if self.store.get(p.id) is None:
                    self.store.put(Entry(p.id, self.store.next_seq(), p.min_weight_version, p.payload, p.group))
                    added += 1
        return added

    def ready_groups(self) -> list[Group]:
        """The groups whose every prompt is DONE (none pending, running or trained), in
        the order their first prompt arrived."""
        groups: dict[str, list[Entry]] = {}
        unfinished: set[str] = set()
        # Trained rows are left out: a group is marked trained whole, so none is half trained.
        for e in self.store.select([PromptState.PENDING, PromptState.RUNNING, PromptState.DONE]):
            if e.state is PromptState.DONE:
                groups.setdefault(e.group or e.id, []).append(e)
            else:
                unfinished.add(e.group or e.id)
        return [
            Group(g, tuple(t for e in entries for t in e.result))
            for g, entries in groups.items()
            if g not in unfinished
        ]

    def mark_trained(self, group_ids: Iterable[str], step: int) -> list[str]:
        """DONE -> TRAINED for every prompt of these groups, as consumed by training
        step `step`; returns their prompt ids. A prompt not DONE is refused, and nothing
        is marked: so no result is ever trained on twice."""
        _check_int("step", step)
        wanted = set(group_ids)
        marked: list[str] = []
        found: set[str] = set()
        with self.store.transaction():
            for e in self.store.select(list(PromptState)):
                if (e.group or e.id) not in wanted:
                    continue
                if e.state is not PromptState.DONE:
                    raise self._fail(e, "mark_trained")
                self.store.put(attrs.evolve(e, state=PromptState.TRAINED, trained_step=step))
                marked.append(e.id)
                found.add(e.group or e.id)
            if wanted - found:
                raise InvalidArgumentError(f"the ledger holds no prompt of groups {sorted(wanted - found)!r}")
        return marked

    def requeue(self, group_ids: Iterable[str], min_weight_version: int) -> list[str]:
        """DONE -> PENDING for every prompt of these groups (too stale to train on): they
        run again, on weights at least `min_weight_version`, their results dropped."""
        _check_int("min_weight_version", min_weight_version)
        wanted = set(group_ids)
        requeued = []
        with self.store.transaction():
            for e in self.store.select([PromptState.DONE]):
                if (e.group or e.id) in wanted:
                    self.store.put(
                        attrs.evolve(
                            e,
                            state=PromptState.PENDING,
                            min_weight_version=max(e.min_weight_version, min_weight_version),
                            worker=None,
                            claimed_at=None,
                            result=(),
                        )
                    )
                    requeued.append(e.id)
        return requeued

    def recover(self, checkpoint_step: int | None) -> Recovered:
        """After a crash, before anything else runs: RUNNING -> PENDING (their workers'
        late results are refused), and TRAINED -> DONE for prompts trained by a step
        after `checkpoint_step` (None: no checkpoint), which the resumed weights never saw."""
        requeued, untrained = [], []
        with self.store.transaction():
            for e in self.store.select([PromptState.RUNNING, PromptState.TRAINED]):
                if e.state is PromptState.RUNNING:
                    self.store.put(attrs.evolve(e, state=PromptState.PENDING, worker=None, claimed_at=None))
                    requeued.append(e.id)
                elif checkpoint_step is None or (e.trained_step is not None and e.trained_step > checkpoint_step):
                    self.store.put(attrs.evolve(e, state=PromptState.DONE, trained_step=None))
                    untrained.append(e.id)
        return Recovered(tuple(requeued), tuple(untrained))

    # -- the rollout side ----------------------------------------------------------------

    def claim(self, worker: str, serving: int, limit: int = 1) -> list[Entry]:
        """PENDING -> RUNNING: the oldest pending prompts a replica serving `serving` may
        start, at most `limit`, keeping at most `max_inflight` running in all."""
        _check_int("serving", serving)
        _check_int("limit", limit, 1)
        now = self.clock.now()
        with self.store.transaction():
            running = self.store.count(PromptState.RUNNING)
            chosen = claimable(self.store.select([PromptState.PENDING]), running, self.max_inflight, serving, limit)
            claimed = [
                attrs.evolve(e, state=PromptState.RUNNING, worker=worker, claimed_at=now, attempts=e.attempts + 1)
                for e in chosen
            ]
            for e in claimed:
                self.store.put(e)
        return claimed

    def complete(self, worker: str, prompt_id: str, trajectories: Sequence[Trajectory]) -> bool:
        """RUNNING -> DONE with its trajectories. False (nothing changes) when `worker`
        no longer holds the prompt: it was reclaimed or recovered meanwhile, and runs again."""
        if not trajectories:
            raise InvalidArgumentError(f"prompt {prompt_id!r}: a completion needs one or more trajectories")
        with self.store.transaction():
            e = self._entry(prompt_id)
            if e.state is not PromptState.RUNNING or e.worker != worker:
                return False
            self.store.put(attrs.evolve(e, state=PromptState.DONE, result=tuple(trajectories)))
        return True

    def release(self, worker: str, prompt_id: str) -> bool:
        """RUNNING -> PENDING, in its old place (an update aborted its generation)."""
        with self.store.transaction():
            e = self._entry(prompt_id)
            if e.state is not PromptState.RUNNING or e.worker != worker:
                return False
            self.store.put(attrs.evolve(e, state=PromptState.PENDING, worker=None, claimed_at=None))
        return True

    def beat(self, worker: str, serving: int | None, failure: str | None = None) -> None:
        """A rollout worker's heartbeat (with `failure`, its last word)."""
        with self.store.transaction():
            self.store.put_worker(Worker(worker, self.clock.now(), serving, failure))

    def workers(self) -> list[Worker]:
        with self.store.transaction():
            return self.store.workers()

    def reclaim(self, timeout: float) -> list[str]:
        """RUNNING -> PENDING for prompts whose worker was not heard from for `timeout`
        seconds (or failed): it died, and they run elsewhere."""
        if not timeout > 0:
            raise InvalidArgumentError(f"timeout must be > 0, got {timeout!r}")
        now = self.clock.now()
        reclaimed = []
        with self.store.transaction():
            beats = {w.name: w for w in self.store.workers()}
            for e in self.store.select([PromptState.RUNNING]):
                w = beats.get(e.worker or "")
                last = max(w.last_beat if w is not None else -float("inf"), e.claimed_at or -float("inf"))
                if (w is not None and w.failure is not None) or now - last > timeout:
                    self.store.put(attrs.evolve(e, state=PromptState.PENDING, worker=None, claimed_at=None))
                    reclaimed.append(e.id)
        return reclaimed

    # -- looking -------------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        with self.store.transaction():
            return {s.value: self.store.count(s) for s in PromptState}

    def entries(self) -> list[Entry]:
        with self.store.transaction():
            return self.store.select(list(PromptState))
