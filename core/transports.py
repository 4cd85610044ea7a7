"""The driver registry: transports by name.

Drivers are entry points of the group `weightpull.transports` (`weightpull.plugins`):
weightpull's own built-ins and third parties' alike, so listing them imports nothing
heavy and the core names no driver; `register_transport` adds one in a running process.
A driver that cannot load says which extra would fix it.
"""

from __future__ import annotations

from typing import Any

import attrs

from . import plugins
from .errors import DriverUnavailableError, UnknownDriverError
from .transport import Transport

ENTRY_POINT_GROUP = plugins.TRANSPORTS


@attrs.frozen
class DriverEntry:
    name: str
    target: str | type[Transport]  # "module:Class", or the class itself
    extra: str | None = None  # the pip extra that installs its library
    origin: str = "builtin"


@attrs.frozen
class DriverInfo:
    name: str
    origin: str
    target: str
    extra: str | None
    available: bool
    reason: str | None  # why it is not available


def _entry(plugin: plugins.Plugin, name: str | None = None) -> DriverEntry:
    origin = "builtin" if plugin.builtin else f"entry point ({plugin.dist or '?'})"
    return DriverEntry(name or plugin.name, plugin.target, plugin.extra, origin)


def _builtin() -> dict[str, DriverEntry]:
    return {name: _entry(p) for name, p in plugins.plugins(ENTRY_POINT_GROUP).items() if p.builtin}


def _host_staging() -> DriverEntry:
    """What feeds a GPU mirror from a driver whose reads land in host memory: each read into a
    pinned host shadow, copied to the GPU while the next is read. It needs torch."""
    return _entry(plugins.builtin(plugins.HOST_STAGING, "torch"), "host staging")


def __getattr__(name: str) -> Any:
    # The tables this module held before drivers became entry points, made from them.
    if name == "BUILTIN":
        return _builtin()
    if name == "HOST_STAGING":
        return _host_staging()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_registered: dict[str, DriverEntry] = {}


def register_transport(
    name: str, target: str | type[Transport], *, extra: str | None = None, replace: bool = False
) -> None:
    """Add a driver by import string or class (an entry point does the same from metadata)."""
    if not replace and name in _entries():
        raise ValueError(f"a transport named {name!r} is already registered")
    _registered[name] = DriverEntry(name, target, extra, origin="registered")


def _entries() -> dict[str, DriverEntry]:
    # Built-ins first: no third party's entry point shadows one (plugins orders them so).
    entries = {name: _entry(plugin) for name, plugin in plugins.plugins(ENTRY_POINT_GROUP).items()}
    entries.update(_registered)
    return entries


def _load(entry: DriverEntry) -> type[Transport]:
    if not isinstance(entry.target, str):
        return entry.target
    obj = plugins.load_target(entry.target, f"transport {entry.name!r}", entry.extra)
    if not (isinstance(obj, type) and issubclass(obj, Transport)):
        raise DriverUnavailableError(f"transport {entry.name!r}: {entry.target} is not a Transport")
    return obj


def transport_class(name: str) -> type[Transport]:
    entries = _entries()
    if name not in entries:
        raise UnknownDriverError(f"no transport named {name!r}; known: {', '.join(sorted(entries))}")
    cls = _load(entries[name])
    reason = cls.unavailable_reason()
    if reason:
        raise DriverUnavailableError(f"transport {name!r} is unavailable here: {reason}")
    return cls


def create_transport(name: str, **options: Any) -> Transport:
    """A new endpoint of the named driver."""
    return transport_class(name)(**options)


def list_transports() -> list[DriverInfo]:
    """Every known driver, whether it imports, and why not."""
    infos = []
    for name, entry in sorted(_entries().items()):
        target = (
            entry.target if isinstance(entry.target, str) else f"{entry.target.__module__}:{entry.target.__qualname__}"
        )
        try:
            reason = _load(entry).unavailable_reason()
        except DriverUnavailableError as exc:
            reason = str(exc)
        infos.append(DriverInfo(name, entry.origin, target, entry.extra, reason is None, reason))
    return infos


def for_device(transport: Transport, device: str, staging: bool | None = None) -> Transport:
    """What a mirror on `device` reads through: `transport`, or for a GPU mirror of a driver
    whose reads land in host memory (or with `staging=True`), `transport` wrapped in host
    staging, an entry point of `weightpull.host_staging` loaded like a driver (so the core
    imports no integration)."""
    if device == "cpu" or not (staging if staging is not None else not transport.reads_into_gpu):
        return transport
    try:
        staged = _load(_host_staging())
    except DriverUnavailableError as exc:
        raise DriverUnavailableError(f"a mirror on {device} needs torch: {exc}") from exc
    reason = staged.unavailable_reason()
    if reason:
        raise DriverUnavailableError(
            f"a mirror on {device} cannot be fed from {transport.name!r}'s host reads: {reason}"
        )
    return staged(transport)  # type: ignore[call-arg]  # a wrapper: it takes the transport it wraps
