"""The digests of a rank's slice: one a bucket of its mirror, computed by the layout's
first relay over the copy it read from the version's own slot, and checked by every
rank that reads that layout from a relay (docs/guides/sharding.md, "Relays").

A publisher records digests of its slot's buckets; a slice cuts across them, so none of
those can vouch for it. The slot's bytes are vouched for by the lease (never written
while a lease lives), so a copy read from the slot under a lease that held is as good as
the slot: its digests, given to the registry with the relay's first offer (which takes
them only from a holder whose lease was placed at the slot), are what every later
reader of that layout checks against, whichever relay it read from.

On the host: BLAKE2b-128 (cryptographic: a relay cannot make other bytes match). In a
mirror on a GPU: wsum64, by the `Digester` given, where the mirror lies.
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .digests import BLAKE2B128, WSUM64, digest, kind_of, matches
from .errors import DigestMismatchError, InvalidArgumentError
from .layout import Layout
from .settings import Digester
from .transport import Region

__all__ = ["compute", "verify"]


def _spans(layout: Layout) -> list[tuple[int, int]]:
    return [(b.offset, b.nbytes) for b in layout.buckets]


def _by_digester(digester: Digester, region: Region, layout: Layout) -> list[str]:
    got = list(digester(region, _spans(layout)))
    if len(got) != len(layout.buckets):
        raise InvalidArgumentError(f"the digester gave {len(got)} digests for {len(layout.buckets)} buckets")
    return got


async def compute(layout: Layout, region: Region, digester: Digester | None) -> tuple[str, ...]:
    """The digests of the slice in `region`, packed as `layout`: by `digester` (wsum64)
    where given, else BLAKE2b-128 of the host's bytes. In a worker thread."""

    def run() -> tuple[str, ...]:
        if digester is not None:
            return tuple(_by_digester(digester, region, layout))
        view = region.host_view()
        return tuple(digest(view[o : o + n], BLAKE2B128) for o, n in _spans(layout))

    return await anyio.to_thread.run_sync(run)


async def verify(
    layout: Layout,
    region: Region,
    digests: Sequence[str],
    digester: Digester | None,
    *,
    version: int,
    source: str,
) -> None:
    """Check the slice read from relay `source` into `region` against `digests`.

    Raises:
        DigestMismatchError: not one digest a bucket, or a bucket that differs (the
            first named, with the relay).
        InvalidArgumentError: the digests are of a kind that cannot be checked here
            (wsum64 ones need `digester` on a GPU mirror; BLAKE2b ones a host mirror).
    """
    buckets = layout.buckets
    if len(digests) != len(buckets):
        raise DigestMismatchError(
            f"v{version}: the slice read from {source!r} came with {len(digests)} digests for {len(buckets)} buckets"
        )
    kinds = {kind_of(d) for d in digests}
    by_digester = digester is not None and kinds == {WSUM64}
    if not by_digester and region.view is None:
        raise InvalidArgumentError(
            f"v{version}: the slice's digests are {'/'.join(sorted(kinds))}, which a mirror off the host checks "
            "only as wsum64 with digester=: give every rank of this layout on a GPU a digester"
        )

    def first_bad() -> int | None:
        if by_digester:
            assert digester is not None
            got = _by_digester(digester, region, layout)
            return next((i for i, (want, have) in enumerate(zip(digests, got, strict=True)) if want != have), None)
        view = region.host_view()
        return next(
            (
                i
                for i, (b, want) in enumerate(zip(buckets, digests, strict=True))
                if not matches(view[b.offset : b.offset + b.nbytes], want)
            ),
            None,
        )

    bad = await anyio.to_thread.run_sync(first_bad)
    if bad is not None:
        raise DigestMismatchError(
            f"v{version}: bucket {buckets[bad].index} of the slice read from {source!r} does not match its "
            "digest from the layout's first copy of the trainer's slot"
        )
