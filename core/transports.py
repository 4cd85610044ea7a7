"""The driver registry: transports by name.

Built-in drivers are lazy import strings, so listing them imports nothing heavy; third
parties add theirs through the entry-point group `weightpull.transports` or
`register_transport`. A driver that cannot load says which extra would fix it.
"""

from __future__ import annotations

import importlib
from importlib.metadata import entry_points
from typing import Any

import attrs

from .errors import DriverUnavailableError, UnknownDriverError
from .transport import Transport

ENTRY_POINT_GROUP = "weightpull.transports"


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


BUILTIN: dict[str, DriverEntry] = {
    "fake": DriverEntry("fake", "weightpull.drivers.fake:FakeTransport"),
    "nixl": DriverEntry("nixl", "weightpull.drivers.nixl:NixlTransport", extra="nixl"),
    "torch": DriverEntry("torch", "weightpull.drivers.torch_transport:TorchTransport", extra="torch-transport"),
    "cuda_ipc": DriverEntry("cuda_ipc", "weightpull.drivers.cuda_ipc:CudaIpcTransport", extra="torch"),
}

# What feeds a GPU mirror from a driver whose reads land in host memory: each read into a
# pinned host shadow, copied to the GPU while the next is read. It needs torch.
HOST_STAGING = DriverEntry("host staging", "weightpull.integrations.torch_staging:HostStaged", extra="torch")

_registered: dict[str, DriverEntry] = {}


def register_transport(
    name: str, target: str | type[Transport], *, extra: str | None = None, replace: bool = False
) -> None:
    """Add a driver by import string or class (an entry point does the same from metadata)."""
    if not replace and name in _entries():
        raise ValueError(f"a transport named {name!r} is already registered")
    _registered[name] = DriverEntry(name, target, extra, origin="registered")


def _entries() -> dict[str, DriverEntry]:
    entries = dict(BUILTIN)
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        entries.setdefault(
            ep.name, DriverEntry(ep.name, ep.value, None, origin=f"entry point ({ep.dist.name if ep.dist else '?'})")
        )
    entries.update(_registered)
    return entries


def _load(entry: DriverEntry) -> type[Transport]:
    if not isinstance(entry.target, str):
        return entry.target
    module_name, _, attr = entry.target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except ImportError as exc:
        hint = f"; install it with: pip install 'weightpull[{entry.extra}]'" if entry.extra else ""
        raise DriverUnavailableError(f"transport {entry.name!r} cannot load: {exc}{hint}") from exc
    except AttributeError as exc:
        raise DriverUnavailableError(f"transport {entry.name!r}: {entry.target} not found ({exc})") from exc
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
    whose reads land in host memory (or with `staging=True`), `transport` wrapped in
    `HOST_STAGING`, which the driver registry loads like a driver (so the core imports no
    integration)."""
    if device == "cpu" or not (staging if staging is not None else not transport.reads_into_gpu):
        return transport
    try:
        staged = _load(HOST_STAGING)
    except DriverUnavailableError as exc:
        raise DriverUnavailableError(f"a mirror on {device} needs torch: {exc}") from exc
    reason = staged.unavailable_reason()
    if reason:
        raise DriverUnavailableError(
            f"a mirror on {device} cannot be fed from {transport.name!r}'s host reads: {reason}"
        )
    return staged(transport)  # type: ignore[call-arg]  # a wrapper: it takes the transport it wraps
