"""The registry's public records: a lease, and the status of versions and leases.

They cross the process boundary to a served registry's clients, so each reads itself
back from a plain dict through the strict schema (`weightpull.schema`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from . import schema
from .states import VersionState


@attrs.frozen
class Lease(schema.Record):
    """A reader's claim on one version, valid until `expires_at` on the registry's clock."""

    id: str
    version: int
    holder: str
    ttl: float
    expires_at: float


@attrs.frozen
class VersionInfo(schema.Record):
    version: int
    state: VersionState
    publisher: str
    slot: int
    nbytes: int | None
    age: float
    live_leases: int
    reason: str = ""


@attrs.frozen
class LeaseInfo(schema.Record):
    id: str
    version: int
    holder: str
    expires_in: float


@attrs.frozen
class RegistryStatus(schema.Record):
    newest_ready: int | None
    versions: tuple[VersionInfo, ...]
    leases: tuple[LeaseInfo, ...]
    serving: Mapping[str, int]
