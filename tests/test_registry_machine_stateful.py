"""The registry machine under a Hypothesis state machine: each rule is one plain call, the
clock a FakeClock moved by a rule, and no event loop anywhere (the way fuzz/ can drive it).
Small and derandomized here; the fuzzers in fuzz/ explore far more."""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weightpull import FakeClock, Manifest, TensorSpec, VersionState, plan_layout
from weightpull.errors import VersionInUseError
from weightpull.registry import RegistryMachine

LAYOUT = plan_layout([TensorSpec("w", "uint8", (4,))])
SLOTS = 3


class RegistryRules(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.m = RegistryMachine(self.clock, max_ttl=10.0)
        self.next_version = 1
        self.slots: dict[int, int] = {}  # slot -> the version it holds
        self.leases: dict[str, tuple[int, float]] = {}  # lease id -> (version, expires at)

    @precondition(lambda self: len(self.slots) < SLOTS)
    @rule(commit=st.booleans())
    def publish(self, commit: bool) -> None:
        slot = min(set(range(SLOTS)) - set(self.slots))
        v, self.next_version = self.next_version, self.next_version + 1
        self.m.begin(v, publisher="pub", slot=slot)
        self.slots[slot] = v
        if commit:
            self.m.commit(Manifest(v, LAYOUT, "fake", b"d", slot, "pub"))
        else:
            self.m.abort(v, "the copy failed")

    @precondition(lambda self: self.m.newest_ready is not None)
    @rule(ttl=st.floats(0.5, 10.0))
    def acquire(self, ttl: float) -> None:
        lease = self.m.acquire(ttl=ttl, holder="reader")
        self.leases[lease.id] = (lease.version, lease.expires_at)

    @rule(seconds=st.floats(0.0, 5.0))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)

    @precondition(lambda self: self.slots)
    @rule(data=st.data())
    def reclaim(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.slots)))
        v = self.slots[slot]
        live = any(lv == v and self.clock.now() < end for lv, end in self.leases.values())
        try:
            self.m.reclaim(v)
        except VersionInUseError:
            assert live or v == self.m.newest_ready
        else:
            assert not live and v != self.m.newest_ready
            del self.slots[slot]

    @invariant()
    def one_ready_and_it_is_the_newest(self) -> None:
        ready = [x.version for x in self.m.status().versions if x.state is VersionState.READY]
        assert ready == ([] if self.m.newest_ready is None else [self.m.newest_ready])


RegistryRules.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, derandomize=True, database=None, deadline=None
)
test_registry_machine = RegistryRules.TestCase
