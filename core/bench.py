"""Deprecated: the pull bench moved to `weightpull.integrations.bench.pull` (and
`parse_size` to `weightpull.integrations.bench.util`), out of the core. This name forwards
for one release, with a `DeprecationWarning`; `weightpull bench pull` is the command."""

from __future__ import annotations

from typing import Any

from .plugins import forward


def __getattr__(name: str) -> Any:
    return forward("weightpull.bench", ("bench.pull", "bench.util"), name, "(parse_size: .util)")
