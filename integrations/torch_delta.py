"""Delta sections (`weightpull.delta`'s sparse16) encoded and patched with torch where the
bytes lie: a publisher's slot on a GPU is compared with its base there, and a GPU mirror
patched on its GPU, neither copied to the host. The same bytes as `weightpull.delta`'s
`encode` and `patch`, whose pure-Python oracles its tests hold them to.

The encode counts each chunk's changed words first (no indices held), so a section that
would not fit its room is known before any is written, and then writes each group of
chunks' offsets and values at their place, each group's indices found with their count
known (`nonzero_static`: no transfer to the host a group).

The section is checked for sense before any word is written (its counts add up to its
size, no offset past the copy), with a few small transfers to the host: a scatter to a word
past the end would be a device-side fault, which kills the CUDA context, not an error.
The changed words are scattered in as few launches as the memory allows: in groups of whole
chunks of at most about `SCATTER` words each, so that the indices held at once stay small
(32 Mi words: 256 MiB) whatever the model's size. Groups of a fixed count of chunks, as the
host's threads take them, cost a launch per 16 Mi words of the copy: 0.1 of a copy's rate
on the H200, most of it launches.
"""

from __future__ import annotations

import torch

from weightpull.delta import CHUNK, section_layout
from weightpull.errors import DigestMismatchError, InvalidArgumentError
from weightpull.transport import Region

from .torch_digests import region_bytes

__all__ = ["encode", "encode_region", "patch", "patch_region"]

SCATTER = 1 << 25  # changed words scattered at once, about (a chunk more at most)
_ENCODE_CHUNKS = 1024  # chunks compared at once (64 Mi words): the indices of their changes held
_WORDS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}  # bits copied: signs do not matter


def _as(raw: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A flat uint8 tensor's bytes as `dtype` words (a copy where its start is not aligned)."""
    size = torch.empty((), dtype=dtype).element_size()
    if raw.storage_offset() % size:
        raw = raw.clone()
    return raw.view(dtype)


def _check_flat(device: torch.device, **tensors: torch.Tensor | None) -> None:
    for name, t in tensors.items():
        if t is not None and (t.dtype != torch.uint8 or t.dim() != 1 or t.device != device):
            raise InvalidArgumentError(
                f"a delta's {name} must be a flat uint8 tensor on {device}, got {t.dtype} {tuple(t.shape)} on {t.device}"
            )


def encode(old: torch.Tensor, new: torch.Tensor, word: int, into: torch.Tensor) -> tuple[int, int] | None:
    """Write into `into` the section that turns `old`'s bytes into `new`'s (flat uint8
    tensors of one size, a multiple of `word`, on one device): (its bytes, the words
    changed), or None when it would not fit `into` (nothing then written).

    Raises:
        InvalidArgumentError: an unknown word size, copies of other sizes or not whole
            words, or tensors that are not flat uint8 on one device.
    """
    if word not in _WORDS:
        raise InvalidArgumentError(f"a delta's word is 1, 2, 4 or 8 bytes, got {word!r}")
    _check_flat(new.device, old=old, new=new, into=into)
    if old.numel() != new.numel() or new.numel() % word:
        raise InvalidArgumentError(
            f"a delta compares two copies of one size, a multiple of {word} bytes: got {old.numel()} and {new.numel()}"
        )
    dtype = _WORDS[word]
    a, b = _as(old, dtype), _as(new, dtype)
    words = b.numel()
    chunks = -(-words // CHUNK)
    whole = words // CHUNK * CHUNK
    counts = torch.zeros(chunks, dtype=torch.int64, device=new.device)
    step = _ENCODE_CHUNKS * CHUNK
    for lo in range(0, whole, step):  # each chunk's count, a group at a time: no index held
        hi = min(lo + step, whole)
        counts[lo // CHUNK : hi // CHUNK] = (a[lo:hi] != b[lo:hi]).view(-1, CHUNK).sum(dim=1)
    if whole < words:
        counts[-1] = (a[whole:] != b[whole:]).sum()
    ends = torch.cumsum(counts, 0)
    # one transfer: where each group's changes end (the last: all of them)
    stops = torch.cat([ends[_ENCODE_CHUNKS - 1 :: _ENCODE_CHUNKS], ends[-1:]]).tolist() if chunks else [0]
    changed = stops[-1]
    offsets_at, values_at, size = section_layout(words, changed, word)
    if size > into.numel():
        return None
    # written as bytes (little-endian, as the host's), wherever `into` starts
    into[:offsets_at].copy_(counts.to(torch.int32).view(torch.uint8))
    into[offsets_at + 2 * changed : values_at].zero_()
    at = 0
    for first, stop in zip(range(0, chunks, _ENCODE_CHUNKS), stops, strict=False):
        if stop == at:
            continue
        lo, hi = first * CHUNK, min((first + _ENCODE_CHUNKS) * CHUNK, words)
        # its changes' count known: found with no transfer to the host
        index = torch.nonzero_static(a[lo:hi] != b[lo:hi], size=stop - at).squeeze(1)
        offsets = (index & (CHUNK - 1)).to(torch.int16).view(torch.uint8)
        into[offsets_at + 2 * at : offsets_at + 2 * stop].copy_(offsets)
        into[values_at + word * at : values_at + word * stop].copy_(b[lo:hi][index].view(torch.uint8))
        at = stop
    return size, changed


def encode_region(old: Region, new: Region, total: int, word: int, room: int) -> tuple[int, int] | None:
    """The torch `Encoder`: write past `new`'s first `total` bytes, in its next `room`, the
    section that turns `old`'s first `total` bytes into `new`'s, where they lie (a GPU's
    slots on that GPU): (its bytes, the words changed), or None when it would not fit.
    Blocks until it is written (the publisher calls it in a worker thread)."""
    a, b = region_bytes(old), region_bytes(new)
    if total < 0 or room < 0 or total + room > b.numel() or total > a.numel():
        raise InvalidArgumentError(f"a version of {total} bytes and a room of {room} lie outside the slots")
    found = encode(a[:total].to(b.device), b[:total], word, b[total : total + room])
    if b.is_cuda:
        torch.cuda.current_stream(b.device).synchronize()
    return found


def patch(target: torch.Tensor, section: torch.Tensor, word: int, *, base: torch.Tensor | None = None) -> None:
    """Apply a section `weightpull.delta.encode` made to `target`, a flat uint8 tensor that
    holds the base's bytes (or, with `base`, is given them from it first): it then holds
    the version's. `section` is a flat uint8 tensor on `target`'s device.

    Raises:
        InvalidArgumentError: an unknown word size, `target` is not whole words, `base` is
            not its size, or the tensors are not flat uint8 on one device.
        DigestMismatchError: the section is malformed for a target of this size; `target`
            is then untouched (and not given `base`).
    """
    if word not in _WORDS:
        raise InvalidArgumentError(f"a delta's word is 1, 2, 4 or 8 bytes, got {word!r}")
    _check_flat(target.device, target=target, section=section, base=base)
    if target.numel() % word:
        raise InvalidArgumentError(f"a delta patches whole words of {word} bytes, not {target.numel()} bytes")
    if base is not None and base.numel() != target.numel():
        raise InvalidArgumentError(
            f"a base of {base.numel()} bytes for a target of {target.numel()}: they must be one size"
        )
    words = target.numel() // word
    chunks = -(-words // CHUNK)
    if section.numel() < 4 * chunks:
        raise DigestMismatchError(f"a delta section of {section.numel()} bytes is too short for {chunks} chunk counts")
    counts = _as(section[: 4 * chunks], torch.int32).to(torch.int64)  # a count past 2**31 reads negative: malformed
    ends = torch.cumsum(counts, 0)
    bad = ((counts < 0) | (counts > CHUNK)).sum()
    # one transfer: the words in all, the bad counts, the last chunk's count
    total, bad, last = torch.stack([ends[-1], bad, counts[-1]]).tolist() if chunks else (0, 0, 0)
    offsets_at, values_at, size = section_layout(words, total, word)
    if bad or size != section.numel():
        raise DigestMismatchError(
            f"a delta section of {section.numel()} bytes does not add up: its counts say {total} words, {size} bytes"
        )
    offsets = _as(section[offsets_at : offsets_at + 2 * total], torch.int16)
    values = _as(section[values_at:size], _WORDS[word])
    tail = words - (chunks - 1) * CHUNK  # words in the last chunk
    if last and tail < CHUNK:  # only there can an offset pass the end
        top = int((offsets[total - last :].to(torch.int32) & 0xFFFF).max())
        if top >= tail:
            raise DigestMismatchError(
                f"a delta section names word {(chunks - 1) * CHUNK + top} of a copy of {words} words"
            )
    # the groups: cut at the first chunk past each multiple of SCATTER changed words
    cuts = [0, chunks]
    if total > SCATTER:
        at = torch.arange(SCATTER, total, SCATTER, device=target.device)
        cuts = [0, *torch.searchsorted(ends, at, right=True).tolist(), chunks]
    if base is not None:
        target.copy_(base)
    t = _as(target, _WORDS[word])  # a copy where `target` starts between words: written back below
    starts = torch.cat([torch.zeros(1, dtype=torch.int64, device=target.device), ends])
    lows = starts[cuts].tolist() if len(cuts) > 2 else [0, total]  # each group's first changed word
    for first, stop, lo, hi in zip(cuts, cuts[1:], lows, lows[1:], strict=False):
        if hi == lo:
            continue
        which = torch.repeat_interleave(
            torch.arange(first, stop, device=target.device), counts[first:stop], output_size=hi - lo
        )
        index = (which << 16) + (offsets[lo:hi].to(torch.int64) & 0xFFFF)
        t.index_copy_(0, index, values[lo:hi])
    if t.data_ptr() != target.data_ptr():
        target.copy_(t.view(torch.uint8))


def patch_region(region: Region, total: int, nbytes: int, word: int, base: Region | None = None) -> None:
    """The torch `Patcher`: patch `region`'s first `total` bytes from the delta section of
    `nbytes` past them, where it lies (a GPU's memory on that GPU), from `base`'s first
    `total` bytes if given (else the region holds the base). Blocks until it is done
    (the puller calls it in a worker thread).

    Raises:
        InvalidArgumentError: the spans lie outside the regions.
        DigestMismatchError: the section is malformed (the region's bytes untouched).
    """
    raw = region_bytes(region)
    if total < 0 or nbytes < 0 or total + nbytes > raw.numel():
        raise InvalidArgumentError(
            f"a version of {total} bytes and a section of {nbytes} lie outside {raw.numel()} bytes"
        )
    held = None
    if base is not None:
        held = region_bytes(base)
        if held.numel() < total:
            raise InvalidArgumentError(f"a base of {held.numel()} bytes holds no version of {total}")
        held = held[:total]
        if held.device != raw.device:
            held = held.to(raw.device)
    patch(raw[:total], raw[total : total + nbytes], word, base=held)
    if raw.is_cuda:
        torch.cuda.current_stream(raw.device).synchronize()
