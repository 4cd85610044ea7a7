import itertools
from pathlib import Path

import pytest

from weightpull import InvalidTransitionError
from weightpull.states import MACHINES, markdown, transition

LEGAL = [(m, s, e, dst) for m, (_, _, table) in MACHINES.items() for (s, e), dst in table.items()]
ILLEGAL = [
    (m, s, e)
    for m, (states, events, table) in MACHINES.items()
    for s, e in itertools.product(states, events)
    if (s, e) not in table
]


@pytest.mark.parametrize("machine,state,event,expected", LEGAL)
def test_every_legal_transition(machine, state, event, expected):
    assert transition(machine, state, event) is expected


@pytest.mark.parametrize("machine,state,event", ILLEGAL)
def test_every_illegal_transition_names_state_and_event(machine, state, event):
    with pytest.raises(InvalidTransitionError) as info:
        transition(machine, state, event, subject="x1")
    err = info.value
    assert (err.machine, err.state, err.event) == (machine, state, event)
    assert str(state) in str(err) and str(event) in str(err) and machine in str(err)


def test_tables_cover_each_machine():
    assert len(LEGAL) == 5 + 3 + 4
    assert len(ILLEGAL) == 5 * 4 - 5 + 3 * 3 - 3 + 3 * 4 - 4


def test_docs_state_diagrams_match_the_tables():
    docs = Path(__file__).resolve().parents[1] / "docs" / "states.md"
    assert docs.read_text() == markdown(), "regenerate it: make docs"
