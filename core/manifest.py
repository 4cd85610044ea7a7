"""The manifest: everything a reader needs to pull one version, and nothing more."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

import attrs
from cattrs.gen import make_dict_unstructure_fn, override

from . import schema
from .delta import Delta, pieces
from .errors import InvalidArgumentError
from .layout import Layout
from .sharding import Shard, check_shards


def bucket_digest(data: memoryview | bytes) -> str:
    """The per-bucket digest (BLAKE2b-128): fast, and hashlib releases the GIL."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def _strings(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(items)


def _shards(items: Iterable[Shard]) -> tuple[Shard, ...]:
    return tuple(items)


def _check_version(_: Any, __: attrs.Attribute[int], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"version must be a non-negative int, got {value!r}")


@attrs.frozen
class Manifest(schema.Record):
    """One published version: its layout, where its bytes are and how to check them.

    The publisher writes it at commit; a reader gets it with its lease and reads the
    bytes from `source` by `transport`.

    Attributes:
        version: The registry's number for it.
        layout: Where each tensor lies in the slot.
        transport: The driver that exported `source`.
        source: The slot's descriptor, as the driver serialised it.
        slot: The slot's index among its publisher's.
        publisher: The name it was published under.
        digests: One digest per bucket (bare hex, or `kind:hex`), or None.
        shards: A sharded version's shards (each holds rows of the full `layout`);
            `source`, `slot` and `publisher` repeat the first's.
        step: The number its publisher asked for (its training step, say).
        delta: Its changes from an earlier version, past its whole bytes in the slot
            (`weightpull.delta`); None: it has none.

    Raises:
        InvalidArgumentError: A negative version, digests that do not match the buckets,
            shards that do not tile the layout or record digests, or a delta without the
            version's digests, of a sharded version, against a base that is not earlier,
            or whose digests do not match its pieces.
    """

    version: int = attrs.field(validator=_check_version)
    layout: Layout
    transport: str  # the driver that exported `source`
    source: bytes  # the slot's descriptor, as the driver serialised it
    slot: int
    publisher: str
    digests: tuple[str, ...] | None = attrs.field(default=None, converter=attrs.converters.optional(_strings))
    # A sharded version: `layout` is the full one, each shard holds rows of it, and
    # source/slot/publisher repeat shards[0]'s. A shard's commit carries its own alone.
    shards: tuple[Shard, ...] = attrs.field(default=(), converter=_shards)
    # The number its publisher asked for (its training step, say): versions are the
    # registry's numbering, which gives another number when that one is taken.
    step: int | None = None
    # Its changes from an earlier version, for readers that hold that one (weightpull.delta).
    delta: Delta | None = None

    def __attrs_post_init__(self) -> None:
        if self.digests is not None and len(self.digests) != len(self.layout.buckets):
            raise InvalidArgumentError(
                f"manifest v{self.version}: {len(self.digests)} digests for {len(self.layout.buckets)} buckets"
            )
        if self.shards:
            first = self.shards[0]
            if self.digests is not None:
                raise InvalidArgumentError(f"manifest v{self.version}: a sharded version records no digests")
            if (self.source, self.slot, self.publisher) != (first.source, first.slot, first.publisher):
                raise InvalidArgumentError(
                    f"manifest v{self.version}: source, slot and publisher must be those of shard {first.index}"
                )
            check_shards(self.layout, self.shards)
        if self.delta is not None:
            self._check_delta(self.delta)

    def _check_delta(self, delta: Delta) -> None:
        what = f"manifest v{self.version}'s delta"
        if self.digests is None or self.shards:
            raise InvalidArgumentError(f"{what}: a delta needs the version's digests (a patch is checked by them)")
        if delta.base >= self.version:
            raise InvalidArgumentError(f"{what} is against v{delta.base}, not an earlier version")
        if self.layout.total_bytes % delta.word:
            raise InvalidArgumentError(f"{what}: {self.layout.total_bytes} bytes are not whole words of {delta.word}")
        expected = len(self.delta_pieces())
        if len(delta.digests) != expected:
            raise InvalidArgumentError(f"{what} has {len(delta.digests)} digests for {expected} pieces")

    def delta_pieces(self) -> list[tuple[int, int]]:
        """(offset in the slot, bytes) of each piece of the delta section, read and
        digested as one; none without a delta."""
        if self.delta is None:
            return []
        return pieces(self.layout.total_bytes, self.delta.nbytes, self.layout.bucket_bytes)

    @property
    def sharded(self) -> bool:
        """Whether its bytes are spread over several shards' slots."""
        return bool(self.shards)

    @property
    def complete(self) -> bool:
        """Whether it holds every byte: not sharded, or every shard is there."""
        return not self.shards or len(self.shards) == self.shards[0].count

    @property
    def nbytes(self) -> int:
        """The size of the whole version, every shard's rows together."""
        return self.layout.total_bytes


# `shards`, `step` and `delta` are sent only when set, so a manifest without them reads as
# ever (a peer of an earlier release refuses one with a delta, naming the key).
schema.converter.register_unstructure_hook_factory(
    lambda t: t is Manifest,
    lambda t: make_dict_unstructure_fn(
        t,
        schema.converter,
        shards=override(omit_if_default=True),
        step=override(omit_if_default=True),
        delta=override(omit_if_default=True),
    ),
)
