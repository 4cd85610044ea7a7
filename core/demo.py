"""Deprecated: the demo moved to `weightpull.integrations.demo` (an application of the
core, which imports no integration). This name works for one release, with a
`DeprecationWarning`; `weightpull demo` is unchanged."""

from __future__ import annotations

from typing import Any

from .plugins import forward


def __getattr__(name: str) -> Any:
    return forward("weightpull.demo", ("demo",), name)
