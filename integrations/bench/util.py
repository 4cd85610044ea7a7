"""What every bench shares: sizes on the command line, GB/s, a free port, progress on
stderr, the machine's name, and the in-process driver over pinned memory. Needs nothing
beyond the core (torch only where pinned memory is asked for)."""

from __future__ import annotations

import os
import platform
import re
import socket
import statistics
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from weightpull.drivers.fake import FakeTransport
from weightpull.errors import InvalidArgumentError
from weightpull.transport import Region

IN_PROCESS = frozenset({"fake"})  # drivers whose peers share one process: no publisher process
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'1G', '256M', '512MiB', '4096' -> bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([kmgt]?)(i?b)?\s*", text.lower())
    if not m or int(m.group(1)) <= 0:
        raise InvalidArgumentError(f"size must be a positive number of bytes like 256M or 1G, got {text!r}")
    return int(m.group(1)) * _UNITS[m.group(2)]


def best_seconds(fn: Callable[[], Any], repeat: int) -> float:
    """The least of `repeat` timings of `fn()`, in seconds."""
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return min(times)


def transport_options(pairs: Iterable[str] | None) -> dict[str, Any]:
    """['threads=4', 'pinned=true'] -> {'threads': 4, 'pinned': True}: a transport's keywords."""
    out: dict[str, Any] = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise InvalidArgumentError(f"transport options are KEY=VALUE, got {pair!r}")
        out[key] = _scalar(value)
    return out


def _scalar(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(text.lower(), text)


def gbps(
    nbytes: int, seconds: list[float], digits: int = 3, pick: Callable[[list[float]], float] = statistics.median
) -> float:
    """10^9 bytes per second over the median of the timings (or `pick`'s choice)."""
    return round(nbytes / pick(seconds) / 1e9, digits)


def median_ms(seconds: list[float]) -> float:
    return round(statistics.median(seconds) * 1e3, 2)


def free_port() -> int:
    """A loopback port that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def say_to_stderr(tag: str) -> Callable[[str], None]:
    """Progress lines `[tag] ...` on stderr, each in one write so that the lines of
    processes sharing the stream never interleave mid-line."""

    def say(line: str) -> None:
        sys.stderr.write(f"[{tag}] {line}\n")
        sys.stderr.flush()

    return say


def machine(gpu: str = "", torch_version: str | None = None) -> str:
    """This host, as the benches' JSON names it."""
    return f"{platform.node()}: {os.cpu_count()} CPUs{gpu}, {platform.machine()}, Python {sys.version.split()[0]}" + (
        f", torch {torch_version}" if torch_version else ""
    )


class Progress:
    """A bar on stderr (tqdm where installed, else a line per step)."""

    def __init__(self, total: int) -> None:
        try:
            from tqdm import tqdm

            self.bar: Any = tqdm(total=total, file=sys.stderr, unit="step", dynamic_ncols=True)
        except ImportError:
            self.bar, self.done, self.total = None, 0, total
            self.say = say_to_stderr("bench")

    def __call__(self, what: str) -> None:
        """A step done."""
        if self.bar is not None:
            self.bar.set_description(what)
            self.bar.update(1)
        else:
            self.done += 1
            sys.stderr.write(f"[bench {self.done}/{self.total}] {what}\n")
            sys.stderr.flush()

    def note(self, what: str) -> None:
        """What runs now."""
        if self.bar is not None:
            self.bar.set_description(what)
        else:
            self.say(what)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class PinnedFake(FakeTransport):
    """The in-process driver over page-locked host memory, as a real driver would
    register it, so that device-to-host copies run at full speed, asynchronously."""

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        import torch

        if device != "cpu" or not torch.cuda.is_available():
            return super().allocate(nbytes, device)
        return self.register(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy())
