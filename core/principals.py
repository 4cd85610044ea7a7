"""Who asks: every registry operation is made by a principal, a role and a name.

A `publisher NAME` writes versions under publisher names it owns; a `reader NAME` holds
leases and reports what it serves under holder and replica names it owns; an `admin` may
act for anyone. A principal owns its own name and every name below it (`NAME/...`), so the
ranks of one sharded trainer (`trainer/rank0`, `trainer/rank1`) act as one publisher, and
one replica may hold a lease per mirror or rank. The rules themselves are the registry
machine's (registry_machine.py); a served registry learns the principal from the client's
key, never from what the client says.

A reader's name may instead be a prefix ending in `*` (`reader rollout-*`): one key for an
autoscaled group of replicas. It owns every name that extends the prefix by at least one
name character (`rollout-7`, `rollout-7/mirror`), each replica choosing its own, but no
name outside the prefix and never the bare prefix; it publishes nothing, as any reader.
Liveness and serving are judged per concrete name (`rollout-7`), never per prefix.
"""

from __future__ import annotations

import enum
import re

import attrs

from . import schema
from .errors import InvalidArgumentError

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
WILDCARD = "*"  # ends a reader's name that is a prefix of the names it owns


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


def check_principal_pattern(name: object, role: object = "reader") -> str:
    """A principal's name, or for a reader a prefix of names, `PREFIX*` (`rollout-*`): the
    prefix is 1-63 name characters starting with a letter or digit, and `*` comes once,
    at the end.

    Args:
        name: The name or pattern to check.
        role: The principal's role (a `Role` or its value): only a reader's may be a prefix.

    Returns:
        `name`, unchanged.

    Raises:
        InvalidArgumentError: It is neither a name nor, for a reader, such a prefix.
    """
    if not isinstance(name, str) or WILDCARD not in name:
        return check_principal_name(name)
    prefix = name[: -len(WILDCARD)]
    if not name.endswith(WILDCARD) or WILDCARD in prefix:
        raise InvalidArgumentError(
            f"a name prefix has one '*', at its end (as in 'rollout-*'), got {name!r}: '*' stands for the rest "
            "of each replica's name"
        )
    if not prefix:
        raise InvalidArgumentError(
            "a name prefix needs at least one character before its '*' (as in 'rollout-*'): '*' alone would "
            "own every name, which is an admin's"
        )
    if not _NAME.fullmatch(prefix) or len(prefix) > 63:
        raise InvalidArgumentError(
            f"a name prefix is 1-63 letters, digits, '.', '_' or '-' starting with a letter or digit, then '*', "
            f"got {name!r}"
        )
    if str(role) != Role.READER.value:
        raise InvalidArgumentError(
            f"only a reader's name may be a prefix ({name!r} was given for a {role}): a publisher or an admin "
            "is one principal with one name"
        )
    return name


def is_pattern(name: str) -> bool:
    """Whether a principal's name is a prefix of the names it owns (`rollout-*`)."""
    return name.endswith(WILDCARD)


def matches(pattern: str, name: str) -> bool:
    """Whether the principal name `name` (no '/') is one a prefix `pattern` owns: the
    prefix, then at least one more name character."""
    prefix = pattern[: -len(WILDCARD)]
    return len(name) > len(prefix) and name.startswith(prefix) and _NAME.fullmatch(name) is not None


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
        name: 1-64 letters, digits, '.', '_' or '-', first a letter or digit; for a
            reader, also a prefix `PREFIX*` of the names it owns (`rollout-*`).

    Raises:
        InvalidArgumentError: The name is not such a name (or a prefix of a role not a reader).
        ValueError: The role is none of the three.
    """

    role: Role = attrs.field(converter=Role)
    name: str = attrs.field(validator=lambda self, __, value: check_principal_pattern(value, self.role))

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

    @property
    def is_prefix(self) -> bool:
        """Whether its name is a prefix (`rollout-*`) of the names it owns: a group of replicas."""
        return is_pattern(self.name)

    def owns(self, name: str) -> bool:
        """Whether `name` (a publisher, holder or replica name) is this principal's: its
        own name and the names below it, or for a prefix, every name extending it and the
        names below those."""
        if self.is_admin:
            return True
        if self.is_prefix:
            return isinstance(name, str) and matches(self.name, root(name))
        return name == self.name or name.startswith(self.name + "/")

    def __str__(self) -> str:
        if self.is_admin and self.name == "admin":
            return "admin"
        return f"{self.role} {self.name}"


ADMIN = Principal.admin()  # an embedded registry's default: the process owns all it holds
