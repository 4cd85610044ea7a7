"""wsum64 digests (weightpull.digests) with torch tensor ops, on whatever device the bytes
lie: a publisher's slot on a GPU gets its digests computed there, at memory speed,
without a copy to the host. The same bits as `weightpull.digests.digest(data, "wsum64")`.

torch has no uint64 reductions on every device, so the sums run in int64: its adds and
multiplies wrap on overflow, two's complement, which are the bits of the uint64 sums.
As the host's, the words are viewed as rows of `_COLS`, so that

    s2 = sum over (r, c) of (r*_COLS + c + 1) * w[r, c]
       = _COLS * sum_r r * rowsum[r] + sum_c (c + 1) * colsum[c]

takes two reductions and no temporary larger than a row or a column of sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from weightpull.digests import wsum64_hex
from weightpull.errors import InvalidArgumentError
from weightpull.transport import Region

_COLS = 4096  # words per row: 32 KiB


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view where it is contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def _concat(parts: list[tuple[int, torch.Tensor]], device: torch.device) -> tuple[torch.Tensor, ...]:
    """Parts of buckets' sums, (bucket, 1-D tensor) each, as one tensor: (the values, the
    bucket of each, the index of each within its part, the part each came from)."""
    values = torch.cat([v for _, v in parts])
    counts = torch.tensor([v.numel() for _, v in parts], device=device)
    total = values.numel()
    part = torch.repeat_interleave(torch.arange(len(parts), device=device), counts, output_size=total)
    starts = torch.cumsum(counts, 0) - counts
    local = torch.arange(total, device=device) - starts[part]
    buckets = torch.tensor([b for b, _ in parts], device=device)
    return values, buckets[part], local, part


def _wsum64(raw: torch.Tensor, spans: Sequence[tuple[int, int]]) -> list[str]:
    """The wsum64 digests of `spans` of a flat uint8 tensor, on its device. Each bucket
    costs two reductions of its words (its row and column sums); what makes each bucket's
    two sums of those, and of the words and bytes past its last row, runs once for all
    buckets, with one transfer to the host: a launch per small step and bucket would cost
    more than the reductions themselves."""
    device = raw.device
    rows: list[tuple[int, torch.Tensor]] = []  # (bucket, its row sums)
    cols: list[tuple[int, torch.Tensor]] = []  # (bucket, its column sums)
    tails: list[tuple[int, torch.Tensor]] = []  # (bucket, its words past its last row)
    ends: list[tuple[int, torch.Tensor]] = []  # (bucket, its bytes past its last word)
    tail_first: list[int] = []  # the index (1-based) of each tail's first word in its bucket
    end_weight: list[int] = []  # the index (1-based) of each zero-padded last word
    for b, (offset, nbytes) in enumerate(spans):
        if offset < 0 or nbytes < 0 or offset + nbytes > raw.numel():
            raise InvalidArgumentError(f"span ({offset}, {nbytes}) lies outside {raw.numel()} bytes")
        data = raw[offset : offset + nbytes]
        whole = nbytes // 8
        full = whole // _COLS * _COLS
        if whole:
            body = data[: whole * 8]
            if body.storage_offset() % 8:  # an int64 view needs a word-aligned start: copy this bucket
                body = body.clone()
            words = body.view(torch.int64)
            if full:
                matrix = words[:full].view(-1, _COLS)
                rows.append((b, matrix.sum(dim=1)))
                cols.append((b, matrix.sum(dim=0)))
            if whole > full:
                tails.append((b, words[full:]))
                tail_first.append(full + 1)
        if nbytes > whole * 8:
            ends.append((b, data[whole * 8 :]))
            end_weight.append(whole + 1)
    s1 = torch.zeros(len(spans), dtype=torch.int64, device=device)
    s2 = torch.zeros_like(s1)
    if rows:  # row r's words weigh r*_COLS + c + 1: r*_COLS here, c + 1 by the column sums
        values, buckets, local, _ = _concat(rows, device)
        s1.index_add_(0, buckets, values)
        s2.index_add_(0, buckets, _COLS * local * values)
        col_weights = torch.arange(1, _COLS + 1, dtype=torch.int64, device=device)
        col_buckets = torch.tensor([b for b, _ in cols], device=device)
        s2.index_add_(0, col_buckets, (torch.stack([v for _, v in cols]) * col_weights).sum(dim=1))
    if tails:
        values, buckets, local, part = _concat(tails, device)
        s1.index_add_(0, buckets, values)
        s2.index_add_(0, buckets, (torch.tensor(tail_first, device=device)[part] + local) * values)
    if ends:  # a last word short of 8 bytes, zero-padded: byte k is worth 256**k of it
        values, buckets, local, part = _concat(ends, device)
        word_parts = values.to(torch.int64) << (8 * local)
        s1.index_add_(0, buckets, word_parts)
        s2.index_add_(0, buckets, torch.tensor(end_weight, device=device)[part] * word_parts)
    return [wsum64_hex(a, b) for a, b in torch.stack([s1, s2], dim=1).tolist()]  # wsum64_hex masks


def wsum64(data: torch.Tensor) -> str:
    """The wsum64 digest of a tensor's bytes (``wsum64:<hex>``), on its own device."""
    raw = _bytes_of(data)
    return _wsum64(raw, [(0, raw.numel())])[0]


def region_bytes(region: Region) -> torch.Tensor:
    """A region's bytes as a flat uint8 tensor where they lie: its tensor's, or a host
    buffer's (a slot held as a buffer) without a copy."""
    memory = region.memory
    if isinstance(memory, torch.Tensor):
        return _bytes_of(memory)
    if not region.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(region.host_view(), dtype=torch.uint8)


def wsum64_digests(region: Region, spans: Sequence[tuple[int, int]]) -> list[str]:
    """The publisher's `Digester` for slots on a device: the wsum64 digest of each
    (offset, nbytes) span of `region`, computed where it lies. Blocks until they are
    computed (the publisher calls it in a worker thread, once the version's copies
    landed)."""
    if not spans:
        return []
    return _wsum64(region_bytes(region), spans)
