"""Per-bucket digests (weightpull.digests): what a reader from a relay checks."""

from __future__ import annotations

import hashlib
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightpull import digests
from weightpull.digests import (
    BLAKE2B128,
    WSUM64,
    check_servable,
    digest,
    kind_of,
    matches,
    verify_bucket,
    wsum64_hex,
    wsum64_reference,
)
from weightpull.errors import DigestMismatchError, InvalidArgumentError
from weightpull.manifest import bucket_digest


def test_a_bare_digest_is_the_publishers_blake2b():
    data = os.urandom(1000)
    assert kind_of(bucket_digest(data)) == BLAKE2B128
    assert matches(data, bucket_digest(data))
    assert digest(data) == f"blake2b128:{hashlib.blake2b(data, digest_size=16).hexdigest()}"


def test_wsum64_is_two_sums_of_words_modulo_2_64():
    words = [2**64 - 1, 5, 7]
    data = b"".join(w.to_bytes(8, "little") for w in words)
    s1 = sum(words) % 2**64
    s2 = sum((i + 1) * w for i, w in enumerate(words)) % 2**64
    assert digest(data, WSUM64) == f"wsum64:{s1:016x}{s2:016x}"
    assert digest(data + b"\x01", WSUM64) != digest(data, WSUM64)  # a tail shorter than a word counts
    assert digest(b"", WSUM64) == "wsum64:" + "0" * 32


@given(st.binary(min_size=16, max_size=256), st.data())
def test_wsum64_catches_one_changed_byte_and_swapped_words(data, draw):
    i = draw.draw(st.integers(0, len(data) - 1))
    changed = bytearray(data)
    changed[i] ^= draw.draw(st.integers(1, 255))
    assert not matches(bytes(changed), digest(data, WSUM64))
    a, b = data[:8], data[8:16]
    if a != b:
        swapped = b + a + data[16:]
        assert not matches(swapped, digest(data, WSUM64))


def test_verify_bucket_names_the_version_bucket_and_source():
    good = os.urandom(64)
    verify_bucket(3, 1, good, digest(good, WSUM64), source="relay-7")
    with pytest.raises(DigestMismatchError, match=r"v3: bucket 1 read from 'relay-7' .*wsum64"):
        verify_bucket(3, 1, os.urandom(64), digest(good, WSUM64), source="relay-7")


def test_a_version_without_digests_cannot_be_relayed():
    with pytest.raises(InvalidArgumentError, match="v4 has no digests"):
        check_servable(4, None, 2)
    with pytest.raises(InvalidArgumentError, match="1 digests for 2 buckets"):
        check_servable(4, ["ab"], 2)
    with pytest.raises(InvalidArgumentError, match="unknown kind 'md5'"):
        check_servable(4, ["md5:00", "ab"], 2)
    check_servable(4, [digest(b"x"), digest(b"y", WSUM64)], 2)


def test_bad_kinds_are_refused():
    with pytest.raises(InvalidArgumentError, match="unknown digest kind"):
        digest(b"x", "crc32")
    with pytest.raises(InvalidArgumentError, match="non-empty string"):
        kind_of("")


def reference(data: bytes) -> str:
    return wsum64_hex(*wsum64_reference(data))


# Sizes around every edge of the fast path: empty, a part word, whole rows, whole blocks
# of rows, and tails of words and of bytes past them.
_ROW = 8 * digests._COLS
_BLOCK = _ROW * digests._BLOCK_ROWS
EDGES = [0, 1, 7, 8, 9, _ROW - 1, _ROW, _ROW + 3, _BLOCK - 8, _BLOCK, _BLOCK + 1, 2 * _BLOCK + _ROW + 13]


@pytest.mark.parametrize("nbytes", EDGES)
def test_fast_wsum64_equals_the_reference_at_the_edges(nbytes):
    data = os.urandom(nbytes)
    assert digests.numpy_or_none() is not None  # the test environment has numpy: the fast path is what runs
    assert digest(data, WSUM64) == reference(data)
    assert digest(memoryview(bytearray(data)), WSUM64) == reference(data)  # a slot's view, as published


@settings(deadline=None, max_examples=60)  # the reference takes a while over megabytes
@given(st.integers(0, 3 * _BLOCK + 2 * _ROW + 7), st.sampled_from([0x00, 0xFF, None]), st.randoms())
def test_fast_wsum64_equals_the_reference(nbytes, fill, rnd):
    """Random sizes, and words of all ones (every sum overflows many times)."""
    data = bytes([fill]) * nbytes if fill is not None else rnd.randbytes(nbytes)
    assert digest(data, WSUM64) == reference(data)


@given(st.binary(max_size=64), st.integers(0, 7))
def test_fast_wsum64_of_a_view_at_any_offset(data, skip):
    """A bucket's view need not start on a word of its slot."""
    view = memoryview(bytearray(b"\xaa" * skip + data))[skip:]
    assert digest(view, WSUM64) == reference(data)


def test_without_numpy_the_reference_computes_wsum64(monkeypatch):
    data = os.urandom(_ROW + 5)
    fast = digest(data, WSUM64)
    monkeypatch.setattr(digests, "_np", None)
    monkeypatch.setattr(digests, "_wsum64_numpy", None)  # never reached
    assert digest(data, WSUM64) == fast == reference(data)


# -- first_mismatch: a copy's spans checked on threads -------------------------------------


def _spans(sizes, gap=3):
    """(offset, bytes) of spans of `sizes` laid one after another, `gap` bytes apart (so
    that spans start off a word of the buffer)."""
    spans, at = [], gap
    for n in sizes:
        spans.append((at, n))
        at += n + gap
    return spans, at


def _in_turn(view, spans, recorded):
    return next(
        (i for i, ((o, n), d) in enumerate(zip(spans, recorded, strict=True)) if not matches(view[o : o + n], d)), None
    )


@pytest.fixture
def threaded(monkeypatch):
    """Pieces of 24 bytes and threads for any size: every path of the threaded check on small data."""
    monkeypatch.setattr(digests, "PIECE", 24)
    monkeypatch.setattr(digests, "_THREADED", 0)


@settings(deadline=None, max_examples=60)
@given(
    st.lists(st.integers(0, 200), min_size=1, max_size=8),
    st.lists(st.sampled_from([WSUM64, BLAKE2B128, "bare"]), min_size=8, max_size=8),
    st.integers(1, 4),
    st.lists(st.integers(0, 10_000), max_size=3),
    st.randoms(),
)
def test_first_mismatch_on_threads_is_the_check_in_turn_bit_for_bit(sizes, kinds, threads, flips, rnd):
    """Pieces' sums combine into each span's own digest exactly, whatever the span's size
    (part words included), kind and place; the first span that differs is the one a check
    in turn finds."""
    spans, end = _spans(sizes)
    data = bytearray(rnd.randbytes(end))
    view = memoryview(data)

    def recorded(o, n, kind):
        d = digest(view[o : o + n], BLAKE2B128 if kind == "bare" else kind)
        return d.partition(":")[2] if kind == "bare" else d

    want = [recorded(o, n, k) for (o, n), k in zip(spans, kinds, strict=False)]
    for at in flips:
        data[at % end] ^= 0x10
    with pytest.MonkeyPatch.context() as m:
        m.setattr(digests, "PIECE", 24)
        m.setattr(digests, "_THREADED", 0)
        got = digests.first_mismatch(view, spans, want, threads=threads)
    assert got == _in_turn(view, spans, want)


def test_first_mismatch_of_large_buckets_on_two_threads_equals_digest(threaded):
    spans, end = _spans([1000, 8 * 24 + 5, 0, 31])
    data = bytearray(os.urandom(end))
    view = memoryview(data)
    want = [digest(view[o : o + n], WSUM64) for o, n in spans]
    assert digests.first_mismatch(view, spans, want, threads=2) is None
    data[spans[1][0] + 8 * 24 + 2] ^= 1  # in the last, short piece of span 1
    data[spans[3][0]] ^= 1
    assert digests.first_mismatch(view, spans, want, threads=2) == 1
    data[spans[1][0] + 8 * 24 + 2] ^= 1
    assert digests.first_mismatch(view, spans, want, threads=2) == 3


def test_first_mismatch_raises_for_an_unknown_kind_in_turn(threaded):
    spans, end = _spans([64, 64, 64])
    view = memoryview(bytearray(os.urandom(end)))
    good = [digest(view[o : o + n], WSUM64) for o, n in spans]
    with pytest.raises(InvalidArgumentError, match="unknown kind 'md5'"):
        digests.first_mismatch(view, spans, [good[0], "md5:00", good[2]], threads=2)
    wrong = wsum64_hex(1, 2)  # a span that differs before the unknown kind: found first, as in turn
    assert digests.first_mismatch(view, spans, [wrong, "md5:00", good[2]], threads=2) == 0


@pytest.mark.parametrize("threads", [0, -1, 1.5, True, "2"])
def test_first_mismatch_refuses_bad_thread_counts(threads):
    with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
        digests.first_mismatch(memoryview(b""), [], [], threads=threads)


def test_first_mismatch_without_numpy_checks_in_turn(monkeypatch, threaded):
    spans, end = _spans([100, 100])
    view = memoryview(bytearray(os.urandom(end)))
    want = [digest(view[o : o + n], WSUM64) for o, n in spans]
    monkeypatch.setattr(digests, "_np", None)
    monkeypatch.setattr(digests, "_wsum64_numpy", None)  # never reached
    assert digests.first_mismatch(view, spans, want, threads=4) is None
    assert digests.first_mismatch(view, spans, [want[0], wsum64_hex(0, 0)], threads=4) == 1


def test_by_default_a_check_takes_a_thread_per_core():
    assert digests.check_threads() == (os.cpu_count() or 1)
