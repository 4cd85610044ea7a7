"""The three state machines of weightpull, as transition tables in one place.

Nothing else decides which event a state allows: the registry, the publisher and the
docs (`make docs` writes docs/states.md) all read these tables. An event a
state does not allow raises `InvalidTransitionError`, naming the machine, state and event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping

from .errors import InvalidTransitionError


class VersionState(enum.Enum):
    WRITING = "WRITING"  # a publisher is copying it into a slot; invisible to readers
    READY = "READY"  # announced: the newest READY version is what readers lease
    RETIRED = "RETIRED"  # superseded or withdrawn: leases drain, no new ones
    ABORTED = "ABORTED"  # its publish failed; the previous READY version is untouched
    RECLAIMED = "RECLAIMED"  # its slot may be rewritten; the record is dropped

    def __str__(self) -> str:
        return self.value


class VersionEvent(enum.Enum):
    COMMIT = "commit"
    ABORT = "abort"
    RETIRE = "retire"
    RECLAIM = "reclaim"

    def __str__(self) -> str:
        return self.value


class LeaseState(enum.Enum):
    ACTIVE = "ACTIVE"
    RELEASED = "RELEASED"
    EXPIRED = "EXPIRED"

    def __str__(self) -> str:
        return self.value


class LeaseEvent(enum.Enum):
    RENEW = "renew"
    RELEASE = "release"
    EXPIRE = "expire"

    def __str__(self) -> str:
        return self.value


class SlotState(enum.Enum):
    FREE = "FREE"  # holds nothing a reader may want
    WRITING = "WRITING"  # the publisher is copying a version in
    HOLDING = "HOLDING"  # holds a committed version (READY or RETIRED)

    def __str__(self) -> str:
        return self.value


class SlotEvent(enum.Enum):
    FILL = "fill"
    COMMIT = "commit"
    ABORT = "abort"
    RECLAIM = "reclaim"

    def __str__(self) -> str:
        return self.value


V, VE = VersionState, VersionEvent
L, LE = LeaseState, LeaseEvent
S, SE = SlotState, SlotEvent

VERSION_TRANSITIONS: Mapping[tuple[VersionState, VersionEvent], VersionState] = {
    (V.WRITING, VE.COMMIT): V.READY,
    (V.WRITING, VE.ABORT): V.ABORTED,
    (V.READY, VE.RETIRE): V.RETIRED,
    (V.RETIRED, VE.RECLAIM): V.RECLAIMED,
    (V.ABORTED, VE.RECLAIM): V.RECLAIMED,
}

LEASE_TRANSITIONS: Mapping[tuple[LeaseState, LeaseEvent], LeaseState] = {
    (L.ACTIVE, LE.RENEW): L.ACTIVE,
    (L.ACTIVE, LE.RELEASE): L.RELEASED,
    (L.ACTIVE, LE.EXPIRE): L.EXPIRED,
}

SLOT_TRANSITIONS: Mapping[tuple[SlotState, SlotEvent], SlotState] = {
    (S.FREE, SE.FILL): S.WRITING,
    (S.WRITING, SE.COMMIT): S.HOLDING,
    (S.WRITING, SE.ABORT): S.FREE,
    (S.HOLDING, SE.RECLAIM): S.FREE,
}

MACHINES: Mapping[str, tuple[type[enum.Enum], type[enum.Enum], Mapping]] = {
    "version": (VersionState, VersionEvent, VERSION_TRANSITIONS),
    "lease": (LeaseState, LeaseEvent, LEASE_TRANSITIONS),
    "slot": (SlotState, SlotEvent, SLOT_TRANSITIONS),
}

INITIAL = {"version": V.WRITING, "lease": L.ACTIVE, "slot": S.FREE}


def transition(machine: str, state: enum.Enum, event: enum.Enum, subject: str = "") -> enum.Enum:
    """The state after `event`, or `InvalidTransitionError` when `state` forbids it."""
    table = MACHINES[machine][2]
    try:
        return table[(state, event)]
    except KeyError:
        raise InvalidTransitionError(machine, state, event, subject) from None


def mermaid(machine: str) -> str:
    """A Mermaid state diagram drawn from the machine's table."""
    states, _, table = MACHINES[machine]
    lines = ["stateDiagram-v2", f"    [*] --> {INITIAL[machine]}"]
    for (src, event), dst in table.items():
        lines.append(f"    {src} --> {dst}: {event}")
    targets = {dst for dst in table.values()}
    sources = {src for src, _ in table}
    for state in states:
        if state in targets and state not in sources:
            lines.append(f"    {state} --> [*]")
    return "\n".join(lines)


def markdown() -> str:
    """docs/states.md, generated so that the docs cannot drift from the tables."""
    parts = [
        "# State machines",
        "",
        "Generated from `core/states.py` by `make docs`; a test fails",
        "when this file and the tables disagree. Any event not drawn from a state raises",
        "`InvalidTransitionError` naming the machine, the state and the event.",
    ]
    for machine in MACHINES:
        parts += ["", f"## {machine}", "", "```mermaid", mermaid(machine), "```"]
    return "\n".join(parts) + "\n"
