"""`fingerprints` on the CPU (the torch path; tests/gpu/test_apply_fingerprints.py holds
the Triton kernel to the same values): a one-bit change shows anywhere, in words of any
width, across chunk boundaries (a small chunk here, for speed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightpull.integrations import torch_tensors
from weightpull.integrations.torch_tensors import fingerprints

PERIOD = 65521
DTYPES = [torch.uint8, torch.int8, torch.bfloat16, torch.float16, torch.float32, torch.int32, torch.float64]


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(torch_tensors, "_CHUNK", PERIOD)  # a chunk must start at a multiple of the period


def _flip(t: torch.Tensor, bit: int) -> torch.Tensor:
    raw = t.clone().view(-1).view(torch.uint8)
    raw[bit // 8] ^= 1 << (bit % 8)
    return raw.view(t.dtype).view(t.shape)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    dtype=st.sampled_from(DTYPES),
    elements=st.integers(1, 3 * PERIOD + 7),
    seed=st.integers(0, 2**31),
    where=st.floats(0, 1, exclude_max=True),
)
def test_a_one_bit_change_shows_where_the_size_is_not_a_multiple_of_8(small_chunks, dtype, elements, seed, where):
    # Words of 4, 2 or 1 bytes: a flipped bit changes the sum by 2**b (b < 32) times an odd
    # weight: never a multiple of 2**64.
    t = torch.randint(-100, 100, (elements,), generator=torch.Generator().manual_seed(seed)).to(dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes % 8 == 0:
        t = t[:-1] if elements > 1 else torch.ones(1, dtype=torch.uint8)
        nbytes = t.numel() * t.element_size()
    if nbytes % 8 == 0:
        return
    bit = int(where * nbytes * 8)
    assert fingerprints({"a": t})["a"] != fingerprints({"a": _flip(t, bit)})["a"]


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    words=st.integers(1, 3 * PERIOD + 7),
    seed=st.integers(0, 2**31),
    index=st.floats(0, 1, exclude_max=True),
    bit=st.integers(0, 63),
)
def test_a_one_bit_change_of_an_8_byte_word_shows(small_chunks, words, seed, index, bit):
    # Any bit, the top ones included: 2**b times an odd weight is never a multiple of 2**64.
    t = torch.randint(-(2**62), 2**62, (words,), generator=torch.Generator().manual_seed(seed))
    flipped = int(index * words) * 64 + bit
    assert fingerprints({"a": t})["a"] != fingerprints({"a": _flip(t, flipped)})["a"]


@pytest.mark.parametrize("word", [1, 4, 65520, 65521, 65522])  # weights 3, 9, 131041, 1 (the period's wrap), 3
def test_a_flipped_sign_bit_of_an_8_byte_word_shows(word):
    # The case a weight with factors of 2 lost (the sign of every 4th bf16 of an odd word).
    t = torch.zeros(4 * (word + 1), dtype=torch.bfloat16)
    assert fingerprints({"a": t})["a"] != fingerprints({"a": _flip(t, word * 64 + 63)})["a"]


def test_small_chunks_give_the_same_values(monkeypatch):
    t = torch.randint(-(2**62), 2**62, (3 * PERIOD + 5,), generator=torch.Generator().manual_seed(3))
    whole = fingerprints({"a": t})
    monkeypatch.setattr(torch_tensors, "_CHUNK", PERIOD)
    assert fingerprints({"a": t}) == whole


def test_fingerprint_tensors_gives_the_same_values_on_the_device_in_order():
    from weightpull.integrations.torch_tensors import fingerprint_tensors

    ts = [torch.randn(33, 5), torch.ones(3, dtype=torch.uint8), torch.empty(0), torch.arange(7, dtype=torch.int16)]
    on_device = fingerprint_tensors(ts)
    assert on_device.dtype == torch.int64 and on_device.shape == (4,)
    assert on_device.tolist() == list(fingerprints({str(i): t for i, t in enumerate(ts)}).values())
    assert fingerprint_tensors([]).shape == (0,)


def test_a_view_that_starts_mid_word_has_the_fingerprint_of_its_bytes():
    # Found on the H200: 4096 bytes from offset 3 of a uint8 buffer are 8-byte words that
    # torch cannot view in place.
    base = torch.randint(0, 256, (4099,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    view = base[3:]
    assert view.storage_offset() == 3
    assert fingerprints({"a": view})["a"] == fingerprints({"a": view.clone()})["a"]
    assert fingerprints({"a": view})["a"] != fingerprints({"a": base[2:4098]})["a"]
