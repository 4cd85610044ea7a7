"""The publisher's slot choice, as the pure function it is."""

from weightpull.publisher import choose_slot
from weightpull.states import SlotState

FREE, WRITING, HOLDING = SlotState.FREE, SlotState.WRITING, SlotState.HOLDING


def test_an_empty_slot_comes_first():
    assert choose_slot([(HOLDING, 1), (FREE, None), (FREE, None)]) == 1


def test_else_the_oldest_version_the_registry_does_not_keep():
    slots = [(HOLDING, 5), (HOLDING, 3), (HOLDING, 4)]
    assert choose_slot(slots) == 1
    assert choose_slot(slots, kept={3}) == 2  # v3 is leased
    assert choose_slot(slots, kept={3, 4}) == 0


def test_an_aborted_version_still_to_reclaim_is_tried_in_its_turn():
    assert choose_slot([(FREE, 7), (HOLDING, 3)]) == 1
    assert choose_slot([(FREE, 7), (HOLDING, 3)], kept={3}) == 0


def test_none_when_every_slot_is_kept_or_being_written():
    assert choose_slot([(HOLDING, 1), (HOLDING, 2)], kept={1, 2}) is None  # leased, and the newest READY
    assert choose_slot([(WRITING, None), (HOLDING, 2)], kept={2}) is None
    assert choose_slot([]) is None


def test_a_slot_being_written_is_never_chosen():
    assert choose_slot([(WRITING, None), (HOLDING, 9)]) == 1
