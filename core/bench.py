"""Deprecated: the pull bench moved to `weightpull.integrations.bench.pull` (and
`parse_size` to `weightpull.integrations.bench.util`), out of the core. This name forwards
for one release, with a `DeprecationWarning`; `weightpull bench pull` is the command."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn(
        "weightpull.bench moved to weightpull.integrations.bench.pull (parse_size: .util); "
        "the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    for module in ("weightpull.integrations.bench.pull", "weightpull.integrations.bench.util"):
        found = getattr(importlib.import_module(module), name, None)
        if found is not None:
            return found
    raise AttributeError(f"module 'weightpull.bench' has no attribute {name!r}")
