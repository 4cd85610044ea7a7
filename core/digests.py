"""Per-bucket digests, and what a reader that reads from a relay checks with them.

A lease vouches for the bytes of a publisher's slot: the slot is never written while a
lease on it lives. A relay's mirror is vouched for by nothing but its holder (a bug in
it, a prefetch into the wrong buffer, a hostile replica), so a reader that reads from a
relay checks every bucket against the digest the *publisher* computed, before it keeps
the bucket, forwards it as a relay itself, or applies the copy.

A digest is a string that names its kind: ``"<kind>:<hex>"``; a bare hex string is
BLAKE2b-128, as `Publisher(digests=True)` records them. Two kinds:

- ``blake2b128``: cryptographic. A relay cannot make other bytes match. Computed on the
  CPU (hashlib releases the GIL), about 1 GB/s a core: host slots only.
- ``wsum64``: two sums over the bucket's little-endian 64-bit words (zero-padded),
  ``s1 = sum(w[i])`` and ``s2 = sum((i + 1) * w[i])``, both modulo 2**64. Exact: integer
  addition modulo 2**64 is associative, so a GPU's reduction in any order gives the same
  bits (a float sum would not). Cheap: one multiply and two reductions at memory speed
  (int64 tensors wrap on overflow), so the publisher computes it where the weights are.
  It catches any change to one word, swapped words and a bucket of another version, but
  not bytes made on purpose to match: it is not a MAC. Use it between replicas of one job
  that trust each other's code; across a trust boundary use ``blake2b128``.

`digest` computes either over host bytes: wsum64 with numpy where it is importable (the
torch extra brings it), else with the pure-Python `wsum64_reference`, which is also the
oracle its tests hold it to. `weightpull.integrations.torch_digests` computes wsum64 with
tensor ops on any device, for slots on a GPU.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .errors import DigestMismatchError, InvalidArgumentError

_NOT_YET = object()
# numpy, imported when a wsum64 digest first needs it (importing weightpull loads no
# numpy); None where it is not installed: the base install sums in pure Python.
_np: Any = _NOT_YET


def numpy_or_none() -> Any:
    """numpy, imported on first use, or None where it is not installed (the core needs it
    only for speed)."""
    global _np
    if _np is _NOT_YET:
        try:
            import numpy
        except ImportError:
            _np = None
        else:
            _np = numpy
    return _np


BLAKE2B128 = "blake2b128"
WSUM64 = "wsum64"
KINDS = (BLAKE2B128, WSUM64)
_MASK = (1 << 64) - 1


def wsum64_reference(data: memoryview | bytes) -> tuple[int, int]:
    """(s1, s2) of `data`, the pure-Python reference: slow, and the oracle."""
    raw = bytes(data)
    raw += b"\0" * (-len(raw) % 8)
    words = memoryview(raw).cast("Q") if raw else memoryview(b"").cast("Q")
    s1 = sum(words) & _MASK
    s2 = sum((i + 1) * w for i, w in enumerate(words)) & _MASK
    return s1, s2


# The words as rows of _COLS: s2 = sum over (r, c) of (r*_COLS + c + 1) * w[r, c]
#   = _COLS * sum_r r * rowsum[r] + sum_c (c + 1) * colsum[c],
# so two reductions per block and no temporary the size of the bucket. A block of
# _BLOCK_ROWS rows (1 MiB) is read by both while it is still in the cache.
_COLS = 512
_BLOCK_ROWS = 256
_weights: tuple[Any, Any] | None = None  # numpy's 0.._BLOCK_ROWS-1 and 1.._COLS, made once


def _wsum64_numpy(data: memoryview | bytes) -> tuple[int, int]:
    global _weights
    np = numpy_or_none()
    assert np is not None
    if _weights is None:
        _weights = (np.arange(_BLOCK_ROWS, dtype=np.uint64), np.arange(1, _COLS + 1, dtype=np.uint64))
    row_weights, col_weights = _weights
    raw = memoryview(data).cast("B")
    whole = raw.nbytes // 8
    words = np.frombuffer(raw, dtype="<u8", count=whole)
    rows = whole // _COLS
    matrix = words[: rows * _COLS].reshape(rows, _COLS)
    s1 = s2 = 0  # Python ints: exact, masked at the end
    for start in range(0, rows, _BLOCK_ROWS):
        block = matrix[start : start + _BLOCK_ROWS]
        rowsum = block.sum(axis=1, dtype=np.uint64)  # numpy's uint64 arithmetic wraps modulo 2**64
        colsum = block.sum(axis=0, dtype=np.uint64)
        total = int(rowsum.sum(dtype=np.uint64))
        s1 += total
        weighted = int((row_weights[: len(rowsum)] * rowsum).sum(dtype=np.uint64))
        s2 += _COLS * (start * total + weighted) + int((col_weights * colsum).sum(dtype=np.uint64))
    tail = words[rows * _COLS :]  # fewer than _COLS words past the last row
    if len(tail):
        tail_sum = int(tail.sum(dtype=np.uint64))
        s1 += tail_sum
        s2 += rows * _COLS * tail_sum + int((col_weights[: len(tail)] * tail).sum(dtype=np.uint64))
    if raw.nbytes > whole * 8:  # a last word short of 8 bytes, zero-padded
        w = int.from_bytes(raw[whole * 8 :], "little")
        s1 += w
        s2 += (whole + 1) * w
    return s1 & _MASK, s2 & _MASK


def wsum64_hex(s1: int, s2: int) -> str:
    """A wsum64 digest from its two sums, as recorded."""
    return f"{WSUM64}:{s1 & _MASK:016x}{s2 & _MASK:016x}"


def digest(data: memoryview | bytes, kind: str = BLAKE2B128) -> str:
    """The digest of one bucket's host bytes, as the publisher records it (``kind:hex``).
    For a bucket on a GPU, `weightpull.integrations.torch_digests` gives the same wsum64."""
    if kind == BLAKE2B128:
        return f"{BLAKE2B128}:{hashlib.blake2b(data, digest_size=16).hexdigest()}"
    if kind == WSUM64:
        return wsum64_hex(*(wsum64_reference(data) if numpy_or_none() is None else _wsum64_numpy(data)))
    raise InvalidArgumentError(f"unknown digest kind {kind!r} (known: {', '.join(KINDS)})")


# `first_mismatch`: a wsum64 span is summed in pieces of this many bytes (a multiple of 8), so
# that a few large buckets still spread over every thread; spans are checked on threads only
# when they hold at least _THREADED bytes together (below it, starting threads costs more).
PIECE = 64 << 20
_THREADED = 32 << 20


def check_threads() -> int:
    """The threads `first_mismatch` checks on by default: one per core (`os.cpu_count()`)."""
    return os.cpu_count() or 1


def thread_count(threads: object) -> int:
    """`threads` checked (a positive int), or `check_threads()` for None.

    Raises:
        InvalidArgumentError: it is neither a positive int nor None.
    """
    if threads is None:
        return check_threads()
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise InvalidArgumentError(f"threads must be a positive int or None, got {threads!r}")
    return threads


def worth_threads(nbytes: int, threads: int) -> bool:
    """Whether work over `nbytes` on `threads` threads is worth starting them (numpy there)."""
    return threads > 1 and nbytes >= _THREADED and numpy_or_none() is not None


def _wsum64_parts(offset: int, nbytes: int) -> list[tuple[int, int]]:
    """(byte offset, bytes) of the pieces of a wsum64 span: each starts on a word."""
    return [(offset + at, min(PIECE, nbytes - at)) for at in range(0, nbytes, PIECE)] or [(offset, 0)]


def first_mismatch(
    view: memoryview, spans: Sequence[tuple[int, int]], recorded: Sequence[str], *, threads: int | None = None
) -> int | None:
    """The position of the first span (offset, bytes) of `view` whose bytes do not match its
    recorded digest, or None when all do: as checking each in turn with `matches`, on
    `threads` threads (None: `check_threads()`, one per core). numpy's reductions and
    hashlib release the GIL, so the threads sum at once; a wsum64 span is summed in pieces
    of `PIECE` bytes, and its sums combined exactly (s2 of a piece that starts at word k
    adds k times its s1), so every digest is the one `digest` gives, bit for bit. Without
    numpy (the pure-Python sums hold the GIL), with one thread, or for a few bytes, the
    spans are checked in turn on the caller's thread.

    Raises:
        InvalidArgumentError: `threads` is not a positive int or None; a recorded digest
            names an unknown kind (as `matches`, at the first span that does).
    """
    threads = thread_count(threads)
    if len(spans) != len(recorded):
        raise InvalidArgumentError(f"{len(recorded)} digests for {len(spans)} spans")
    total = sum(n for _, n in spans)
    if not worth_threads(total, threads):
        return next(
            (i for i, ((o, n), d) in enumerate(zip(spans, recorded, strict=True)) if not matches(view[o : o + n], d)),
            None,
        )
    kinds: list[str | InvalidArgumentError] = []
    for d in recorded:
        try:
            kinds.append(kind_of(d))
        except InvalidArgumentError as exc:  # raised in turn below, as a check in turn would
            kinds.append(exc)
    jobs: list[tuple[int, str, int, int]] = []  # (span, kind, offset, bytes): a span, or a piece of a wsum64 one
    for i, ((offset, nbytes), kind) in enumerate(zip(spans, kinds, strict=True)):
        if kind == WSUM64:
            jobs += [(i, kind, o, n) for o, n in _wsum64_parts(offset, nbytes)]
        elif isinstance(kind, str):
            jobs.append((i, kind, offset, nbytes))

    def run(job: tuple[int, str, int, int]) -> Any:
        _, kind, o, n = job
        return _wsum64_numpy(view[o : o + n]) if kind == WSUM64 else digest(view[o : o + n], kind)

    with ThreadPoolExecutor(max_workers=min(threads, len(jobs)) or 1, thread_name_prefix="weightpull-check") as pool:
        results = list(pool.map(run, jobs))
    got: dict[int, Any] = {}
    for (i, kind, o, _), result in zip(jobs, results, strict=True):
        if kind != WSUM64:
            got[i] = result
            continue
        s1, s2 = result
        k = (o - spans[i][0]) // 8  # the piece's first word in its span
        t1, t2 = got.get(i, (0, 0))
        got[i] = ((t1 + s1) & _MASK, (t2 + s2 + k * s1) & _MASK)
    for i, (kind, d) in enumerate(zip(kinds, recorded, strict=True)):
        if isinstance(kind, InvalidArgumentError):
            raise kind
        have = wsum64_hex(*got[i]) if kind == WSUM64 else got[i]
        if have != (d if ":" in d else f"{BLAKE2B128}:{d}"):
            return i
    return None


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
