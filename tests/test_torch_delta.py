"""The torch patcher (weightpull.integrations.torch_delta) on CPU tensors, against the
pure-Python oracle: every word size, groups of chunks, a base held apart, and a malformed
section refused before any word is written. tests/gpu/test_gpu_deltas.py runs it on a GPU."""

from __future__ import annotations

import pytest
import torch

from weightpull import delta as deltas
from weightpull.errors import DigestMismatchError, InvalidArgumentError
from weightpull.integrations import torch_delta
from weightpull.integrations.torch_delta import encode_region, patch, patch_region
from weightpull.transport import Region

from .test_delta import pair


def section(old: bytes, new: bytes, word: int) -> bytes:
    into = bytearray(len(new) + 4096)
    size, _ = deltas.encode_reference(memoryview(old), memoryview(new), word, memoryview(into))
    return bytes(into[:size])


def tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


@pytest.mark.parametrize("group", [torch_delta.SCATTER, 1, 1500])
@pytest.mark.parametrize("word", deltas.WORDS)
def test_patch_is_the_reference_for_every_word_and_group(monkeypatch, word, group):
    monkeypatch.setattr(torch_delta, "SCATTER", group)  # a group a chunk or two, or all at once
    old, new = pair(5 * deltas.CHUNK * word // 2 + 8 * 3, word, 0.01, word)  # chunks 0-2 (the last short)
    sec = section(old, new, word)
    target = tensor(old)
    patch(target, tensor(sec), word)
    assert bytes(target.numpy()) == new
    apart = tensor(bytes(len(old)))  # a base held apart, copied in first
    patch(apart, tensor(sec), word, base=tensor(old))
    assert bytes(apart.numpy()) == new


def test_no_change_and_an_empty_copy():
    old = bytes(range(256)) * 8
    target = tensor(old)
    patch(target, tensor(section(old, old, 2)), 2)
    assert bytes(target.numpy()) == old
    empty = torch.empty(0, dtype=torch.uint8)
    patch(empty, torch.empty(0, dtype=torch.uint8), 2)


def malformed(sec: bytes, words: int, word: int) -> dict[str, bytes]:
    """A good section broken each way a patch must refuse before it writes."""
    chunks = -(-words // deltas.CHUNK)
    counts = memoryview(sec[: 4 * chunks]).cast("I")
    assert counts[-1]  # the short last chunk holds a change, so an offset there can pass the end
    offsets_at = deltas.section_layout(words, sum(counts), word)[0]
    last = offsets_at + 2 * (sum(counts) - 1)  # the last change's offset, in the last chunk
    return {
        "cut short": sec[:-1],
        "too short for its counts": sec[: 4 * chunks - 1],
        "a count past a chunk": (1 << 31).to_bytes(4, "little") + sec[4:],
        "an offset past the end": sec[:last] + (0xFFFF).to_bytes(2, "little") + sec[last + 2 :],
    }


@pytest.mark.parametrize(
    "case", ["cut short", "too short for its counts", "a count past a chunk", "an offset past the end"]
)
def test_a_malformed_section_is_a_mismatch_and_writes_nothing(case):
    word = 2
    old, new = pair(3 * deltas.CHUNK * word // 2 + 6, word, 0.02, 7)
    sec = malformed(section(old, new, word), len(old) // word, word)[case]
    target, base = tensor(bytes(len(old))), tensor(old)
    with pytest.raises(DigestMismatchError, match="delta section"):
        patch(target, tensor(sec), word, base=base)
    assert not target.any()  # not even given the base


def test_bad_arguments_are_named():
    t = torch.zeros(8, dtype=torch.uint8)
    with pytest.raises(InvalidArgumentError, match="word is 1, 2, 4 or 8"):
        patch(t, t, 3)
    with pytest.raises(InvalidArgumentError, match="whole words of 8 bytes, not 6"):
        patch(t[:6], t, 8)
    with pytest.raises(InvalidArgumentError, match="a base of 4 bytes for a target of 8"):
        patch(t, t, 2, base=t[:4])
    with pytest.raises(InvalidArgumentError, match="section must be a flat uint8 tensor"):
        patch(t, t.view(torch.int16), 2)


def test_patch_region_patches_a_tensor_or_a_host_buffer_from_the_section_past_it():
    word = 2
    old, new = pair(deltas.CHUNK * word + 10, word, 0.03, 3)
    sec = section(old, new, word)
    memory = tensor(old + sec + bytes(5))  # the version, its section, room to spare
    region = Region(nbytes=memory.numel(), device="cpu", memory=memory)
    patch_region(region, len(old), len(sec), word)
    assert bytes(memory[: len(old)].numpy()) == new
    buffer = bytearray(len(old)) + bytearray(sec)  # a host buffer, the base in another region
    host = Region(nbytes=len(buffer), device="cpu", memory=buffer, view=memoryview(buffer))
    base = Region(nbytes=len(old), device="cpu", memory=tensor(old))
    patch_region(host, len(old), len(sec), word, base)
    assert bytes(buffer[: len(old)]) == new
    with pytest.raises(InvalidArgumentError, match="lie outside"):
        patch_region(region, len(old), len(sec) + 100, word)
    with pytest.raises(InvalidArgumentError, match="holds no version"):
        patch_region(
            host, len(old), len(sec), word, Region(nbytes=4, device="cpu", memory=torch.zeros(4, dtype=torch.uint8))
        )


@pytest.mark.parametrize("step", [torch_delta._ENCODE_CHUNKS, 1])
@pytest.mark.parametrize("word", deltas.WORDS)
def test_encode_is_the_reference_for_every_word_and_group(monkeypatch, word, step):
    monkeypatch.setattr(torch_delta, "_ENCODE_CHUNKS", step)  # a chunk a group: three groups here
    old, new = pair(5 * deltas.CHUNK * word // 2 + 8 * 3, word, 0.01, word)
    oracle = bytearray(len(new))
    size, changed = deltas.encode_reference(memoryview(old), memoryview(new), word, memoryview(oracle))
    into = torch.full((size + 7,), 0xEE, dtype=torch.uint8)
    assert torch_delta.encode(tensor(old), tensor(new), word, into) == (size, changed)
    assert bytes(into[:size].numpy()) == oracle[:size] and not (into[size:] != 0xEE).any()  # nothing past it
    short = torch.full((size - 1,), 0xEE, dtype=torch.uint8)
    assert torch_delta.encode(tensor(old), tensor(new), word, short) is None and not (short != 0xEE).any()


def test_encode_region_writes_the_section_past_the_version_in_an_unaligned_slot():
    word = 2
    old, new = pair(deltas.CHUNK * word + 10, word, 0.03, 5)
    want = section(old, new, word)
    slot = torch.zeros(3 + len(new) + len(want) + 4, dtype=torch.uint8)[3:]  # starts at an odd byte
    slot[: len(new)] = tensor(new)
    base = Region(nbytes=len(old), device="cpu", memory=tensor(old))
    region = Region(nbytes=slot.numel(), device="cpu", memory=slot)
    assert encode_region(base, region, len(new), word, len(want) + 4)[0] == len(want)
    assert bytes(slot[len(new) : len(new) + len(want)].numpy()) == want
    assert encode_region(base, region, len(new), word, len(want) - 1) is None  # over the room
    target = torch.zeros(1 + len(old), dtype=torch.uint8)[1:]  # a patch of an unaligned copy too
    target[:] = tensor(old)
    patch(target, slot[len(new) : len(new) + len(want)], word)
    assert bytes(target.numpy()) == new
    with pytest.raises(InvalidArgumentError, match="one size"):
        torch_delta.encode(tensor(old), tensor(new[:-2]), word, slot)
    with pytest.raises(InvalidArgumentError, match="lie outside"):
        encode_region(base, region, len(new), word, slot.numel())
