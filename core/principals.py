"""Who asks: every registry operation is made by a principal, a role and a name.

A `publisher NAME` writes versions under publisher names it owns; a `reader NAME` holds
leases and reports what it serves under holder and replica names it owns; an `admin` may
act for anyone. A principal owns its own name and every name below it (`NAME/...`), so the
ranks of one sharded trainer (`trainer/rank0`, `trainer/rank1`) act as one publisher, and
one replica may hold a lease per mirror or rank. The rules themselves are the registry
machine's (registry_machine.py); a served registry learns the principal from the client's
key, never from what the client says.
"""

from __future__ import annotations

import enum
import re

import attrs

from . import schema
from .errors import InvalidArgumentError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


class Role(enum.Enum):
    """What a principal may do: publish versions, read them, or act for anyone."""

    PUBLISHER = "publisher"
    READER = "reader"
    ADMIN = "admin"

    def __str__(self) -> str:
        return self.value


def check_principal_name(name: object) -> str:
    """A principal's name: 1-64 letters, digits, '.', '_' or '-', first a letter or digit
    (it names key files, and '/' separates the names a principal owns).

    Args:
        name: The name to check.

    Returns:
        `name`, unchanged.

    Raises:
        InvalidArgumentError: It is not such a name.
    """
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidArgumentError(
            f"a principal's name is 1-64 letters, digits, '.', '_' or '-' starting with a letter or digit, got {name!r}"
        )
    return name


def root(name: str) -> str:
    """The principal name that owns `name` (`trainer/rank0` -> `trainer`)."""
    return name.split("/", 1)[0]


@attrs.frozen
class Principal(schema.Record):
    """Who makes a registry operation: a role and a name. It owns its name and every name
    below it (`trainer` owns `trainer/rank0`). A served registry learns it from the
    client's key.

    Args:
        role: A `Role`, or its value ("publisher", "reader", "admin").
        name: 1-64 letters, digits, '.', '_' or '-', first a letter or digit.

    Raises:
        InvalidArgumentError: The name is not such a name.
        ValueError: The role is none of the three.
    """

    role: Role = attrs.field(converter=Role)
    name: str = attrs.field(validator=lambda _, __, value: check_principal_name(value))

    @classmethod
    def publisher(cls, name: str) -> Principal:
        """The publisher called `name` (a trainer)."""
        return cls(Role.PUBLISHER, name)

    @classmethod
    def reader(cls, name: str) -> Principal:
        """The reader called `name` (a replica)."""
        return cls(Role.READER, name)

    @classmethod
    def admin(cls, name: str = "admin") -> Principal:
        """An admin, who may act for anyone (an embedded registry's process by default)."""
        return cls(Role.ADMIN, name)

    @property
    def is_admin(self) -> bool:
        """Whether its role is `Role.ADMIN`."""
        return self.role is Role.ADMIN

    def owns(self, name: str) -> bool:
        """Whether `name` (a publisher, holder or replica name) is this principal's."""
        return self.is_admin or name == self.name or name.startswith(self.name + "/")

    def __str__(self) -> str:
        if self.is_admin and self.name == "admin":
            return "admin"
        return f"{self.role} {self.name}"


ADMIN = Principal.admin()  # an embedded registry's default: the process owns all it holds
