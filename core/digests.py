"""Per-bucket digests, and what a reader that reads from a relay checks with them.

A lease vouches for the bytes of a publisher's slot: the slot is never written while a
lease on it lives. A relay's mirror is vouched for by nothing but its holder (a bug in
it, a prefetch into the wrong buffer, a hostile replica), so a reader that reads from a
relay checks every bucket against the digest the *publisher* computed, before it keeps
the bucket, forwards it as a relay itself, or applies the copy.

A digest is a string that names its kind: ``"<kind>:<hex>"``; a bare hex string is
BLAKE2b-128, as `Publisher(digests=True)` records them. Two kinds:

- ``blake2b128``: cryptographic. A relay cannot make other bytes match. Computed on the
  CPU (hashlib releases the GIL); the kind host slots and host mirrors use.
- ``wsum64``: two sums over the bucket's little-endian 64-bit words (zero-padded),
  ``s1 = sum(w[i])`` and ``s2 = sum((i + 1) * w[i])``, both modulo 2**64. Exact: integer
  addition modulo 2**64 is associative, so a GPU's reduction in any order gives the same
  bits (a float sum would not). Cheap: one multiply and two reductions at memory speed
  (int64 tensors wrap on overflow), so the publisher computes it where the weights are.
  It catches any change to one word, swapped words and a bucket of another version, but
  not bytes made on purpose to match: it is not a MAC. Use it between replicas of one job
  that trust each other's code; across a trust boundary use ``blake2b128``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from .errors import DigestMismatchError, InvalidArgumentError

BLAKE2B128 = "blake2b128"
WSUM64 = "wsum64"
KINDS = (BLAKE2B128, WSUM64)
_MASK = (1 << 64) - 1


def _wsum64(data: memoryview | bytes) -> str:
    raw = bytes(data)
    raw += b"\0" * (-len(raw) % 8)
    words = memoryview(raw).cast("Q") if raw else memoryview(b"").cast("Q")
    s1 = sum(words) & _MASK
    s2 = sum((i + 1) * w for i, w in enumerate(words)) & _MASK
    return f"{s1:016x}{s2:016x}"


def digest(data: memoryview | bytes, kind: str = BLAKE2B128) -> str:
    """The digest of one bucket's bytes, as the publisher records it (``kind:hex``).
    This is the reference; a GPU adapter computes ``wsum64`` with tensor ops."""
    if kind == BLAKE2B128:
        return f"{BLAKE2B128}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"
    if kind == WSUM64:
        return f"{WSUM64}:{_wsum64(data)}"
    raise InvalidArgumentError(f"unknown digest kind {kind!r} (known: {', '.join(KINDS)})")


def kind_of(recorded: str) -> str:
    """The kind a recorded digest names (a bare hex string is BLAKE2b-128)."""
    if not isinstance(recorded, str) or not recorded:
        raise InvalidArgumentError(f"a digest is a non-empty string, got {recorded!r}")
    kind, sep, _ = recorded.partition(":")
    if not sep:
        return BLAKE2B128
    if kind not in KINDS:
        raise InvalidArgumentError(f"digest {recorded!r} names an unknown kind {kind!r} (known: {', '.join(KINDS)})")
    return kind


def matches(data: memoryview | bytes, recorded: str) -> bool:
    kind = kind_of(recorded)
    want = recorded if ":" in recorded else f"{BLAKE2B128}:{recorded}"
    return digest(data, kind) == want


def check_servable(version: int, digests: Sequence[str] | None, buckets: int) -> None:
    """A relay may offer a version only when the publisher recorded a digest for every
    bucket: its readers could check nothing otherwise."""
    if digests is None:
        raise InvalidArgumentError(
            f"v{version} has no digests, so no relay may serve it: publish with digests to let replicas relay"
        )
    if len(digests) != buckets:
        raise InvalidArgumentError(f"v{version}: {len(digests)} digests for {buckets} buckets")
    for d in digests:
        kind_of(d)


def verify_bucket(version: int, index: int, data: memoryview | bytes, recorded: str, *, source: str) -> None:
    """Check one bucket read from `source` against the publisher's digest.

    Raises `DigestMismatchError` naming the version, bucket and source. The reader then
    drops its whole copy (never keeping a mix of sources) and asks for another source,
    excluding this one.
    """
    if not matches(data, recorded):
        raise DigestMismatchError(
            f"v{version}: bucket {index} read from {source!r} does not match the publisher's {kind_of(recorded)} digest"
        )
