"""The trainer's cast of a version, bf16 against block fp8, side by side in one run: what
`SnapshotPublisher` blocks the trainer for (its snapshot into a staging buffer on the
weights' device), for a Qwen3-shaped set of fp32 weights.

    python -m weightpull.integrations.bench.fp8_cast [--preset 8b] [--repeat 5] [--json]

On a CUDA machine the weights and the staging buffer are on the GPU (8b: 32.8 GB of fp32
weights, 16.4 GB of bf16 staging or 9.4 GB of fp8); elsewhere on the host (the default
preset there is tiny). Each cast's copy is checked against the first: the same bytes every
time, and the fp8 one against `fp8.quantize` of one weight.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

import torch

from weightpull.layout import TensorSpec

from .. import fp8
from ..torch_snapshot import Staging
from .presets import PRESETS


def run(preset: str, repeat: int, device: str) -> dict[str, Any]:
    shapes = PRESETS[preset].shapes()
    g = torch.Generator(device=device).manual_seed(0)
    weights = {n: torch.randn(s, generator=g, device=device) * 0.02 for n, s in shapes}
    given = [TensorSpec(n, "float32", s) for n, s in shapes]
    forms = {
        "bf16": (Staging([TensorSpec(s.name, "bfloat16", s.shape) for s in given], device), None),
        "fp8": (Staging(fp8.specs(given), device), True),
    }
    out: dict[str, Any] = {"preset": preset, "device": device, "tensors": len(shapes), "forms": {}}
    for form, (staging, quantized) in forms.items():
        times = []
        first = None
        for _ in range(repeat):
            started = time.perf_counter()
            staging.fill(fp8.expand(weights) if quantized else weights.items())
            times.append(time.perf_counter() - started)
            if first is None:
                first = staging.buffer.clone()
            else:
                assert torch.equal(staging.buffer, first), f"{form}: the cast gave other bytes"
        out["forms"][form] = {"bytes": staging.layout.total_bytes, "seconds": statistics.median(times)}
        if quantized:  # one weight, against the quantizer on its own
            name = next(n for n, s in shapes if fp8.quantizes(n, s))
            q, scale = fp8.quantize(weights[name])
            assert torch.equal(staging.views[name].view(torch.uint8), q.view(torch.uint8))
            assert torch.equal(staging.views[name + fp8.SCALE_SUFFIX], scale)
        del first, staging
    bf16, f8 = out["forms"]["bf16"], out["forms"]["fp8"]
    out["fp8_over_bf16_seconds"] = f8["seconds"] / bf16["seconds"]
    out["fp8_over_bf16_bytes"] = f8["bytes"] / bf16["bytes"]
    return out


def main(argv: list[str] | None = None) -> int:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(
        prog="python -m weightpull.integrations.bench.fp8_cast", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--preset", choices=sorted(PRESETS), default="8b" if cuda else "tiny")
    p.add_argument("--repeat", type=int, default=5, help="casts of each form, the median kept (default: 5)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    result = run(args.preset, args.repeat, "cuda:0" if cuda else "cpu")
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['preset']} on {result['device']}, {result['tensors']} tensors, median of {args.repeat}:")
        for form, r in result["forms"].items():
            print(
                f"  {form}: {r['bytes'] / 1e9:.2f} GB in {r['seconds'] * 1e3:.1f} ms ({r['bytes'] / r['seconds'] / 1e9:.1f} GB/s)"
            )
        print(
            f"  fp8 / bf16: x{result['fp8_over_bf16_seconds']:.2f} the time, x{result['fp8_over_bf16_bytes']:.3f} the bytes"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
