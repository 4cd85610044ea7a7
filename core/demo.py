"""Deprecated: the demo moved to `weightpull.integrations.demo` (an application of the
core, which imports no integration). This name works for one release, with a
`DeprecationWarning`; `weightpull demo` is unchanged."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn(
        "weightpull.demo moved to weightpull.integrations.demo; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("weightpull.integrations.demo"), name)
