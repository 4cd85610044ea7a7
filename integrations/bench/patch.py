"""A delta's work outside the links, on 1 to N threads: the publisher's `weightpull.delta.encode`
and, once the bytes are in, a replica's `weightpull.delta.patch` of a bf16 and of an fp8
version (in place, and from a base held apart, as a relay's spare mirror is patched) and
its check of the whole version (`digests.first_mismatch`, wsum64 in 64 MiB buckets). Each is timed beside a plain copy of the same bytes on as many threads (what the
memory allows those threads) and against its own time on one thread, in one run.

The changes are the measured ones (docs/guides/bytes.md): 1.90% of bf16 words, 0.95% of fp8
bytes, at random places. Rates are bytes of the whole version a second, as `simulate`'s
`--patch-rate` and `--check-rate` count them.

With `--device cuda:0`, the same encode (of a publisher's slot on a GPU), patches and check
(of a GPU mirror) with torch where they lie (`weightpull.integrations.torch_delta`,
`torch_digests`' wsum64), each beside a copy on that device, every section and patched
copy compared with the host's.

    python -m weightpull.integrations.bench.patch [--size 512M] [--threads 1,2] [--repeat 3]
        [--device cuda:0] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import numpy as np

from weightpull import delta as deltas
from weightpull import digests
from weightpull.errors import InvalidArgumentError

from .util import best_seconds, parse_size

FORMS = {"bf16": (2, 0.0190), "fp8": (1, 0.0095)}  # word, share of words changed
BUCKET = 64 << 20


def copy_on(dst: np.ndarray, src: np.ndarray, threads: int) -> None:
    """`src` into `dst` (bytes), in `threads` parts at once: the memory's copy rate."""
    edges = np.linspace(0, len(src), threads + 1, dtype=np.int64)
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda i: np.copyto(dst[edges[i] : edges[i + 1]], src[edges[i] : edges[i + 1]]), range(threads)))


def measure(
    nbytes: int, threads: Sequence[int], repeat: int, seed: int = 0, device: str | None = None
) -> dict[str, Any]:
    """Seconds of each step (best of `repeat`) on each thread count (and on `device`, if
    given), each patched copy and check asserted exact."""
    rng = np.random.default_rng(seed)
    old = rng.integers(0, 256, nbytes, dtype=np.uint8)
    target = old.copy()  # its pages touched: no first-touch faults in the first timing
    seconds: dict[str, dict[int, float]] = {}
    spans = [(o, min(BUCKET, nbytes - o)) for o in range(0, nbytes, BUCKET)]
    sections = {}
    for form, (word, share) in FORMS.items():
        new = old.copy()
        words = nbytes // word
        where = rng.choice(words, int(words * share), replace=False)
        new[where * word] ^= 0x5A
        room = np.empty(4 * -(-words // deltas.CHUNK) + 8 + (2 + word) * len(where), dtype=np.uint8)
        got = deltas.encode(memoryview(old), memoryview(new), word, memoryview(room), threads=1)
        assert got is not None and got[1] == len(where), "the delta did not encode every change"
        sections[form] = (word, memoryview(room)[: got[0]], new, room)  # the section, as encoded in turn
    recorded = [digests.digest(memoryview(old)[o : o + n], digests.WSUM64) for o, n in spans]
    result: dict[str, Any] = {"bytes": nbytes, "threads": list(threads), "repeat": repeat}
    if device is not None:
        result["device"] = {"name": device, "seconds": on_device(device, old, sections, spans, recorded, repeat)}
    for t in threads:
        seconds.setdefault("copy", {})[t] = best_seconds(partial(copy_on, target, old, t), repeat)
        for form, (word, section, new, room) in sections.items():
            again = np.zeros_like(room)
            encode = partial(deltas.encode, memoryview(old), memoryview(new), word, memoryview(again), threads=t)
            seconds.setdefault(f"encode {form} (the publisher)", {})[t] = best_seconds(encode, repeat)
            assert again[: len(section)].tobytes() == section.tobytes(), f"the {form} delta encoded differently"
            np.copyto(target, old)
            in_place = partial(deltas.patch, memoryview(target), section, word, threads=t)
            seconds.setdefault(f"patch {form}, in place", {})[t] = best_seconds(in_place, repeat)
            assert np.array_equal(target, new), f"the {form} patch in place did not give the version"
            target[:] = 0
            apart = partial(deltas.patch, memoryview(target), section, word, base=memoryview(old), threads=t)
            seconds.setdefault(f"patch {form}, from a base apart", {})[t] = best_seconds(apart, repeat)
            assert np.array_equal(target, new), f"the {form} patch from a base did not give the version"
        check = partial(digests.first_mismatch, memoryview(old), spans, recorded, threads=t)
        seconds.setdefault("check, wsum64", {})[t] = best_seconds(check, repeat)
        assert check() is None, "the check found a bucket that does not match"
    return {**result, "seconds": seconds}


def on_device(
    device: str,
    old: np.ndarray,
    sections: dict[str, Any],
    spans: list[tuple[int, int]],
    recorded: list[str],
    repeat: int,
) -> dict[str, float]:
    """Seconds of each step on `device`, with torch (best of `repeat`, the device
    synchronized in each): a copy, each form's encode and patch (in place and from a base
    apart), and the wsum64 check; each section, patched copy and check asserted exact."""
    import torch

    from weightpull.integrations.torch_delta import encode, patch
    from weightpull.integrations.torch_digests import wsum64_digests
    from weightpull.transport import Region

    def timed(step: Any) -> float:
        def run() -> None:
            step()
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize(device)

        return best_seconds(run, repeat)

    base = torch.from_numpy(old).to(device)
    target = torch.empty_like(base)
    seconds = {"copy": timed(partial(target.copy_, base))}
    for form, (word, section, new, room) in sections.items():
        on = torch.frombuffer(bytearray(section), dtype=torch.uint8).to(device)
        want = torch.from_numpy(new).to(device)
        into = torch.empty(len(room), dtype=torch.uint8, device=device)
        seconds[f"encode {form} (the publisher)"] = timed(partial(encode, base, want, word, into))
        assert torch.equal(into[: len(section)], on), f"the {form} delta encoded differently on {device}"
        target.copy_(base)
        seconds[f"patch {form}, in place"] = timed(partial(patch, target, on, word))
        assert torch.equal(target, want), f"the {form} patch in place on {device} did not give the version"
        target.zero_()
        seconds[f"patch {form}, from a base apart"] = timed(partial(patch, target, on, word, base=base))
        assert torch.equal(target, want), f"the {form} patch from a base on {device} did not give the version"
        del want
    mirror = Region(nbytes=base.numel(), device=device, memory=base)
    seconds["check, wsum64"] = timed(partial(wsum64_digests, mirror, spans))
    assert wsum64_digests(mirror, spans) == recorded, f"the check on {device} found a bucket that does not match"
    return seconds


def table(result: dict[str, Any]) -> str:
    """Each step's GB/s on each thread count, its speed-up over one thread, and its rate
    over the plain copy's on as many threads."""
    n, threads, seconds = result["bytes"], result["threads"], result["seconds"]
    first = threads[0]
    head = ["step"] + [f"{t} thread{'s' if t > 1 else ''}: GB/s (over {first}, over copy)" for t in threads]
    rows = [head]
    for step, by in seconds.items():
        cells = [step]
        for t in threads:
            rate = n / by[t] / 1e9
            cells.append(f"{rate:.2f} ({by[first] / by[t]:.2f}x, {seconds['copy'][t] / by[t]:.2f})")
        rows.append(cells)
    lines = [f"{n / (1 << 20):.0f} MiB, best of {result['repeat']}, rates of the whole version's bytes"]
    lines += _aligned(rows)
    if "device" in result:
        on = result["device"]["seconds"]
        lines += ["", f"on {result['device']['name']}, torch: GB/s (over the device's copy)"]
        lines += _aligned(
            [["step", "GB/s"]] + [[step, f"{n / by / 1e9:.1f} ({on['copy'] / by:.2f})"] for step, by in on.items()]
        )
    return "\n".join(lines)


def _aligned(rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]


def _size(text: str) -> int:
    try:
        n = parse_size(text)
    except InvalidArgumentError:
        raise argparse.ArgumentTypeError(f"a size such as 512M, got {text!r}") from None
    if n < 1 << 20:
        raise argparse.ArgumentTypeError(f"a size of at least 1M, got {text!r}")
    return n


def _threads(text: str) -> list[int]:
    try:
        got = [int(x) for x in text.split(",")]
    except ValueError:
        got = []
    if not got or any(t < 1 for t in got):
        raise argparse.ArgumentTypeError(f"thread counts such as 1,2,4 (each at least 1), got {text!r}")
    return got


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m weightpull.integrations.bench.patch", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--size", type=_size, default=512 << 20, help="the version's bytes (default: 512M)")
    p.add_argument(
        "--threads", type=_threads, default=[1, 2], help="thread counts, the first the baseline (default: 1,2)"
    )
    p.add_argument("--repeat", type=int, default=3, help="runs of each step, the best kept (default: 3)")
    p.add_argument("--device", help="also patch and check where a GPU mirror lies, with torch (e.g. cuda:0)")
    p.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    result = measure(args.size, args.threads, args.repeat, device=args.device)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
