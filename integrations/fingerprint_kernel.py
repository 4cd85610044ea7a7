"""The fingerprint of `torch_tensors.fingerprints` in one pass over a CUDA tensor's bytes:
Triton kernels (imported only where a CUDA tensor is fingerprinted and Triton is there).

The value is the same function of the bytes as the torch path's: the sum of the words
(the widest of 8, 4, 2 or 1 bytes the size allows; 4- and 2-byte words sign-extended,
bytes zero-extended) each times 2 * (its index mod 65521) + 1, modulo 2**64. Each
program sums a span of words in int64 (Triton's int64 multiply and add wrap, as
torch's do), and torch sums the programs' partials, so the result is exact and the same
whatever the order.

`fingerprint` takes one tensor; `fingerprint_many` a whole set in one launch per word
width (a model's 399 tensors: a launch each would cost more host time than the GPU's
pass over 16 GB), each program finding its tensor in a table of addresses."""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

PERIOD = 65521
BLOCK = 2048  # words a program loads at once (16 KiB of 8-byte words); at most PERIOD
SPAN = BLOCK * 16  # words a program sums
WARPS = 8
FEW = 4  # sets of at most this many tensors take `fingerprint`, one launch each
SET_KERNEL_FAILED: list[str] = []  # why the set kernel was given up in this process, if it was


@triton.jit
def _block_sum(words, first, n, offs, MASKED: tl.constexpr, PERIOD: tl.constexpr):
    """Words [first, first + BLOCK) each times its weight, 2 * (index mod PERIOD) + 1, without
    a 64-bit division per word: the block's first index mod PERIOD, then a wrap at most
    once (BLOCK <= PERIOD)."""
    base = (first % PERIOD).to(tl.int32)
    s = base + offs
    weight = 2 * tl.where(s >= PERIOD, s - PERIOD, s) + 1
    idx = first + offs
    if MASKED:
        x = tl.load(words + idx, mask=idx < n, other=0).to(tl.int64)
    else:  # no mask: the loads can be vectorized
        x = tl.load(words + idx).to(tl.int64)
    return x * weight.to(tl.int64)


@triton.jit
def _span_sum(words, start, n, SPAN: tl.constexpr, BLOCK: tl.constexpr, PERIOD: tl.constexpr):
    """The weighted sum of words [start, start + SPAN) below `n` (`start` a multiple of SPAN)."""
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.int64)
    if start + SPAN <= n:
        for k in range(0, SPAN, BLOCK):
            acc += _block_sum(words, start + k, n, offs, False, PERIOD)
    else:  # a tensor's last span
        for k in range(0, SPAN, BLOCK):
            acc += _block_sum(words, start + k, n, offs, True, PERIOD)
    return tl.sum(acc, axis=0)


@triton.jit
def _partials(words_ptr, n, out_ptr, SPAN: tl.constexpr, BLOCK: tl.constexpr, PERIOD: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)  # int64 before any multiply: tensors past 2**31 words
    tl.store(out_ptr + pid, _span_sum(words_ptr, pid * SPAN, n, SPAN, BLOCK, PERIOD))


@triton.jit
def _many_partials(
    table_ptr,  # per tensor: its address, its words
    starts_ptr,  # per tensor: its first program; then the total
    tensors,
    out_ptr,
    WIDTH: tl.constexpr,
    STEPS: tl.constexpr,  # binary-search steps: ceil(log2(tensors)), at least 1
    SPAN: tl.constexpr,
    BLOCK: tl.constexpr,
    PERIOD: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0  # the last tensor whose first program is at most pid
    hi = lo + tensors - 1
    for _ in tl.static_range(STEPS):
        mid = (lo + hi + 1) // 2
        right = tl.load(starts_ptr + mid) <= pid
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid - 1)
    address = tl.load(table_ptr + 2 * lo)
    n = tl.load(table_ptr + 2 * lo + 1)
    if WIDTH == 8:
        words = address.to(tl.pointer_type(tl.int64))
    elif WIDTH == 4:
        words = address.to(tl.pointer_type(tl.int32))
    elif WIDTH == 2:
        words = address.to(tl.pointer_type(tl.int16))
    else:
        words = address.to(tl.pointer_type(tl.uint8))
    words = tl.multiple_of(words, 16)  # the host sends only 16-byte aligned tensors here
    start = (pid - tl.load(starts_ptr + lo)) * SPAN
    tl.store(out_ptr + pid, _span_sum(words, start, n, SPAN, BLOCK, PERIOD))


def fingerprint(words: torch.Tensor) -> torch.Tensor:
    """`words` (flat, contiguous, of int64, int32, int16 or uint8, on a CUDA device): its
    fingerprint as a 0-dim int64 tensor on that device (no host transfer)."""
    n = words.numel()
    programs = triton.cdiv(n, SPAN)
    partials = torch.empty(programs, dtype=torch.int64, device=words.device)
    with torch.cuda.device(words.device):
        _partials[(programs,)](words, n, partials, SPAN=SPAN, BLOCK=BLOCK, PERIOD=PERIOD, num_warps=WARPS)
    return partials.sum()


def fingerprint_many(words: Sequence[torch.Tensor]) -> torch.Tensor:
    """Each of `words` (as `fingerprint` takes them, all on one CUDA device): their
    fingerprints as an int64 tensor on that device, in order (no host transfer)."""
    device = words[0].device
    if len(words) == 1 and words[0].numel():
        return fingerprint(words[0]).reshape(1)
    if len(words) <= FEW:  # a layer's: the table would cost more launches than it saves
        return torch.stack(
            [fingerprint(w) if w.numel() else torch.zeros((), dtype=torch.int64, device=device) for w in words]
        )
    groups: dict[int, list[int]] = {}
    single = []
    for i, w in enumerate(words):
        if not w.numel():
            continue  # 0
        if w.data_ptr() % 16:  # the table kernel reads 16-byte aligned words only
            single.append(i)
        else:
            groups.setdefault(w.element_size(), []).append(i)
    if SET_KERNEL_FAILED:  # the set kernel does not build here: one launch per tensor
        single, groups = [i for i, w in enumerate(words) if w.numel()], {}
    with torch.cuda.device(device):
        try:
            if not single and len(groups) == 1 and len(next(iter(groups.values()))) == len(words):
                return _group(words, list(range(len(words))), next(iter(groups)), device)  # a model's, often
            out = torch.zeros(len(words), dtype=torch.int64, device=device)
            for width, members in groups.items():
                out[members] = _group(words, members, width, device)
        except triton.CompilationError as exc:  # then the single kernel, said so
            SET_KERNEL_FAILED.append(f"{type(exc).__name__}: {str(exc)[:200]}")
            warnings.warn(f"weightpull's set fingerprint kernel failed, one launch per tensor: {exc}", stacklevel=2)
            return fingerprint_many(words)
        for i in single:
            out[i] = fingerprint(words[i])
    return out


def _group(words: Sequence[torch.Tensor], members: list[int], width: int, device: torch.device) -> torch.Tensor:
    starts, table = [0], []
    for i in members:
        n = words[i].numel()
        table += [words[i].data_ptr(), n]
        starts.append(starts[-1] + triton.cdiv(n, SPAN))
    programs, count = starts[-1], len(members)
    # One upload: the table, the first programs, and each tensor's last program.
    host = torch.tensor(table + starts + [s - 1 for s in starts[1:]], dtype=torch.int64)
    sent = host.to(device)
    table_d, starts_d, last_d = sent[: 2 * count], sent[2 * count : 3 * count + 1], sent[3 * count + 1 :]
    partials = torch.empty(programs, dtype=torch.int64, device=device)
    _many_partials[(programs,)](
        table_d,
        starts_d,
        count,
        partials,
        WIDTH=width,
        STEPS=max(1, (count - 1).bit_length()),
        SPAN=SPAN,
        BLOCK=BLOCK,
        PERIOD=PERIOD,
        num_warps=WARPS,
    )
    # Each tensor's programs are consecutive: its sum is a difference of running sums
    # (int64, wrapping: exact modulo 2**64 like every sum here).
    ends = partials.cumsum(0)[last_d]
    return torch.diff(ends, prepend=ends.new_zeros(1))
