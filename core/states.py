"""The three state machines of weightpull, as transition tables in one place.

Nothing else decides which event a state allows: the registry, the publisher and the
docs (`make docs` writes docs/reference/states.md) all read these tables, each through its typed
`Machine` (`VERSION`, `LEASE`, `SLOT`). An event a
state does not allow raises `InvalidTransitionError`, naming the machine, state and event.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Any, Generic, TypeVar

import attrs

from .errors import InvalidTransitionError


class VersionState(enum.Enum):
    """Where a version stands (`VERSION`; the diagrams are in the reference's state
    machines page)."""

    WRITING = "WRITING"  # a publisher is copying it into a slot; invisible to readers
    STREAMING = "STREAMING"  # still being copied, bucket by bucket: readers who opt in read what is committed
    READY = "READY"  # announced: the newest READY version is what readers lease
    RETIRED = "RETIRED"  # superseded or withdrawn: leases drain, no new ones
    ABORTED = "ABORTED"  # its publish failed; the previous READY version is untouched
    RECLAIMED = "RECLAIMED"  # its slot may be rewritten; the record is dropped

    def __str__(self) -> str:
        return self.value

    @property
    def being_written(self) -> bool:
        """Whether it is WRITING or STREAMING."""
        return self in (VersionState.WRITING, VersionState.STREAMING)


class VersionEvent(enum.Enum):
    """What happens to a version (`VERSION`)."""

    STREAM = "stream"
    MARK = "mark"
    COMMIT = "commit"
    ABORT = "abort"
    RETIRE = "retire"
    RECLAIM = "reclaim"

    def __str__(self) -> str:
        return self.value


class LeaseState(enum.Enum):
    """Where a lease stands (`LEASE`): held, released by its holder, or lapsed."""

    ACTIVE = "ACTIVE"
    RELEASED = "RELEASED"
    EXPIRED = "EXPIRED"

    def __str__(self) -> str:
        return self.value


class LeaseEvent(enum.Enum):
    """What happens to a lease (`LEASE`)."""

    RENEW = "renew"
    RELEASE = "release"
    EXPIRE = "expire"

    def __str__(self) -> str:
        return self.value


class SlotState(enum.Enum):
    """Where a publisher's slot stands (`SLOT`)."""

    FREE = "FREE"  # holds nothing a reader may want
    WRITING = "WRITING"  # the publisher is copying a version in
    HOLDING = "HOLDING"  # holds a committed version (READY or RETIRED)

    def __str__(self) -> str:
        return self.value


class SlotEvent(enum.Enum):
    """What happens to a slot (`SLOT`)."""

    FILL = "fill"
    COMMIT = "commit"
    ABORT = "abort"
    RECLAIM = "reclaim"

    def __str__(self) -> str:
        return self.value


V, VE = VersionState, VersionEvent
L, LE = LeaseState, LeaseEvent
S, SE = SlotState, SlotEvent

StateT = TypeVar("StateT", bound=enum.Enum)
EventT = TypeVar("EventT", bound=enum.Enum)


@attrs.frozen
class Machine(Generic[StateT, EventT]):
    """One state machine: its transition table as data, and `fire` to step it. Typed,
    so that `VERSION.fire(...)` is a `VersionState` to the type checker as well.

    Attributes:
        name: "version", "lease" or "slot".
        states: Its states' enum.
        events: Its events' enum.
        initial: The state a new one starts in.
        table: (state, event) -> the state after.
    """

    name: str
    states: type[StateT]
    events: type[EventT]
    initial: StateT
    table: Mapping[tuple[StateT, EventT], StateT]

    def fire(self, state: StateT, event: EventT, subject: str = "") -> StateT:
        """The state after `event` from `state`.

        Args:
            state: The state now.
            event: What happens.
            subject: What is stepped (`v3`, a lease id), named in the error.

        Raises:
            InvalidTransitionError: `state` does not allow `event`.
        """
        try:
            return self.table[(state, event)]
        except KeyError:
            raise InvalidTransitionError(self.name, state, event, subject) from None

    def mermaid(self) -> str:
        """A Mermaid state diagram drawn from the table."""
        lines = ["stateDiagram-v2", f"    [*] --> {self.initial}"]
        for (src, event), dst in self.table.items():
            lines.append(f"    {src} --> {dst}: {event}")
        targets = set(self.table.values())
        sources = {src for src, _ in self.table}
        for state in self.states:
            if state in targets and state not in sources:
                lines.append(f"    {state} --> [*]")
        return "\n".join(lines)


VERSION = Machine(
    "version",
    VersionState,
    VersionEvent,
    V.WRITING,
    {
        (V.WRITING, VE.COMMIT): V.READY,
        (V.WRITING, VE.ABORT): V.ABORTED,
        (V.WRITING, VE.STREAM): V.STREAMING,
        (V.STREAMING, VE.MARK): V.STREAMING,
        (V.STREAMING, VE.COMMIT): V.READY,
        (V.STREAMING, VE.ABORT): V.ABORTED,
        (V.READY, VE.RETIRE): V.RETIRED,
        (V.RETIRED, VE.RECLAIM): V.RECLAIMED,
        (V.ABORTED, VE.RECLAIM): V.RECLAIMED,
    },
)

LEASE = Machine(
    "lease",
    LeaseState,
    LeaseEvent,
    L.ACTIVE,
    {
        (L.ACTIVE, LE.RENEW): L.ACTIVE,
        (L.ACTIVE, LE.RELEASE): L.RELEASED,
        (L.ACTIVE, LE.EXPIRE): L.EXPIRED,
    },
)

SLOT = Machine(
    "slot",
    SlotState,
    SlotEvent,
    S.FREE,
    {
        (S.FREE, SE.FILL): S.WRITING,
        (S.WRITING, SE.COMMIT): S.HOLDING,
        (S.WRITING, SE.ABORT): S.FREE,
        (S.HOLDING, SE.RECLAIM): S.FREE,
    },
)

ALL: tuple[Machine[Any, Any], ...] = (VERSION, LEASE, SLOT)

# The views by name, as an `InvalidTransitionError` names a machine (the wire turns the
# names back into enums through MACHINES).
_BY_NAME: Mapping[str, Machine[Any, Any]] = {m.name: m for m in ALL}
MACHINES: Mapping[str, tuple[type[enum.Enum], type[enum.Enum], Mapping[Any, Any]]] = {
    m.name: (m.states, m.events, m.table) for m in ALL
}
INITIAL = {m.name: m.initial for m in ALL}
VERSION_TRANSITIONS, LEASE_TRANSITIONS, SLOT_TRANSITIONS = VERSION.table, LEASE.table, SLOT.table


def transition(machine: str, state: enum.Enum, event: enum.Enum, subject: str = "") -> enum.Enum:
    """`fire` on the machine called `machine`, untyped; prefer `VERSION.fire` and its kin.

    Raises:
        InvalidTransitionError: `state` does not allow `event`.
        KeyError: No machine of that name.
    """
    fired: enum.Enum = _BY_NAME[machine].fire(state, event, subject)
    return fired


def mermaid(machine: str) -> str:
    """A Mermaid state diagram drawn from the machine's table."""
    return _BY_NAME[machine].mermaid()


_WHO_FIRES = {
    "version": (
        "Who fires what: `commit`, `abort`, `retire` and `reclaim` come from the version's own\n"
        "publisher (or an admin; `PermissionDeniedError` for anyone else). The registry itself\n"
        "fires `retire` on the newest READY version when a newer one is announced, and, when a\n"
        "publisher's liveness lapses, `abort` on its WRITING versions and `retire` on its READY\n"
        "one, recording the reason that `weightpull status` shows.\n\n"
        "A streaming publisher fires `stream` once the version's manifest is known, before its\n"
        "bytes are, then `mark` as buckets land (the count committed so far, batched); readers\n"
        "that opt in lease a STREAMING version and read each bucket once it is marked. Their\n"
        "copy counts only if the version then turns READY under their lease: a stream that\n"
        "ends ABORTED leaves every such reader with a rejected copy."
    ),
    "lease": (
        "`renew` and `release` come from the holder (a principal owning the holder name) or an\n"
        "admin; `expire` is the registry's, on its own clock."
    ),
}


def markdown() -> str:
    """docs/reference/states.md, generated so that the docs cannot drift from the tables."""
    parts = [
        "# State machines",
        "",
        "Generated from `core/states.py` by `make docs`; a test fails",
        "when this file and the tables disagree. Any event not drawn from a state raises",
        "`InvalidTransitionError` naming the machine, the state and the event.",
    ]
    for machine in ALL:
        parts += ["", f"## {machine.name}", "", "```mermaid", machine.mermaid(), "```"]
        if machine.name in _WHO_FIRES:
            parts += ["", _WHO_FIRES[machine.name]]
    return "\n".join(parts) + "\n"
