"""The machine's own limits, measured in the same run: plain copies with no protocol.

Rates are measured on a sample of up to 1 GiB (pinning the whole 16 GB set would cost ~8 s)
and scaled to the set's bytes. GB/s are 10^9 bytes copied per second, best of the rounds.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from weightpull.bench import BenchConfig, _device_copy_seconds, _memcpy_seconds

SAMPLE_BYTES = 1 << 30
RATES = ("memcpy_gbps", "h2d_gbps", "d2h_gbps", "d2d_gbps")  # the machine's copies, as measured


def _cast_seconds(nbytes: int, device: str, repeat: int) -> float:
    """One fp32 -> bf16 cast of `nbytes // 2` elements: what a trainer's snapshot must do."""
    src = torch.full((nbytes // 2,), 0.1, dtype=torch.float32, device=device)  # values do not change its speed
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    best = float("inf")
    for _ in range(repeat + 1):
        if device == "cpu":
            started = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - started)
        else:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            best = min(best, start.elapsed_time(end) / 1e3)
    return best


def measure(nbytes: int, device: str, repeat: int = 3) -> dict[str, Any]:
    """Copy rates on this machine, and what they allow for a set of `nbytes` bf16 bytes."""
    sample = min(nbytes, SAMPLE_BYTES)
    cfg = BenchConfig(size=sample, repeat=repeat)

    def gbps(seconds: list[float]) -> float:
        return round(sample / min(seconds) / 1e9, 2)

    out: dict[str, Any] = {"sample_bytes": sample, "memcpy_gbps": gbps(_memcpy_seconds(cfg))}
    if device != "cpu":
        for key, slot, mirror in (("h2d_gbps", "cpu", "cuda"), ("d2h_gbps", "cuda", "cpu"), ("d2d_gbps", "cuda", "cuda")):
            out[key] = gbps(_device_copy_seconds(BenchConfig(size=sample, repeat=repeat, slot=slot, mirror=mirror))[1])
        torch.cuda.empty_cache()
    cast_gbps = sample / _cast_seconds(sample, device, repeat) / 1e9  # bf16 bytes written per second
    copy_gbps = out.get("d2d_gbps", out["memcpy_gbps"])
    out["cast_ms"] = round(nbytes / cast_gbps / 1e6, 2)  # the snapshot: fp32 -> bf16, every tensor at once
    out["apply_copy_ms"] = round(nbytes / copy_gbps / 1e6, 2)  # the apply: one copy of every byte
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
    ms = {"publish_block_ms": limits["cast_ms"], "slot_copy_ms": round(nbytes / slot_gbps / 1e6, 2),
          "pull_ms": round(nbytes / pull_gbps / 1e6, 2), "apply_pause_ms": limits["apply_copy_ms"]}
    return {"pull_gbps": pull_gbps, "pull": pull, **ms,
            "publish_to_serving_ms": round(sum(ms.values()), 2)}
