"""Digest checks of a reader's copy: each bucket of a mirror (or a borrowed slot)
against the digests its publisher recorded, on the host's bytes (any kind) or, where
they are wsum64, by a `Digester` where the mirror lies (a GPU's too).
"""

from __future__ import annotations

from collections.abc import Sequence

import anyio

from .digests import WSUM64, first_mismatch, kind_of, thread_count
from .errors import DigestMismatchError, InvalidArgumentError
from .manifest import Manifest
from .settings import Digester, digester_hint
from .transport import Region

__all__ = ["DigestChecker"]


class DigestChecker:
    """Checks copies against their publisher's digests.

    Args:
        device: Where the copies lie: "cpu", or a GPU ("cuda:0").
        digester: Checks wsum64 digests where a GPU copy lies; None: only on the host.
        threads: Threads a check of host bytes sums on (`digests.first_mismatch`); None:
            one per core (`os.cpu_count()`). Settable on a puller's `checker`.
    """

    def __init__(self, device: str, digester: Digester | None, threads: int | None = None) -> None:
        if threads is not None:
            thread_count(threads)  # a positive int: None (one per core) is kept as None
        self.device, self.digester, self.threads = device, digester, threads

    def checkable(self, manifest: Manifest, *, must: bool) -> bool:
        """Whether the version's digests can be checked where the mirror lies: any kind
        on a host mirror, wsum64 with `digester` on a device. One it must check (`must`:
        read from relays, or insisted on) but cannot is refused, naming the fix.

        Raises:
            InvalidArgumentError: `must`, and the digests cannot be checked here.
        """
        digests = manifest.digests
        if digests is None or self.device == "cpu":
            return True
        kinds = sorted({kind_of(d) for d in digests})
        if self.digester is not None and kinds == [WSUM64]:
            return True
        if must:
            why = "" if self.digester is not None else f", with digester={digester_hint()}"
            raise InvalidArgumentError(
                f"v{manifest.version} records {'/'.join(kinds)} digests, which a mirror on {self.device!r} cannot "
                f"check (only wsum64{why}): publish with digests='wsum64' to read it into a GPU mirror from relays "
                "(or with verify_digests=True), or keep this mirror on the host (device='cpu')"
            )
        return False

    def relayed(self, manifest: Manifest, source: str) -> None:
        """A copy read from relay `source` must come with a digest per bucket, checkable here.

        Raises:
            DigestMismatchError: no digests, or not one per bucket.
            InvalidArgumentError: they cannot be checked where the mirror lies.
        """
        if manifest.digests is None:  # a registry refuses offers without them; a copy without is no copy
            raise DigestMismatchError(f"v{manifest.version} came from relay {source!r} with no digests to check")
        if len(manifest.digests) != len(manifest.layout.buckets):
            raise DigestMismatchError(
                f"v{manifest.version} came from relay {source!r} with {len(manifest.digests)} digests for "
                f"{len(manifest.layout.buckets)} buckets"
            )
        self.checkable(manifest, must=True)

    async def first_mismatch(
        self, region: Region, spans: Sequence[tuple[int, int]], digests: Sequence[str]
    ) -> int | None:
        """The position of the first (offset, nbytes) span of `region` whose bytes do not
        match its digest, if one does not: by `digester` where they are all wsum64 (where
        the region lies, a GPU's too), else over the host's bytes, any kind, on `threads`
        threads. Spans past the digests go unchecked (a version recorded without)."""
        digester = self.digester if digests and all(kind_of(d) == WSUM64 for d in digests) else None

        def check() -> int | None:
            if digester is not None:
                got = list(digester(region, list(spans)))
                if len(got) != len(spans):
                    raise InvalidArgumentError(f"the digester gave {len(got)} digests for {len(spans)} spans")
                return next((i for i, (want, have) in enumerate(zip(digests, got, strict=False)) if have != want), None)
            n = min(len(spans), len(digests))
            return first_mismatch(region.host_view(), list(spans[:n]), digests[:n], threads=self.threads)

        return await anyio.to_thread.run_sync(check)

    async def verify(self, manifest: Manifest, mirror: Region, source: str = "") -> None:
        """Every bucket of the copy in `mirror` against the publisher's digests: by
        `digester` where they are wsum64 (where the mirror lies, a GPU's too), else over
        the host's bytes, any kind.

        Raises:
            DigestMismatchError: naming the first bucket that differs, and `source`, the
                relay it was read from (if any).
        """
        buckets, digests = manifest.layout.buckets, manifest.digests or ()  # no digests: nothing to check
        bad = await self.first_mismatch(mirror, [(b.offset, b.nbytes) for b in buckets], digests)
        if bad is None:
            return
        index, kind = buckets[bad].index, kind_of(digests[bad])
        if source:
            raise DigestMismatchError(
                f"v{manifest.version}: bucket {index} read from {source!r} does not match the publisher's {kind} digest"
            )
        raise DigestMismatchError(f"v{manifest.version}: bucket {index} does not match its digest")
