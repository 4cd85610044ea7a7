"""Deprecated: the registry bench moved to `weightpull.integrations.bench.registry`. This
name forwards for one release, with a `DeprecationWarning`; `weightpull bench registry`
is the command."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn(
        "weightpull.drivers.zmq_registry.bench moved to weightpull.integrations.bench.registry; "
        "the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("weightpull.integrations.bench.registry"), name)
