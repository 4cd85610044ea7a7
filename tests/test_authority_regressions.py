"""Authority and liveness defects found by the principals fuzzer (fuzz/test_principals.py),
each the fewest steps that show it, on `RegistryMachine` and a fake clock. Each not yet
fixed is marked xfail(strict=True) until the core fix lands: then it passes, strict xfail fails the run,
and the mark (and the fuzzer's `AWAITING_FIX` entry of the same name) is removed."""

import contextlib

import pytest

from weightpull import FakeClock, Manifest, TensorSpec, VersionState, plan_layout
from weightpull.errors import InvalidArgumentError
from weightpull.principals import Principal
from weightpull.registry import RegistryMachine
from weightpull.registry_machine import MAX_VERSION

LAYOUT = plan_layout([TensorSpec("w", "uint8", (4,))])
TTL = 10.0
TRAINER = Principal.publisher("trainer")
ROGUE = Principal.publisher("rogue")
REPLICA = Principal.reader("replica-0")
ADMIN = Principal.admin()


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
def m(clock):
    return RegistryMachine(clock, liveness_ttl=TTL)


def test_a_shard_tombstone_far_ahead_cannot_lock_publishers_out(m):
    """A publisher's shard abort by number, before any shard began, leaves a tombstone at
    the number asked, unchecked: at MAX_VERSION, every later begin, anyone's, is refused
    ('versions are at most ...'), the lockout issue 13 forbids."""
    with contextlib.suppress(InvalidArgumentError):  # refused as too far ahead, once fixed
        m.abort(MAX_VERSION, "grab", shard=(0, 2), by=ROGUE)
    assert m.begin(None, publisher="trainer", slot=0, by=TRAINER) < MAX_VERSION


def test_a_shard_tombstone_never_reuses_a_version_number(m):
    """Version numbers are never reused (architecture.md), yet a tombstone takes the
    number asked whenever no record holds it now: here v3, begun, aborted and reclaimed."""
    assert m.begin(3, publisher="trainer", slot=0, by=TRAINER) == 3
    m.abort(3, "the copy failed", by=TRAINER)
    m.reclaim(3, by=TRAINER)
    m.abort(3, "rank 0 gave up", shard=(0, 2), by=TRAINER)
    assert [x.version for x in m.status().versions] != [3]


def test_a_version_begun_for_a_lapsed_publisher_does_not_stay_writing(m, clock):
    """An admin begins a version under a publisher that has lapsed: the sweep acted on the
    lapse once, before it existed, so it stayed WRITING for good though its owner was dead.
    Fixed by 08b3ceb: an admin's begin keeps its publisher alive, so it lapses anew."""
    m.keepalive(by=TRAINER)
    clock.advance(TTL)
    m.status()  # the lapse is seen
    v = m.begin(None, publisher="trainer", slot=0, by=ADMIN)
    clock.advance(TTL)
    state = {x.version: x.state for x in m.status().versions}[v]
    assert state is VersionState.ABORTED


def test_a_lapsed_reader_that_comes_back_does_not_serve_its_old_version(m, clock):
    """A reader lapses and leaves `serving`; when it is heard from again (restarted, it
    has applied nothing yet) its report from before the lapse comes back."""
    m.begin(1, publisher="trainer", slot=0, by=TRAINER)
    m.commit(Manifest(1, LAYOUT, "fake", b"d", 0, "trainer"), by=TRAINER)
    m.report_serving("replica-0", 1, by=REPLICA)
    clock.advance(TTL)
    assert m.status().serving == {}
    m.keepalive(by=REPLICA)
    assert m.status().serving == {}


def test_a_rogue_taking_a_number_cannot_make_a_trainers_next_sharded_step_fail(m):
    """The rogue takes 7, so the trainer's step 7 (two ranks) is numbered 8. Its step 8
    then asks for 8, and `_find_sharded` takes v8 for it by number: rank 0 is refused
    ('shard 0 of 2 cannot join v8'), and had it been a rank that had not begun step 7, it
    would have joined step 7's version, assembling one version from two steps."""
    assert m.begin(7, publisher="rogue", slot=0, by=ROGUE) == 7
    for rank in (0, 1):
        assert m.begin(7, publisher=f"trainer/rank{rank}", slot=0, shard=(rank, 2), by=TRAINER) == 8
    step8 = m.begin(8, publisher="trainer/rank0", slot=1, shard=(0, 2), by=TRAINER)
    assert step8 > 8
    assert m.begin(8, publisher="trainer/rank1", slot=1, shard=(1, 2), by=TRAINER) == step8
