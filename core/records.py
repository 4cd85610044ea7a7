"""The registry's public records: a lease, and the status of versions and leases.

They cross the process boundary to a served registry's clients, so each reads itself
back from a plain dict, strictly.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from .errors import InvalidArgumentError
from .states import VersionState


def _checked(cls: type, data: Any, types: Mapping[str, type | tuple[type, ...]]) -> dict[str, Any]:
    """`data` as keyword arguments for `cls`, once its keys and value types match `types`
    exactly (the dicts come off the wire: nothing is coerced)."""
    if not isinstance(data, Mapping) or set(data) != set(types):
        keys = sorted(data) if isinstance(data, Mapping) else type(data).__name__
        raise InvalidArgumentError(f"malformed {cls.__name__}: expected keys {sorted(types)}, got {keys}")
    for key, want in types.items():
        value = data[key]
        if isinstance(value, bool) or not isinstance(value, want):
            raise InvalidArgumentError(f"malformed {cls.__name__}: {key} must not be {value!r}")
    return dict(data)


_NUMBER = (int, float)


@attrs.frozen
class Lease:
    """A reader's claim on one version, valid until `expires_at` on the registry's clock."""

    id: str
    version: int
    holder: str
    ttl: float
    expires_at: float

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> Lease:
        types = {"id": str, "version": int, "holder": str, "ttl": _NUMBER, "expires_at": _NUMBER}
        return cls(**_checked(cls, data, types))


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
        return {**attrs.asdict(self), "state": self.state.value}

    @classmethod
    def from_dict(cls, data: Any) -> VersionInfo:
        types = {"version": int, "state": str, "publisher": str, "slot": int, "nbytes": (int, type(None)),
                 "age": _NUMBER, "live_leases": int, "reason": str}
        kw = _checked(cls, data, types)
        try:
            return cls(**{**kw, "state": VersionState(kw["state"])})
        except ValueError:
            raise InvalidArgumentError(f"malformed VersionInfo: no version state {kw['state']!r}") from None


@attrs.frozen
class LeaseInfo:
    id: str
    version: int
    holder: str
    expires_in: float

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> LeaseInfo:
        return cls(**_checked(cls, data, {"id": str, "version": int, "holder": str, "expires_in": _NUMBER}))


@attrs.frozen
class RegistryStatus:
    newest_ready: int | None
    versions: tuple[VersionInfo, ...]
    leases: tuple[LeaseInfo, ...]
    serving: Mapping[str, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "newest_ready": self.newest_ready,
            "versions": [v.to_dict() for v in self.versions],
            "leases": [x.to_dict() for x in self.leases],
            "serving": dict(self.serving),
        }

    @classmethod
    def from_dict(cls, data: Any) -> RegistryStatus:
        kw = _checked(cls, data, {"newest_ready": (int, type(None)), "versions": list, "leases": list, "serving": dict})
        serving = kw["serving"]
        if not all(isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) for k, v in serving.items()):
            raise InvalidArgumentError(f"malformed RegistryStatus: serving must map names to versions, got {serving!r}")
        return cls(
            newest_ready=kw["newest_ready"],
            versions=tuple(VersionInfo.from_dict(v) for v in kw["versions"]),
            leases=tuple(LeaseInfo.from_dict(x) for x in kw["leases"]),
            serving=dict(serving),
        )
