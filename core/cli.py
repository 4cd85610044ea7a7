"""Deprecated: the command line moved to `weightpull.integrations.cli` (an application of
the core, which imports no integration). This name works for one release, with a
`DeprecationWarning`; `weightpull` and `python -m weightpull` are unchanged."""

from __future__ import annotations

import importlib
import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    warnings.warn(
        "weightpull.cli moved to weightpull.integrations.cli; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(importlib.import_module("weightpull.integrations.cli"), name)
