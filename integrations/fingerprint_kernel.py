"""The fingerprint of `torch_tensors.fingerprints` in one pass over a CUDA tensor's bytes:
a Triton kernel (imported only where a CUDA tensor is fingerprinted and Triton is there).

The value is the same function of the bytes as the torch path's: the sum of the words
(the widest of 8, 4, 2 or 1 bytes the size allows; 4- and 2-byte words sign-extended,
bytes zero-extended) each times (its index mod 65521, plus 1), modulo 2**64. Each
program sums a span of words in int64 (Triton's int64 multiply and add wrap, as
torch's do), and torch sums the programs' partials, so the result is exact and the same
whatever the order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PERIOD = 65521
BLOCK = 2048  # words a program loads at once (16 KiB of 8-byte words); at most PERIOD
SPAN = BLOCK * 16  # words a program sums


@triton.jit
def _partials(words_ptr, n, out_ptr, SPAN: tl.constexpr, BLOCK: tl.constexpr, PERIOD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 before any multiply: tensors past 2**31 words
    start = pid * SPAN
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    for k in range(0, SPAN, BLOCK):
        first = start + k
        # Each word's weight, (index mod PERIOD) + 1, without a 64-bit division per word:
        # the block's first index mod PERIOD, then a wrap at most once (BLOCK <= PERIOD).
        base = (first % PERIOD).to(tl.int32)
        s = base + offs
        weight = tl.where(s >= PERIOD, s - PERIOD, s) + 1
        idx = first + offs
        x = tl.load(words_ptr + idx, mask=idx < n, other=0).to(tl.int64)
        acc += x * weight.to(tl.int64)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def fingerprint(words: torch.Tensor) -> torch.Tensor:
    """`words` (flat, contiguous, of int64, int32, int16 or uint8, on a CUDA device): its
    fingerprint as a 0-dim int64 tensor on that device (no host transfer)."""
    n = words.numel()
    programs = triton.cdiv(n, SPAN)
    partials = torch.empty(programs, dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):
        _partials[(programs,)](words, n, partials, SPAN=SPAN, BLOCK=BLOCK, PERIOD=PERIOD, num_warps=8)
    return partials.sum()
