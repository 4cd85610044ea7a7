"""Deprecated: the command line moved to `weightpull.integrations.cli` (an application of
the core, which imports no integration). This name works for one release, with a
`DeprecationWarning`; `weightpull` and `python -m weightpull` are unchanged."""

from __future__ import annotations

from typing import Any

from .plugins import forward


def __getattr__(name: str) -> Any:
    return forward("weightpull.cli", ("cli",), name)
