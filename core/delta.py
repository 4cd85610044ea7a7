"""Delta versions: a version's changes from an earlier one (its base), for replicas that
hold the base.

Across hosts a version's time is its bytes over the links. Between two RL steps at an RL
learning rate most bf16 elements do not change (1.4-3.0% of a small Qwen3's did at 1e-6,
docs/guides/bytes.md), and they change at random places: 60% of even 64-element blocks
held a change. So a delta lists changed *elements*, not blocks: ``sparse16``.

The publisher writes the whole version into its slot as ever and then, past it (at the
layout's `total_bytes`, in the slot's `room`), the delta section: the elements in which it
differs from the base's bytes, which the publisher still holds in another slot. The
manifest's `Delta` names the base and the encoding, and carries the section's digests;
the version's own digests cover its whole bytes as ever. A reader whose mirror holds the
base reads the section alone, checks it, patches its copy of the base and checks the
result against the version's digests; any other reader reads the whole version, which
the slot still holds.

The section (`sparse16`, the slot read as little-endian words of `word` bytes, each
64 Ki-word chunk counted apart so that an offset fits 16 bits)::

    counts   uint32 x chunks   words changed in each chunk of 65536 words
    offsets  uint16 x n        each changed word's offset in its chunk, chunk by chunk, ascending
    (zeros to a multiple of 8 bytes)
    values   word bytes x n    each changed word's new value

`encode` and `patch` use numpy where it is importable (the torch extra brings it), else
the pure-Python `encode_reference` and `patch_reference`, which are also the oracles
their tests hold them to.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from . import plugins, schema
from .digests import kind_of, numpy_or_none, thread_count, worth_threads
from .errors import DigestMismatchError, InvalidArgumentError
from .transport import Region

__all__ = [
    "SPARSE16",
    "Delta",
    "Encoder",
    "check_publishing",
    "encode",
    "patch",
    "pieces",
    "room_for",
    "section_layout",
    "word_of",
]

SPARSE16 = "sparse16"
ENCODINGS = (SPARSE16,)
CHUNK = 1 << 16  # words per chunk: an offset in one fits 16 bits
WORDS = (1, 2, 4, 8)  # word sizes, in bytes
GROUP = 256  # chunks encoded or patched as one (16 Mi words): its indices held at once, a thread's unit of work
_TORCH_ENCODER = plugins.Named(plugins.ENCODERS, "torch")  # an entry point: the core names no integration

# What writes a delta section where a publisher's slot lies (a GPU's): given the base's slot,
# the version's slot, the version's bytes, the word and the room past them, it writes the
# section there and returns (its bytes, the words changed), or None where it would not fit.
# Called in a worker thread. The torch integration's: `torch_delta.encode_region`.
Encoder = Callable[[Region, Region, int, int, int], "tuple[int, int] | None"]


def _strings(items: Iterable[str]) -> tuple[str, ...]:
    return tuple(items)


def _count(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise InvalidArgumentError(f"a delta's {name} must be a non-negative int, got {value!r}")


@attrs.frozen
class Delta(schema.Record):
    """How a version differs from an earlier one: the delta section past its whole bytes
    in the slot (at `Layout.total_bytes`), as its `Manifest` records it.

    Attributes:
        base: The version it is the changes from.
        nbytes: The section's size.
        room: The bytes past the whole version kept for a section in the slot (and in a
            reader's mirror, so that the next version's section fits beside its base).
        changed: The words that changed.
        digests: One a piece of the section (`pieces`), of the version's digest kind.
        encoding: How the section is laid out (`sparse16`).
        word: The bytes compared as one element (the layout's smallest dtype).

    Raises:
        InvalidArgumentError: An unknown encoding or word size, a section larger than its
            room, or a malformed count or digest.
    """

    base: int
    nbytes: int
    room: int
    changed: int
    digests: tuple[str, ...] = attrs.field(converter=_strings)
    encoding: str = SPARSE16
    word: int = 2

    def __attrs_post_init__(self) -> None:
        for name in ("base", "nbytes", "room", "changed"):
            _count(name, getattr(self, name))
        if self.encoding not in ENCODINGS:
            raise InvalidArgumentError(f"unknown delta encoding {self.encoding!r} (known: {', '.join(ENCODINGS)})")
        if self.word not in WORDS:
            raise InvalidArgumentError(f"a delta's word is 1, 2, 4 or 8 bytes, got {self.word!r}")
        if self.nbytes > self.room:
            raise InvalidArgumentError(f"a delta of {self.nbytes} bytes does not fit its room of {self.room}")
        for d in self.digests:
            kind_of(d)


def check_publishing(*, room: object, digests: object, device: str, stream: bool, encoder: object = None) -> list[str]:
    """The rules a publisher of deltas keeps, each broken one named with its fix."""
    problems = []
    if not isinstance(room, (int, float)) or isinstance(room, bool) or not 0 < room <= 1:
        problems.append(f"delta_room must be a share of the version in (0, 1], got {room!r}")
    if not digests:
        problems.append("a delta is checked by the version's digests: pass digests='wsum64' (or another kind)")
    if device != "cpu" and encoder is None:
        problems.append(
            f"a delta of slots on {device!r} is encoded where they lie: give encoder={_TORCH_ENCODER} "
            "(or publish deltas with device='cpu')"
        )
    if encoder is not None and not callable(encoder):
        problems.append(f"encoder must be a callable (an `Encoder`), got {encoder!r}")
    if stream:
        problems.append("a delta is encoded once the whole version landed: publish deltas with stream=False")
    return problems


def room_for(total: int, fraction: float, align: int) -> int:
    """The room kept past a version of `total` bytes for its delta section: `fraction` of
    it, rounded up to `align`."""
    return -(-int(total * fraction) // align) * align


def word_of(dtype_sizes: Iterable[int]) -> int:
    """The word a delta compares: the smallest element among the version's dtypes, so that
    a changed element is never split across two words nor costs more than one."""
    return min([8, *dtype_sizes])


def pieces(total: int, nbytes: int, bucket_bytes: int) -> list[tuple[int, int]]:
    """(offset in the slot, bytes) of each piece of a section of `nbytes` after a version
    of `total` bytes: each at most `bucket_bytes`, read and digested as one."""
    return [(total + start, min(bucket_bytes, nbytes - start)) for start in range(0, nbytes, bucket_bytes)]


def section_layout(words: int, changed: int, word: int) -> tuple[int, int, int]:
    """(offsets' start, values' start, size) of a section of `changed` words of `word` bytes."""
    chunks = -(-words // CHUNK)
    offsets = 4 * chunks
    values = -(-(offsets + 2 * changed) // 8) * 8
    return offsets, values, values + word * changed


def encode(
    old: memoryview, new: memoryview, word: int, into: memoryview, *, threads: int | None = None
) -> tuple[int, int] | None:
    """Write into `into` the section that turns `old`'s bytes into `new`'s (equal sizes, a
    multiple of `word`): (its bytes, the words changed), or None when it would not fit.

    The words are compared in groups of `GROUP` chunks on `threads` threads (None: one
    per core; numpy's compare and gathers release the GIL), and the section written in
    order as the groups finish.

    Raises:
        InvalidArgumentError: the copies differ in size or are not whole words, or
            `threads` is not a positive int or None.
    """
    threads = thread_count(threads)
    np = numpy_or_none()
    if np is None:
        return encode_reference(old, new, word, into)
    _check_sizes(old, new, word)
    dtype = np.dtype(f"<u{word}")
    a = np.frombuffer(old, dtype=dtype)
    b = np.frombuffer(new, dtype=dtype)
    words = len(a)
    chunks = -(-words // CHUNK)

    def changes(first: int) -> tuple[Any, Any, Any]:
        """A group's counts a chunk, offsets and new values (its indices, not the slot's, held)."""
        lo, hi = first * CHUNK, min((first + GROUP) * CHUNK, words)
        idx = np.flatnonzero(a[lo:hi] != b[lo:hi])
        counts = np.bincount(idx >> 16, minlength=-(-(hi - lo) // CHUNK)).astype("<u4")
        return counts, (idx & (CHUNK - 1)).astype("<u2"), b[lo:hi][idx]

    groups = range(0, chunks, GROUP)
    pool = None
    if len(groups) > 1 and worth_threads(len(old), threads):
        pool = ThreadPoolExecutor(max_workers=min(threads, len(groups)), thread_name_prefix="weightpull-encode")
    counts = np.zeros(chunks, dtype="<u4")
    found = []
    changed = 0
    try:
        for first, (c, o, v) in zip(groups, pool.map(changes, groups) if pool else map(changes, groups), strict=True):
            changed += len(o)
            if section_layout(words, changed, word)[2] > len(into):
                return None
            counts[first : first + len(c)] = c
            found.append((o, v))
    finally:
        if pool is not None:
            pool.shutdown(cancel_futures=True)  # a section that does not fit stops the rest
    offsets_at, values_at, size = section_layout(words, changed, word)
    out = np.frombuffer(into, dtype=np.uint8, count=size)
    out[:offsets_at] = counts.view(np.uint8)
    at = offsets_at
    for o, _ in found:
        out[at : at + o.nbytes] = o.view(np.uint8)
        at += o.nbytes
    out[at:values_at] = 0
    at = values_at
    for _, v in found:
        out[at : at + v.nbytes] = v.view(np.uint8)
        at += v.nbytes
    return size, changed


def patch(
    target: memoryview,
    section: memoryview,
    word: int,
    *,
    base: memoryview | None = None,
    threads: int | None = None,
) -> None:
    """Apply a section `encode` made to `target`, which holds the base's bytes (or, with
    `base`, is given them from it first): it then holds the version's.

    On `threads` threads (None: one per core), `base` is copied in a part a thread, then
    the slot patched in groups of `GROUP` chunks: numpy's copy, index arithmetic and
    scatter release the GIL, so the threads work at once. With one thread, a small
    target or no numpy, in turn.

    Raises:
        InvalidArgumentError: `target` is not whole words, `base` is not its size, or
            `threads` is not a positive int or None.
        DigestMismatchError: the section is malformed for a target of this size (its
            counts, offsets or size do not add up); `target` may then be partly patched.
    """
    threads = thread_count(threads)
    if base is not None and len(base) != len(target):
        raise InvalidArgumentError(f"a base of {len(base)} bytes for a target of {len(target)}: they must be one size")
    np = numpy_or_none()
    if np is None:
        if base is not None:
            target[:] = base
        patch_reference(target, section, word)
        return
    if len(target) % word:
        raise InvalidArgumentError(f"a delta patches whole words of {word} bytes, not {len(target)} bytes")
    words = len(target) // word
    chunks = -(-words // CHUNK)
    counts, offsets_at, values_at, changed = _counts(section, words, word, np)
    dtype = np.dtype(f"<u{word}")
    t = np.frombuffer(target, dtype=dtype)
    b = None if base is None else np.frombuffer(base, dtype=dtype)
    offsets = np.frombuffer(section, dtype="<u2", count=changed, offset=offsets_at)
    values = np.frombuffer(section, dtype=dtype, count=changed, offset=values_at)
    ends = np.concatenate(([0], np.cumsum(counts, dtype=np.int64)))

    def scatter(first: int) -> None:
        last = min(first + GROUP, chunks)
        lo, hi = int(ends[first]), int(ends[last])
        if hi == lo:
            return
        which = np.repeat(np.arange(first, last, dtype=np.int64), counts[first:last])
        idx = (which << 16) + offsets[lo:hi]
        if int(idx.max()) >= words:
            raise DigestMismatchError(f"a delta section names word {int(idx.max())} of a copy of {words} words")
        t[idx] = values[lo:hi]

    groups = range(0, chunks, GROUP)
    n = min(threads, len(groups)) if len(groups) > 1 and worth_threads(len(target), threads) else 1
    if n == 1:
        if b is not None:
            np.copyto(t, b)
        for first in groups:
            scatter(first)
        return
    edges = [words * i // n for i in range(n + 1)]

    def copy(i: int) -> None:
        assert b is not None
        np.copyto(t[edges[i] : edges[i + 1]], b[edges[i] : edges[i + 1]])

    with ThreadPoolExecutor(max_workers=n, thread_name_prefix="weightpull-patch") as pool:
        if b is not None:  # one large part a thread: a copy in 32 MiB pieces ran at half a whole one's rate
            list(pool.map(copy, range(n)))
        list(pool.map(scatter, groups))  # the first group's error, if any, raised here


def _counts(section: memoryview, words: int, word: int, np: Any) -> tuple[Any, int, int, int]:
    """The section's chunk counts, where its offsets and values start, and how many there are."""
    chunks = -(-words // CHUNK)
    if len(section) < 4 * chunks:
        raise DigestMismatchError(f"a delta section of {len(section)} bytes is too short for {chunks} chunk counts")
    counts = np.frombuffer(section, dtype="<u4", count=chunks)
    changed = int(counts.sum(dtype=np.int64))
    offsets_at, values_at, size = section_layout(words, changed, word)
    if size != len(section) or (counts > CHUNK).any():
        raise DigestMismatchError(
            f"a delta section of {len(section)} bytes does not add up: its counts say {changed} words, {size} bytes"
        )
    return counts, offsets_at, values_at, changed


def _check_sizes(old: Sequence[int] | memoryview, new: Sequence[int] | memoryview, word: int) -> None:
    if word not in WORDS:
        raise InvalidArgumentError(f"a delta's word is 1, 2, 4 or 8 bytes, got {word!r}")
    if len(old) != len(new) or len(new) % word:
        raise InvalidArgumentError(
            f"a delta compares two copies of one size, a multiple of {word} bytes: got {len(old)} and {len(new)}"
        )


# -- the pure-Python reference: slow, and the oracle ---------------------------------------------


def encode_reference(old: memoryview, new: memoryview, word: int, into: memoryview) -> tuple[int, int] | None:
    """`encode` in pure Python."""
    _check_sizes(old, new, word)
    a, b = bytes(old), bytes(new)
    words = len(a) // word
    changed_at = [i for i in range(words) if a[i * word : (i + 1) * word] != b[i * word : (i + 1) * word]]
    offsets_at, values_at, size = section_layout(words, len(changed_at), word)
    if size > len(into):
        return None
    counts = [0] * -(-words // CHUNK)
    for i in changed_at:
        counts[i >> 16] += 1
    out = bytearray(size)
    out[:offsets_at] = b"".join(c.to_bytes(4, "little") for c in counts)
    out[offsets_at : offsets_at + 2 * len(changed_at)] = b"".join(
        (i & (CHUNK - 1)).to_bytes(2, "little") for i in changed_at
    )
    out[values_at:] = b"".join(b[i * word : (i + 1) * word] for i in changed_at)
    into[:size] = out
    return size, len(changed_at)


def patch_reference(target: memoryview, section: memoryview, word: int) -> None:
    """`patch` in pure Python."""
    if len(target) % word:
        raise InvalidArgumentError(f"a delta patches whole words of {word} bytes, not {len(target)} bytes")
    words = len(target) // word
    chunks = -(-words // CHUNK)
    raw = bytes(section)
    if len(raw) < 4 * chunks:
        raise DigestMismatchError(f"a delta section of {len(raw)} bytes is too short for {chunks} chunk counts")
    counts = [int.from_bytes(raw[4 * c : 4 * c + 4], "little") for c in range(chunks)]
    offsets_at, values_at, size = section_layout(words, sum(counts), word)
    if size != len(raw) or any(c > CHUNK for c in counts):
        raise DigestMismatchError(
            f"a delta section of {len(raw)} bytes does not add up: its counts say {sum(counts)} words, {size} bytes"
        )
    n = 0
    for chunk, count in enumerate(counts):
        for _ in range(count):
            offset = int.from_bytes(raw[offsets_at + 2 * n : offsets_at + 2 * n + 2], "little")
            i = (chunk << 16) + offset
            if i >= words:
                raise DigestMismatchError(f"a delta section names word {i} of a copy of {words} words")
            target[i * word : (i + 1) * word] = raw[values_at + word * n : values_at + word * (n + 1)]
            n += 1
