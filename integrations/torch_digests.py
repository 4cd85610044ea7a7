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
from weightpull.transport import Region

_COLS = 4096  # words per row: 32 KiB


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view where it is contiguous)."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def wsum64_sums(data: torch.Tensor) -> torch.Tensor:
    """(s1, s2) of `data`'s bytes, as an int64 tensor of two on its device, not yet
    synchronised: the bits of the uint64 sums (`& (2**64 - 1)` of each, once on the
    host). Several buckets' sums can be stacked and fetched at once."""
    raw = _bytes_of(data)
    device = raw.device
    sums = torch.zeros(2, dtype=torch.int64, device=device)
    nbytes = raw.numel()
    whole = nbytes // 8
    if whole:
        body = raw[: whole * 8]
        if body.storage_offset() % 8:  # an int64 view needs a word-aligned start: copy this bucket
            body = body.clone()
        words = body.view(torch.int64)
        rows = whole // _COLS
        if rows:
            matrix = words[: rows * _COLS].view(rows, _COLS)
            rowsum, colsum = matrix.sum(dim=1), matrix.sum(dim=0)
            row_weights = torch.arange(rows, dtype=torch.int64, device=device)
            col_weights = torch.arange(1, _COLS + 1, dtype=torch.int64, device=device)
            sums[0] += rowsum.sum()
            sums[1] += _COLS * (row_weights * rowsum).sum() + (col_weights * colsum).sum()
        tail = words[rows * _COLS :]  # fewer than _COLS words past the last row
        if tail.numel():
            weights = torch.arange(rows * _COLS + 1, whole + 1, dtype=torch.int64, device=device)
            sums[0] += tail.sum()
            sums[1] += (weights * tail).sum()
    if nbytes > whole * 8:  # a last word short of 8 bytes, zero-padded
        padded = torch.zeros(8, dtype=torch.uint8, device=device)
        padded[: nbytes - whole * 8] = raw[whole * 8 :]
        word = padded.view(torch.int64)
        sums[0] += word[0]
        sums[1] += (whole + 1) * word[0]
    return sums


def _hex(sums: Sequence[int]) -> str:
    s1, s2 = sums
    return wsum64_hex(s1, s2)  # wsum64_hex masks: a negative int64 is its uint64's bits


def wsum64(data: torch.Tensor) -> str:
    """The wsum64 digest of a tensor's bytes (``wsum64:<hex>``), on its own device."""
    return _hex(wsum64_sums(data).tolist())


def wsum64_digests(region: Region, spans: Sequence[tuple[int, int]]) -> list[str]:
    """The publisher's `Digester` for slots on a device: the wsum64 digest of each
    (offset, nbytes) span of `region`, computed where it lies, with one transfer of
    the results to the host. Blocks until they are computed (the publisher calls it in a
    worker thread, once the version's copies landed)."""
    if not spans:
        return []
    memory = region.memory
    raw = _bytes_of(memory) if isinstance(memory, torch.Tensor) else None
    if raw is None:  # a host slot held as a buffer
        raw = (
            torch.frombuffer(region.host_view(), dtype=torch.uint8)
            if region.nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
    sums = torch.stack([wsum64_sums(raw[offset : offset + nbytes]) for offset, nbytes in spans])
    return [_hex(pair) for pair in sums.tolist()]
