"""Shard assembly: the parts of one version that several shard publishers write together.

Each of a sharded version's `count` shards begins it into a slot of its own, then commits
a manifest naming that shard alone; the version turns READY at the last commit, as one
manifest naming every shard. The registry keeps a `ShardAssembly` per sharded version,
and every rule about shards lives here. Decisions only: no I/O, no clock.
"""

from __future__ import annotations

import attrs

from .errors import InvalidArgumentError, VersionOrderError, VersionStateError
from .manifest import Manifest
from .states import VersionState


@attrs.define
class _Part:
    """One shard publisher's part: begun into its slot, then committed."""

    publisher: str
    slot: int
    manifest: Manifest | None = None


@attrs.define
class ShardAssembly:
    """What the registry knows of one sharded version's parts, and the rules they keep.

    Attributes:
        version: The version's number.
        count: How many shards it has.
        parts: Each begun shard's part, by shard index.
    """

    version: int
    count: int
    parts: dict[int, _Part] = attrs.Factory(dict)  # shard index -> its part

    @property
    def began(self) -> bool:
        """False for an abort's tombstone: a shard aborted before any shard began."""
        return bool(self.parts)

    def slots(self) -> list[tuple[str, int]]:
        """(publisher, slot) of every slot that holds a part."""
        return [(p.publisher, p.slot) for p in self.parts.values()]

    def waiting(self) -> list[int]:
        """The shards yet to commit."""
        return sorted(set(range(self.count)) - {i for i, p in self.parts.items() if p.manifest})

    def check_join(self, index: int, count: int) -> None:
        """Refuse a shard that does not belong, or that already began.

        Raises:
            InvalidArgumentError: `count` is not the version's, or shard `index` began.
        """
        if self.count != count or index in self.parts:
            raise InvalidArgumentError(
                f"shard {index} of {count} cannot join v{self.version}: it has {self.count} shards, "
                f"of which {sorted(self.parts)} began"
            )

    def join(self, index: int, publisher: str, slot: int) -> None:
        """Record shard `index` as begun into `publisher`'s `slot` (after `check_join`)."""
        self.parts[index] = _Part(publisher, slot)

    def commit(self, manifest: Manifest, *, state: VersionState, reason: str, announced: int) -> bool:
        """Record one shard's commit; True once every shard has committed. `state` and
        `reason` are the version's, `announced` the highest version announced so far.

        Raises:
            InvalidArgumentError: The manifest names other than one shard, one not begun
                for this version, one already committed, or disagrees with another
                shard's layout or transport.
            VersionStateError: The version is no longer WRITING.
            VersionOrderError: A newer version was announced already.
        """
        version = manifest.version
        if len(manifest.shards) != 1:
            raise InvalidArgumentError(
                f"a shard commits a manifest naming itself alone; v{version}'s names {len(manifest.shards)}"
            )
        shard = manifest.shards[0]
        part = self.parts.get(shard.index)
        if shard.count != self.count or part is None or (part.publisher, part.slot) != (shard.publisher, shard.slot):
            raise InvalidArgumentError(
                f"shard {shard.index} of {shard.count} from {shard.publisher!r} slot {shard.slot} "
                f"was not begun for v{version}"
            )
        if state is not VersionState.WRITING:
            raise VersionStateError(f"version {version} is {state} ({reason}); shard {shard.index} cannot commit")
        if part.manifest is not None:
            raise InvalidArgumentError(f"shard {shard.index} of v{version} already committed")
        if version < announced:
            raise VersionOrderError(f"version {version} cannot be announced after {announced}")
        for other in self.parts.values():
            m = other.manifest
            if m is not None and (m.layout.signature, m.transport) != (manifest.layout.signature, manifest.transport):
                raise InvalidArgumentError(
                    f"shard {shard.index} of v{version} disagrees with shard {m.shards[0].index} on the layout or transport"
                )
        part.manifest = manifest
        return not self.waiting()

    def whole(self) -> Manifest:
        """The version's manifest, naming every shard.

        Raises:
            InvalidArgumentError: The shards do not tile the tensors (the version can
                then never be read).
        """
        committed = [p.manifest for _, p in sorted(self.parts.items()) if p.manifest is not None]
        return attrs.evolve(committed[0], shards=[m.shards[0] for m in committed])
