"""Plugins: what the core loads at run time, found by name through entry points.

The core imports no driver and no integration, not even by an import string (the import
contracts check it). What it loads of them (a transport driver, the torch tensor adapter,
host staging, the torch digester, patcher and encoder, a served registry's client, the modules that moved out
of the core) weightpull's own metadata names, as entry points in the groups below
(`[project.entry-points]` in pyproject.toml), beside those third parties add to the same
groups. Looking a plugin up imports nothing; loading one imports its module, and one whose
import fails names the extra that installs what it needs, written after its target as an
entry point's extras (`nixl = "weightpull.drivers.nixl:NixlTransport [nixl]"`).
"""

from __future__ import annotations

import functools
import importlib
import re
import warnings
from collections.abc import Sequence
from importlib.metadata import EntryPoint, PackageNotFoundError, distribution, entry_points
from typing import Any

import attrs

from .errors import DriverUnavailableError, WeightpullError

TRANSPORTS = "weightpull.transports"  # transport drivers, by name
TENSOR_ADAPTERS = "weightpull.tensor_adapters"  # `TensorAdapter` classes, by a tensor type's top-level module
TENSOR_VIEWS = "weightpull.tensor_views"  # `as_tensors(layout, region)` functions, by framework
HOST_STAGING = "weightpull.host_staging"  # what feeds a GPU mirror from host reads, by framework
DIGESTERS = "weightpull.digesters"  # `Digester`s computing digests where a slot lives, by framework
PATCHERS = "weightpull.patchers"  # `Patcher`s patching a delta where a mirror lives, by framework
ENCODERS = "weightpull.encoders"  # `Encoder`s encoding a delta where a slot lives, by framework
REGISTRY_CLIENTS = "weightpull.registry_clients"  # registry clients, by the address's kind
MOVED = "weightpull.moved"  # the modules that moved out of the core, by their old short name

OWN = "weightpull"  # the distribution whose entry points are the built-ins


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class Plugin:
    """One entry point: what `name` in `group` loads, and who declares it.

    Attributes:
        group: the entry-point group (`TRANSPORTS`, ...).
        name: its name in the group.
        target: `"module:attr"`, or `"module"` for a module.
        extras: the extras written after the target; for a built-in, the weightpull extras
            that install what it needs.
        dist: the distribution that declares it (`OWN` for the built-ins).
    """

    group: str
    name: str
    target: str
    extras: tuple[str, ...] = ()
    dist: str | None = None

    @property
    def builtin(self) -> bool:
        return self.dist is not None and _normalized(self.dist) == OWN

    @property
    def extra(self) -> str | None:
        """The weightpull extra whose install it names when it cannot load (built-ins only:
        a third party's extras are its own distribution's)."""
        return self.extras[0] if self.builtin and self.extras else None

    @property
    def dotted(self) -> str:
        """Its target as one dotted name (`module.attr`), as a user writes it in code."""
        return self.target.replace(":", ".")


class MetadataMissingError(WeightpullError, LookupError):
    """weightpull's package metadata, which names its built-in plugins, is not installed, or
    is older than the code (a checkout run without `pip install -e .`, or not reinstalled
    since its entry points changed)."""


def _plugin(ep: EntryPoint) -> Plugin:
    bracket = ep.value.partition("[")[2]
    # Extras as written (importlib.metadata's `extras` splits `torch-transport` at the hyphen).
    extras = tuple(re.findall(r"[\w.-]+", bracket.partition("]")[0]))
    target = ep.module if ep.attr is None else f"{ep.module}:{ep.attr}"
    return Plugin(ep.group, ep.name, target, extras, ep.dist.name if ep.dist is not None else None)


@functools.cache
def _own() -> None:
    try:
        distribution(OWN)
    except PackageNotFoundError:
        raise MetadataMissingError(
            "weightpull's package metadata is not installed, so its drivers and integrations cannot be found: "
            "install it (from a checkout: pip install -e .)"
        ) from None


@functools.cache
def _group(group: str) -> dict[str, Plugin]:
    """The entry points of `group`, by name, weightpull's own first so that no third party's
    shadows a built-in. Read once per group (a scan of every distribution's metadata);
    `refresh` reads again."""
    _own()
    found = sorted((_plugin(ep) for ep in entry_points(group=group)), key=lambda p: not p.builtin)  # else as found
    named: dict[str, Plugin] = {}
    for plugin in found:
        named.setdefault(plugin.name, plugin)
    return named


def refresh() -> None:
    """Read the installed distributions' entry points again (after one is installed in a
    running process)."""
    _group.cache_clear()
    _own.cache_clear()


def plugins(group: str) -> dict[str, Plugin]:
    """Every plugin of `group`, by name: weightpull's built-ins, then third parties'.

    Raises:
        MetadataMissingError: weightpull's own metadata is not installed.
    """
    return dict(_group(group))


def find(group: str, name: str) -> Plugin | None:
    """The plugin `name` of `group`, or None."""
    return _group(group).get(name)


def builtin(group: str, name: str) -> Plugin:
    """The plugin `name` of `group` that weightpull declares (or a third party in its stead).

    Raises:
        MetadataMissingError: weightpull's metadata is missing or does not name it yet.
    """
    plugin = find(group, name)
    if plugin is None:
        raise MetadataMissingError(
            f"weightpull's package metadata names no {name!r} in the entry-point group {group!r}: it was "
            "installed before that entry point was added; reinstall it (from a checkout: pip install -e .)"
        )
    return plugin


def load_target(target: str, what: str, extra: str | None = None) -> Any:
    """Import `target` (`"module:attr"` or `"module"`) and return what it names.

    Raises:
        DriverUnavailableError: its import failed (naming `pip install 'weightpull[extra]'`
            when `extra` is given), or the module has no such attribute.
    """
    module_name, _, attr = target.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split(".") if attr else ():
            obj = getattr(obj, part)
    except ImportError as exc:
        hint = f"; install it with: pip install 'weightpull[{extra}]'" if extra else ""
        raise DriverUnavailableError(f"{what} cannot load: {exc}{hint}") from exc
    except AttributeError as exc:
        raise DriverUnavailableError(f"{what}: {target} not found ({exc})") from exc
    return obj


def load(plugin: Plugin, what: str | None = None) -> Any:
    """What `plugin` names, imported (`what` names it in an error: `"transport 'nixl'"`).

    Raises:
        DriverUnavailableError: it cannot load here; the message names the extra to install.
    """
    return load_target(plugin.target, what or f"{plugin.group} {plugin.name!r}", plugin.extra)


def load_builtin(group: str, name: str, what: str | None = None) -> Any:
    """`load(builtin(group, name), what)`.

    Raises:
        MetadataMissingError: weightpull's metadata is missing or does not name it yet.
        DriverUnavailableError: it cannot load here; the message names the extra to install.
    """
    return load(builtin(group, name), what)


@attrs.frozen
class Named:
    """A built-in plugin's dotted name, looked up when first shown (in an error message
    that tells a user what to pass), so that defining one reads no metadata."""

    group: str
    name: str

    def __str__(self) -> str:
        try:
            plugin = find(self.group, self.name)
        except MetadataMissingError:
            plugin = None
        return plugin.dotted if plugin is not None else f"the {self.name!r} entry point of {self.group}"


def forward(old: str, moved: Sequence[str], attr: str, note: str = "") -> Any:
    """`attr` of the module `old` that moved out of the core: looked up in the modules it
    moved to (the `weightpull.moved` entry points named `moved`, in turn), with a
    `DeprecationWarning` that names the first. A forwarding module's `__getattr__` calls it.

    Raises:
        AttributeError: none of them has `attr`.
    """
    targets = [builtin(MOVED, name) for name in moved]
    warnings.warn(
        f"{old} moved to {targets[0].target}{' ' + note if note else ''}; the old name goes in the next release",
        DeprecationWarning,
        stacklevel=3,  # the code that asked `old` for it
    )
    for target in targets:
        module = load(target, f"{old}'s new home")
        if hasattr(module, attr):
            return getattr(module, attr)
    raise AttributeError(f"module {old!r} has no attribute {attr!r}")
