import itertools
from pathlib import Path

import pytest

from weightpull.errors import InvalidTransitionError
from weightpull.states import (
    ALL,
    LEASE,
    MACHINES,
    SLOT,
    VERSION,
    LeaseEvent,
    LeaseState,
    SlotEvent,
    SlotState,
    VersionEvent,
    VersionState,
    markdown,
    transition,
)

LEGAL = [(m, s, e, dst) for m in ALL for (s, e), dst in m.table.items()]
ILLEGAL = [(m, s, e) for m in ALL for s, e in itertools.product(m.states, m.events) if (s, e) not in m.table]


@pytest.mark.parametrize("machine,state,event,expected", LEGAL)
def test_every_legal_transition(machine, state, event, expected):
    assert machine.fire(state, event) is expected
    assert transition(machine.name, state, event) is expected  # the untyped, by-name form


@pytest.mark.parametrize("machine,state,event", ILLEGAL)
def test_every_illegal_transition_names_state_and_event(machine, state, event):
    for fire in (machine.fire, lambda s, e, subject: transition(machine.name, s, e, subject)):
        with pytest.raises(InvalidTransitionError) as info:
            fire(state, event, subject="x1")
        err = info.value
        assert (err.machine, err.state, err.event, err.subject) == (machine.name, state, event, "x1")
        assert str(state) in str(err) and str(event) in str(err) and machine.name in str(err)


def test_fire_returns_the_machines_own_state_type():
    assert type(VERSION.fire(VersionState.WRITING, VersionEvent.COMMIT)) is VersionState
    assert type(LEASE.fire(LeaseState.ACTIVE, LeaseEvent.RENEW)) is LeaseState
    assert type(SLOT.fire(SlotState.FREE, SlotEvent.FILL)) is SlotState


def test_tables_cover_each_machine():
    assert len(LEGAL) == 9 + 3 + 4
    assert len(ILLEGAL) == 6 * 6 - 9 + 3 * 3 - 3 + 3 * 4 - 4


def test_the_views_by_name_are_the_machines():
    assert {m.name: (m.states, m.events, m.table) for m in ALL} == dict(MACHINES)


def test_docs_state_diagrams_match_the_tables():
    docs = Path(__file__).resolve().parents[1] / "docs" / "reference" / "states.md"
    assert docs.read_text() == markdown(), "regenerate it: make docs"
