"""Names that moved keep working for one release, with a `DeprecationWarning` naming the
new place: the forwarding `__getattr__` of an old module path, or of the top level for a
name that left it."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from types import ModuleType


def _warn(old: str, new: str) -> None:
    # stacklevel 3: past this helper and the module `__getattr__`, to the importing line.
    warnings.warn(f"{old} moved to {new}; the old name goes in the next release", DeprecationWarning, stacklevel=3)


def forward_module(old: str, new: ModuleType) -> Callable[[str], object]:
    """A module `__getattr__` for the old path `old` of the module `new`: each name read
    through it is `new`'s, with a `DeprecationWarning`."""

    def __getattr__(name: str) -> object:
        if name.startswith("__"):  # probes (`__path__`, `__wrapped__`) are no user's name
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        _warn(old, new.__name__)
        return getattr(new, name)

    return __getattr__


def forward_names(old: str, moves: Mapping[str, ModuleType]) -> Callable[[str], object]:
    """A module `__getattr__` for `old`, whose names in `moves` now live in the module each
    maps to: reading one warns with a `DeprecationWarning` and gives the same object."""

    def __getattr__(name: str) -> object:
        new = moves.get(name)
        if new is None:
            raise AttributeError(f"module {old!r} has no attribute {name!r}")
        _warn(f"{old}.{name}", f"{new.__name__}.{name}")
        return getattr(new, name)

    return __getattr__
