"""The manifest: everything a reader needs to pull one version, and nothing more."""

from __future__ import annotations

import base64
import hashlib
from collections.abc import Mapping
from typing import Any

import attrs

from .errors import InvalidArgumentError
from .layout import Layout


def bucket_digest(data: memoryview | bytes) -> str:
    """The per-bucket digest (BLAKE2b-128): fast, and hashlib releases the GIL."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _check_version(_: Any, __: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"version must be a non-negative int, got {value!r}")


@attrs.frozen
class Manifest:
    """One published version: its layout, where its bytes are and how to check them."""

    version: int = attrs.field(validator=_check_version)
    layout: Layout
    transport: str  # the driver that exported `source`
    source: bytes  # the slot's descriptor, as the driver serialised it
    slot: int
    publisher: str
    digests: tuple[str, ...] | None = attrs.field(
        default=None, converter=attrs.converters.optional(tuple)
    )

    def __attrs_post_init__(self) -> None:
        if self.digests is not None and len(self.digests) != len(self.layout.buckets):
            raise InvalidArgumentError(
                f"manifest v{self.version}: {len(self.digests)} digests for "
                f"{len(self.layout.buckets)} buckets"
            )

    @property
    def nbytes(self) -> int:
        return self.layout.total_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "layout": self.layout.to_dict(),
            "transport": self.transport,
            "source": base64.b64encode(self.source).decode(),
            "slot": self.slot,
            "publisher": self.publisher,
            "digests": list(self.digests) if self.digests is not None else None,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Manifest:
        try:
            return cls(
                version=data["version"],
                layout=Layout.from_dict(data["layout"]),
                transport=str(data["transport"]),
                source=base64.b64decode(data["source"], validate=True),
                slot=int(data["slot"]),
                publisher=str(data["publisher"]),
                digests=data.get("digests"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, InvalidArgumentError):
                raise
            raise InvalidArgumentError(f"malformed manifest: {exc!r}") from exc
