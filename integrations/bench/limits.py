"""The machine's own limits, measured in the same run: plain copies with no protocol.

The pull bench times them at its own size; the model bench on a sample of up to 1 GiB
(pinning the whole 16 GB set would cost ~8 s), scaled to the set's bytes. GB/s are 10^9
bytes copied per second. torch is imported only for the GPU copies and the cast.
"""

from __future__ import annotations

import ctypes
import mmap
import time
from collections.abc import Callable
from typing import Any

from .util import gbps

SAMPLE_BYTES = 1 << 30
RATES = ("memcpy_gbps", "h2d_gbps", "d2h_gbps", "d2d_gbps")  # the machine's copies, as measured
_KINDS = {"cpu": "pinned host", "cuda": "GPU"}


def timed(fn: Callable[[], float], repeat: int) -> list[float]:
    """`repeat` runs of `fn`, which returns its own seconds, after one to warm up (page
    faults, first touch, CUDA's lazy start)."""
    fn()
    return [fn() for _ in range(repeat)]


def _address(view: memoryview) -> int:
    return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view))


class Memcpy:
    """A plain in-process memcpy of `src` into a buffer of our own (`read()`: its seconds)."""

    def __init__(self, src: memoryview) -> None:
        self.src, self.dst = src, mmap.mmap(-1, len(src))
        self.dst_view = memoryview(self.dst)

    def read(self) -> float:
        start = time.perf_counter()
        ctypes.memmove(_address(self.dst_view), _address(self.src), len(self.src))
        return time.perf_counter() - start

    def close(self) -> None:
        self.dst_view.release()


def memcpy_seconds(nbytes: int, repeat: int) -> list[float]:
    src = memoryview(mmap.mmap(-1, nbytes))
    ctypes.memset(_address(src), 1, nbytes)  # untouched pages all map one zero page: too fast
    memcpy = Memcpy(src)
    try:
        return timed(memcpy.read, repeat)
    finally:
        memcpy.close()


def cuda_copy_seconds(dst: Any, src: Any) -> float:
    """One `dst.copy_(src)`, timed with CUDA events."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def device_copy_seconds(nbytes: int, src: str, dst: str, repeat: int) -> tuple[str, list[float]]:
    """The machine's own copy between two kinds of memory, "cpu" (pinned) or "cuda": its
    name and timings."""
    import torch

    def empty(where: str) -> Any:
        return torch.empty(
            nbytes, dtype=torch.uint8, device="cuda" if where == "cuda" else "cpu", pin_memory=where != "cuda"
        )

    a, b = empty(src), empty(dst)
    return f"{_KINDS[src]}->{_KINDS[dst]} copy", timed(lambda: cuda_copy_seconds(b, a), repeat)


def _cast_seconds(nbytes: int, device: str, repeat: int) -> float:
    """One fp32 -> bf16 cast of `nbytes // 2` elements: what a trainer's snapshot must do."""
    import torch

    src = torch.full((nbytes // 2,), 0.1, dtype=torch.float32, device=device)  # values do not change its speed
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(repeat + 1):
        if device == "cpu":
            started = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - started)
        else:
            best = min(best, cuda_copy_seconds(dst, src))
    return best


def together_seconds(copies: list[tuple[Any, Any]], repeat: int) -> float:
    """The best time for every `dst.copy_(src)` of `copies` to finish, each queued on a
    CUDA stream of its own so that they run at once: what two copies that share a link
    or memory (PCIe both ways, or HBM) take together."""
    import torch

    streams = [torch.cuda.Stream() for _ in copies]
    best = float("inf")
    for _ in range(repeat + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for stream, (dst, src) in zip(streams, copies, strict=True):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return best


def overlapped(sample: int, repeat: int) -> dict[str, float]:
    """Per `sample` bf16 bytes: seconds for the trainer's copy into a slot and a reader's
    copy out of it when they run at once. A host slot: GPU->host and host->GPU at once
    (PCIe is full duplex, though each way slows). A GPU slot: the trainer's fp32->bf16 cast
    and a GPU->GPU copy at once (both bound by the one GPU's memory)."""
    import torch

    def pinned() -> Any:
        return torch.empty(sample, dtype=torch.uint8, pin_memory=True)

    def gpu(n: int = sample, dtype: Any = torch.uint8) -> Any:
        return torch.empty(n, dtype=dtype, device="cuda")

    host_slot = together_seconds([(pinned(), gpu()), (gpu(), pinned())], repeat)
    fp32 = torch.full((sample // 2,), 0.1, dtype=torch.float32, device="cuda")
    gpu_slot = together_seconds([(gpu(sample // 2, torch.bfloat16), fp32), (gpu(), gpu())], repeat)
    torch.cuda.empty_cache()
    return {"host_slot_s": host_slot, "gpu_slot_s": gpu_slot}


def measure(nbytes: int, device: str, repeat: int = 3) -> dict[str, Any]:
    """Copy rates on this machine, and what they allow for a set of `nbytes` bf16 bytes."""
    import torch

    sample = min(nbytes, SAMPLE_BYTES)

    def best(seconds: list[float]) -> float:
        return gbps(sample, seconds, 2, min)

    out: dict[str, Any] = {"sample_bytes": sample, "memcpy_gbps": best(memcpy_seconds(sample, repeat))}
    if device != "cpu":
        for key, src, dst in (("h2d_gbps", "cpu", "cuda"), ("d2h_gbps", "cuda", "cpu"), ("d2d_gbps", "cuda", "cuda")):
            out[key] = best(device_copy_seconds(sample, src, dst, repeat)[1])
        torch.cuda.empty_cache()
    cast_gbps = sample / _cast_seconds(sample, device, repeat) / 1e9  # bf16 bytes written per second
    copy_gbps = out.get("d2d_gbps", out["memcpy_gbps"])
    out["cast_ms"] = round(nbytes / cast_gbps / 1e6, 2)  # the snapshot: fp32 -> bf16, every tensor at once
    out["apply_copy_ms"] = round(nbytes / copy_gbps / 1e6, 2)  # the apply: one copy of every byte
    if device != "cpu":  # the slot copy and the pull at once, as a streamed version runs them
        both = overlapped(sample, repeat)
        out["both_ways_gbps"] = round(sample / both["host_slot_s"] / 1e9, 2)  # each way, PCIe both ways at once
        out["overlap_host_slot_ms"] = round(nbytes / sample * both["host_slot_s"] * 1e3, 2)
        out["overlap_gpu_slot_ms"] = round(nbytes / sample * both["gpu_slot_s"] * 1e3, 2)
    if device != "cpu":
        torch.cuda.empty_cache()
    return out


def for_path(limits: dict[str, Any], nbytes: int, slot: str, mirror: str) -> dict[str, Any]:
    """The limits of one path: trainer's snapshot, slot copy, pull, apply, all back to back."""
    if mirror == "cpu":
        slot_gbps, pull_gbps, pull = limits["memcpy_gbps"], limits["memcpy_gbps"], "in-process memcpy"
    elif slot == "cpu":
        slot_gbps, pull_gbps, pull = limits["d2h_gbps"], limits["h2d_gbps"], "pinned host->GPU copy"
    else:
        slot_gbps, pull_gbps, pull = limits["d2d_gbps"], limits["d2d_gbps"], "GPU->GPU copy"
    ms = {
        "publish_block_ms": limits["cast_ms"],
        "slot_copy_ms": round(nbytes / slot_gbps / 1e6, 2),
        "pull_ms": round(nbytes / pull_gbps / 1e6, 2),
        "apply_pause_ms": limits["apply_copy_ms"],
    }
    serial = round(sum(ms.values()), 2)
    # Streamed, the trainer casts straight into the slot while the reader copies out of it,
    # so the two copies overlap (at the rate they reach together), then the apply.
    if mirror == "cpu":
        overlap = None  # one CPU's memory bandwidth: the stream's gain is its ratio to the serial sum
    else:
        key = "overlap_host_slot_ms" if slot == "cpu" else "overlap_gpu_slot_ms"
        overlap = round(limits[key] + ms["apply_pause_ms"], 2)
    # In place, the trainer casts straight into the slot and the apply copies straight out
    # of it behind the cast: two copies that share one memory's bandwidth, so no quicker
    # than back to back.
    in_place = round(limits["cast_ms"] + ms["apply_pause_ms"], 2)
    return {
        "pull_gbps": pull_gbps,
        "pull": pull,
        **ms,
        "publish_to_serving_ms": serial,
        "overlapped_ms": overlap,
        "in_place_ms": in_place,
    }
