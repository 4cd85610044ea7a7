"""The registry's public records: a lease, and the status of versions and leases.

They cross the process boundary to a served registry's clients, so each reads itself
back from a plain dict through the strict schema (`weightpull.schema`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from . import schema
from .states import VersionState


@attrs.frozen
class Lease:
    """A reader's claim on one version, valid until `expires_at` on the registry's clock."""

    id: str
    version: int
    holder: str
    ttl: float
    expires_at: float

    def to_dict(self) -> dict[str, Any]:
        return schema.as_object(self, Lease)

    @classmethod
    def from_dict(cls, data: Any) -> Lease:
        return schema.structure(data, Lease)


@attrs.frozen
class VersionInfo:
    version: int
    state: VersionState
    publisher: str
    slot: int
    nbytes: int | None
    age: float
    live_leases: int
    reason: str = ""

    def to_dict(self) -> dict[str, Any]:
        return schema.as_object(self, VersionInfo)

    @classmethod
    def from_dict(cls, data: Any) -> VersionInfo:
        return schema.structure(data, VersionInfo)


@attrs.frozen
class LeaseInfo:
    id: str
    version: int
    holder: str
    expires_in: float

    def to_dict(self) -> dict[str, Any]:
        return schema.as_object(self, LeaseInfo)

    @classmethod
    def from_dict(cls, data: Any) -> LeaseInfo:
        return schema.structure(data, LeaseInfo)


@attrs.frozen
class RegistryStatus:
    newest_ready: int | None
    versions: tuple[VersionInfo, ...]
    leases: tuple[LeaseInfo, ...]
    serving: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return schema.as_object(self, RegistryStatus)

    @classmethod
    def from_dict(cls, data: Any) -> RegistryStatus:
        return schema.structure(data, RegistryStatus)
