"""The prompt ledger: claims, completions, reclaims and recovery, on both stores; and its
invariants under any interleaving of them with crashes (hypothesis)."""

from __future__ import annotations

import multiprocessing
import os
import signal
import sqlite3
import tempfile
import time
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from weightpull.clock import FakeClock
from weightpull.errors import InvalidArgumentError, InvalidTransitionError
from weightpull.rl.dispatcher import Prompt
from weightpull.rl.ledger import Ledger, MemoryStore, PromptState, SqliteStore, claimable
from weightpull.rl.staleness import Trajectory


def traj(prompt: str, version: int, group: str = "") -> Trajectory:
    return Trajectory(prompt, (1, 2, 3), (version,), group=group, replica="r")


@pytest.fixture(params=["memory", "sqlite"])
def make(request, tmp_path):
    def make(clock=None, max_inflight=4):
        store = MemoryStore() if request.param == "memory" else SqliteStore(tmp_path / "ledger.db")
        return Ledger(store, max_inflight=max_inflight, clock=clock or FakeClock())

    return make


def test_claims_go_oldest_first_only_to_a_replica_serving_the_version_and_up_to_the_cap(make):
    ledger = make(max_inflight=3)
    assert ledger.enqueue([Prompt("a", 2, [1]), Prompt("b", 0, [2]), Prompt("c", 1, [3]), Prompt("d", 0, [4])]) == 4
    assert [e.id for e in ledger.claim("w0", serving=0, limit=5)] == ["b", "d"]  # "a" and "c" need newer weights
    assert [e.id for e in ledger.claim("w1", serving=5, limit=5)] == ["a"]  # the cap: 3 in flight
    assert ledger.claim("w1", serving=5) == []
    assert ledger.counts() == {"pending": 1, "running": 3, "done": 0, "trained": 0}
    claimed = ledger.entries()[1]
    assert claimed.state is PromptState.RUNNING and claimed.worker == "w0" and claimed.attempts == 1
    assert claimed.payload == [2]  # the payload round-trips (JSON in SQLite)


def test_an_aborted_prompt_goes_back_in_its_old_place(make):
    ledger = make()
    ledger.enqueue([Prompt("a", 0), Prompt("b", 0)])
    (a,) = ledger.claim("w", 0)
    assert ledger.release("w", "a")
    assert [e.id for e in ledger.claim("w", 0)] == ["a"]  # still the oldest
    assert not ledger.release("other", "a")  # only its holder puts it back


def test_enqueue_again_after_a_restart_adds_nothing(make):
    ledger = make()
    assert ledger.enqueue([Prompt("a", 0), Prompt("b", 0)]) == 2
    ledger.claim("w", 0)
    assert ledger.enqueue([Prompt("a", 3), Prompt("c", 0)]) == 1
    assert ledger.counts()["running"] == 1 and {e.id for e in ledger.entries()} == {"a", "b", "c"}
    with pytest.raises(InvalidArgumentError, match="JSON-able"):
        ledger.enqueue([Prompt("d", 0, payload=object())])
    assert "d" not in {e.id for e in ledger.entries()}


def test_groups_are_ready_when_all_their_prompts_are_done_and_trained_once(make):
    ledger = make()
    ledger.enqueue([Prompt("g1-0", 0, group="g1"), Prompt("g1-1", 0, group="g1"), Prompt("g2-0", 0, group="g2")])
    claimed = ledger.claim("w", 0, limit=3)
    assert ledger.complete("w", "g1-0", [traj("g1-0", 0, "g1")])
    assert ledger.complete("w", "g2-0", [traj("g2-0", 0, "g2"), traj("g2-0", 0, "g2")])
    assert [g.id for g in ledger.ready_groups()] == ["g2"]  # g1 still runs
    assert ledger.complete("w", "g1-1", [traj("g1-1", 0, "g1")])
    assert [(g.id, len(g.trajectories)) for g in ledger.ready_groups()] == [("g1", 2), ("g2", 2)]
    assert sorted(ledger.mark_trained(["g1"], step=1)) == ["g1-0", "g1-1"]
    with pytest.raises(InvalidTransitionError, match="mark_trained is not allowed in state trained"):
        ledger.mark_trained(["g1", "g2"], step=2)  # never trained twice, and nothing marked
    assert ledger.counts() == {"pending": 0, "running": 0, "done": 1, "trained": 2}
    with pytest.raises(InvalidArgumentError, match="no prompt of groups"):
        ledger.mark_trained(["nope"], step=2)
    assert len(claimed) == 3


def test_a_late_result_of_a_reclaimed_prompt_is_refused(make):
    clock = FakeClock()
    ledger = make(clock)
    ledger.enqueue([Prompt("a", 0)])
    ledger.beat("dead", 0)
    ledger.claim("dead", 0)
    clock.advance(3)
    ledger.beat("alive", 0)
    assert ledger.reclaim(timeout=5) == []
    clock.advance(3)  # "dead" silent for 6 s
    assert ledger.reclaim(timeout=5) == ["a"]
    assert not ledger.complete("dead", "a", [traj("a", 0)])
    assert [e.id for e in ledger.claim("alive", 0)] == ["a"] and ledger.entries()[0].attempts == 2
    with pytest.raises(InvalidArgumentError, match="timeout"):
        ledger.reclaim(0)


def test_a_worker_that_reports_its_failure_loses_its_prompts_at_once(make):
    ledger = make()
    ledger.enqueue([Prompt("a", 0)])
    ledger.claim("w", 0)
    ledger.beat("w", 0, failure="AgentFailedError('apply')")
    assert ledger.reclaim(timeout=60) == ["a"]
    assert ledger.workers()[0].failure == "AgentFailedError('apply')"


def test_recover_puts_running_back_and_untrains_steps_the_checkpoint_lacks(make):
    ledger = make()
    ledger.enqueue([Prompt(p, 0, group=p) for p in "abcd"])
    ledger.claim("w", 0, limit=4)
    for p in "abc":
        ledger.complete("w", p, [traj(p, 0, p)])
    ledger.mark_trained(["a"], step=1)
    ledger.mark_trained(["b"], step=2)
    recovered = ledger.recover(checkpoint_step=1)
    assert recovered.requeued == ("d",) and recovered.untrained == ("b",)
    states = {e.id: e.state for e in ledger.entries()}
    assert states == {"a": PromptState.TRAINED, "b": PromptState.DONE, "c": PromptState.DONE, "d": PromptState.PENDING}
    assert ledger.recover(checkpoint_step=None).untrained == ("a",)  # no checkpoint: nothing was trained


def test_requeue_runs_a_stale_group_again_on_newer_weights(make):
    ledger = make()
    ledger.enqueue([Prompt("a", 0, group="g")])
    ledger.claim("w", 0)
    ledger.complete("w", "a", [traj("a", 0, "g")])
    assert ledger.requeue(["g"], min_weight_version=4) == ["a"]
    assert ledger.claim("w", 3) == []
    (e,) = ledger.claim("w", 4)
    assert e.min_weight_version == 4 and e.result == ()


def test_bad_arguments_are_named(make, tmp_path):
    with pytest.raises(InvalidArgumentError, match="max_inflight"):
        make(max_inflight=0)
    ledger = make()
    with pytest.raises(InvalidArgumentError, match="serving"):
        ledger.claim("w", -1)
    with pytest.raises(InvalidArgumentError, match="no prompt 'x'"):
        ledger.complete("w", "x", [traj("x", 0)])
    with pytest.raises(InvalidArgumentError, match="one or more trajectories"):
        ledger.complete("w", "x", [])
    with pytest.raises(InvalidArgumentError, match="does not exist"):
        SqliteStore(tmp_path / "missing" / "ledger.db")
    with pytest.raises(InvalidArgumentError, match="synchronous"):
        SqliteStore(tmp_path / "l.db", synchronous="OFF")


def test_the_claim_decision_alone():
    ledger = Ledger(MemoryStore(), max_inflight=8, clock=FakeClock())
    ledger.enqueue([Prompt(str(i), i % 3) for i in range(6)])
    pending = ledger.entries()
    assert [e.id for e in claimable(pending, running=0, max_inflight=8, serving=1, limit=3)] == ["0", "1", "3"]
    assert claimable(pending, running=8, max_inflight=8, serving=5, limit=3) == []
    assert [e.id for e in claimable(pending, running=6, max_inflight=8, serving=5, limit=9)] == ["0", "1"]


def _claimer(path: str, worker: str, out) -> None:
    ledger = Ledger.open(path, max_inflight=1000)
    got = []
    while batch := ledger.claim(worker, 0, limit=3):
        got += [e.id for e in batch]
    out.put(got)


def test_processes_sharing_the_sqlite_ledger_never_claim_one_prompt_twice(tmp_path):
    path = str(tmp_path / "ledger.db")
    Ledger.open(path, max_inflight=1000).enqueue([Prompt(f"p{i}", 0) for i in range(300)])
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_claimer, args=(path, f"w{i}", out)) for i in range(3)]
    for p in procs:
        p.start()
    got = [out.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(10)
    claimed = [i for g in got for i in g]
    assert sorted(claimed) == sorted(f"p{i}" for i in range(300)) and len(set(claimed)) == 300


def _claim_and_die(path: str) -> None:
    ledger = Ledger.open(path, max_inflight=10)
    ledger.beat("doomed", 0)
    ledger.claim("doomed", 0, limit=3)
    os.kill(os.getpid(), signal.SIGKILL)  # a rollout worker dies holding its prompts


def test_a_killed_workers_prompts_are_reclaimed_after_the_timeout(tmp_path):
    path = str(tmp_path / "ledger.db")
    ledger = Ledger.open(path, max_inflight=10)
    ledger.enqueue([Prompt(f"p{i}", 0) for i in range(4)])
    proc = multiprocessing.get_context("spawn").Process(target=_claim_and_die, args=(path,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == -signal.SIGKILL
    assert ledger.counts()["running"] == 3 and ledger.reclaim(timeout=30) == []
    time.sleep(0.3)
    assert sorted(ledger.reclaim(timeout=0.2)) == ["p0", "p1", "p2"]  # silent past the timeout
    assert [e.id for e in ledger.claim("alive", 0, limit=4)] == ["p0", "p1", "p2", "p3"]  # oldest first still


def test_the_sqlite_ledger_is_in_the_file_after_each_call(tmp_path):
    ledger = Ledger.open(tmp_path / "ledger.db", max_inflight=4, clock=FakeClock())
    ledger.enqueue([Prompt("a", 0, [1, 2])])
    ledger.claim("w", 0)
    # Another connection, as a process started after a SIGKILL would open it.
    rows = sqlite3.connect(tmp_path / "ledger.db").execute("SELECT id, state, worker FROM prompts").fetchall()
    assert rows == [("a", "running", "w")]


class LedgerMachine(RuleBasedStateMachine):
    """Any interleaving of enqueue, claim, complete, release, reclaim, train, requeue,
    checkpoint and crash (the SQLite file reopened, then recovered from the last
    checkpoint): no prompt is lost, none is trained twice in the weights' history, no
    claim breaks the cap or the version a prompt needs."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.TemporaryDirectory()
        self.clock = FakeClock()
        self.cap = 3
        self.enqueued: set[str] = set()
        self.lineage: list[tuple[int, list[str]]] = []  # (step, prompts) of steps the weights hold
        self.step = 0
        self.checkpoint = None

    @initialize(sqlite=st.booleans())
    def open(self, sqlite):
        self.sqlite = sqlite
        self.path = Path(self.dir.name) / "ledger.db"
        self.store = MemoryStore()
        self.ledger = self._ledger()

    def _ledger(self):
        store = SqliteStore(self.path) if self.sqlite else self.store
        return Ledger(store, max_inflight=self.cap, clock=self.clock)

    def teardown(self):
        self.ledger.close()
        self.dir.cleanup()

    @rule(n=st.integers(1, 3), version=st.integers(0, 3))
    def enqueue(self, n, version):
        ids = [f"p{len(self.enqueued) + i}" for i in range(n)]
        self.ledger.enqueue([Prompt(i, version, group=i) for i in ids])
        self.enqueued.update(ids)

    @rule(worker=st.sampled_from(["w0", "w1"]), serving=st.integers(0, 3), limit=st.integers(1, 4))
    def claim(self, worker, serving, limit):
        before = {e.id for e in self.ledger.entries() if e.state is PromptState.PENDING}
        pending = [e for e in self.ledger.entries() if e.state is PromptState.PENDING]
        claimed = self.ledger.claim(worker, serving, limit)
        assert all(e.min_weight_version <= serving and e.id in before for e in claimed)
        eligible = [e.id for e in pending if e.min_weight_version <= serving]
        assert [e.id for e in claimed] == eligible[: len(claimed)]  # oldest first

    @rule(data=st.data(), worker=st.sampled_from(["w0", "w1"]))
    def complete_or_release(self, data, worker):
        mine = [e for e in self.ledger.entries() if e.state is PromptState.RUNNING and e.worker == worker]
        if mine:
            e = data.draw(st.sampled_from(mine))
            if data.draw(st.booleans()):
                assert self.ledger.complete(worker, e.id, [traj(e.id, e.min_weight_version, e.group)])
            else:
                assert self.ledger.release(worker, e.id)

    @rule(worker=st.sampled_from(["w0", "w1"]), seconds=st.floats(0, 4))
    def time_passes(self, worker, seconds):
        self.ledger.beat(worker, 0)
        self.clock.advance(seconds)
        self.ledger.reclaim(timeout=3)

    @rule(n=st.integers(1, 3))
    def train(self, n):
        groups = [g.id for g in self.ledger.ready_groups()][:n]
        if groups:
            self.step += 1
            self.lineage.append((self.step, self.ledger.mark_trained(groups, self.step)))

    @rule(n=st.integers(1, 2), version=st.integers(0, 4))
    def evict(self, n, version):
        self.ledger.requeue([g.id for g in self.ledger.ready_groups()][:n], version)

    @rule()
    def checkpoint_now(self):
        self.checkpoint = self.step if self.step else None

    @rule()
    def crash_and_resume(self):
        if self.sqlite:
            self.ledger.store._db.close()  # a SIGKILL: nothing more is written
        self.ledger = self._ledger()
        self.ledger.recover(self.checkpoint)
        self.lineage = [(s, p) for s, p in self.lineage if self.checkpoint is not None and s <= self.checkpoint]
        self.step = self.checkpoint or 0
        assert self.ledger.counts()["running"] == 0

    @invariant()
    def nothing_lost_nothing_trained_twice(self):
        entries = self.ledger.entries()
        assert {e.id for e in entries} == self.enqueued
        trained = [p for _, ps in self.lineage for p in ps]
        assert len(trained) == len(set(trained))
        assert set(trained) == {e.id for e in entries if e.state is PromptState.TRAINED}
        assert sum(e.state is PromptState.RUNNING for e in entries) <= self.cap


@pytest.mark.filterwarnings("ignore::hypothesis.errors.NonInteractiveExampleWarning")
def test_ledger_invariants_under_crashes():
    run = LedgerMachine.TestCase
    run.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
    run().runTest()
