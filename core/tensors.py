"""Tensor adapters: how the publisher describes tensors and copies them into a slot.

The core never touches a framework. It asks an adapter for each tensor's published
spec (its dtype after the `rollout_dtype` cast), has it copy the tensors into the
slot, then fences. `HostTensor` is the framework-free form; a framework's tensors go
through its adapter, an entry point of `weightpull.tensor_adapters` named by the top-level
module of the tensor's type (torch's is built in), loaded only when one shows up.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import anyio.lowlevel
import attrs

from . import plugins
from .errors import InvalidArgumentError
from .layout import DTYPE_SIZES, Layout, Placement, TensorSpec
from .transport import Region


def normalize_dtype(dtype: object, what: str = "dtype") -> str:
    """'bfloat16', torch.bfloat16 and 'torch.bfloat16' all name the same dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPE_SIZES:
        raise InvalidArgumentError(f"unsupported {what} {dtype!r} (supported: {', '.join(DTYPE_SIZES)})")
    return name


def cast_target(dtype: str, rollout_dtype: str | None) -> str:
    """The published dtype: fp32 becomes `rollout_dtype`; everything else is kept."""
    return rollout_dtype if rollout_dtype is not None and dtype == "float32" else dtype


class TensorAdapter(Protocol):
    def describe(self, name: str, value: Any, rollout_dtype: str | None) -> TensorSpec:
        """The spec `value` is published as."""

    async def write(self, items: Sequence[tuple[Any, Placement]], region: Region) -> None:
        """Copy each value, cast to its placement's dtype, into `region`. Device->host
        copies may still be in flight when this returns."""

    async def fence(self) -> None:
        """Return once every copy `write` issued has landed."""


def landing(adapter: TensorAdapter) -> Callable[[], None] | None:
    """What waits, blocking (a publisher calls it in a worker thread), for the copies
    `adapter` issued so far and no later ones: its `landing()` if it has one (a CUDA
    event recorded now), so that a streaming publisher can queue every bucket's copy and
    mark each as it lands; else None (then `fence`, bucket by bucket)."""
    method = getattr(adapter, "landing", None)
    return None if method is None else cast("Callable[[], None]", method())  # a string: no alias made per call


def landed_now(wait: Callable[[], None]) -> bool:
    """Whether the copies behind a `landing` wait have landed, asked without blocking:
    its `done()` if it has one (a CUDA event's query); False when it cannot say."""
    done = getattr(wait, "done", None)
    return done is not None and bool(done())


@attrs.frozen
class HostTensor:
    """A tensor as plain host bytes: no framework needed."""

    dtype: str = attrs.field(converter=normalize_dtype)
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    data: bytes | bytearray | memoryview = attrs.field(repr=False)

    def __attrs_post_init__(self) -> None:
        spec = TensorSpec("_", self.dtype, self.shape)
        if memoryview(self.data).nbytes != spec.nbytes:
            raise InvalidArgumentError(
                f"HostTensor of {self.dtype}{list(self.shape)} needs {spec.nbytes} bytes, "
                f"got {memoryview(self.data).nbytes}"
            )


class HostTensorAdapter:
    def describe(self, name: str, value: HostTensor, rollout_dtype: str | None) -> TensorSpec:
        if cast_target(value.dtype, rollout_dtype) != value.dtype:
            raise InvalidArgumentError(
                f"tensor {name!r}: casting float32 to {rollout_dtype} needs torch; publish "
                "torch tensors, or pass rollout_dtype=None"
            )
        return TensorSpec(name, value.dtype, value.shape)

    async def write(self, items: Sequence[tuple[HostTensor, Placement]], region: Region) -> None:
        view = region.host_view()
        for value, placement in items:
            view[placement.offset : placement.end] = memoryview(value.data).cast("B")
            await anyio.lowlevel.checkpoint()

    async def fence(self) -> None:
        pass


def adapter_for(value: Any) -> TensorAdapter:
    """The adapter for a tensor of this kind: its framework's tensor-adapter plugin,
    loaded when first asked for. The framework is the one a value names (its `framework`
    attribute: a wrapper's, such as an fp8 part of a torch weight), else the top-level
    module of its type."""
    if isinstance(value, HostTensor):
        return HostTensorAdapter()
    named = getattr(value, "framework", None)
    framework = named if isinstance(named, str) else type(value).__module__.split(".")[0]
    plugin = plugins.find(plugins.TENSOR_ADAPTERS, framework)
    if plugin is not None:
        adapter: TensorAdapter = plugins.load(plugin, f"the {framework} tensor adapter")()
        return adapter
    raise InvalidArgumentError(
        f"cannot publish a {type(value).__module__}.{type(value).__name__}: pass torch tensors or weightpull.HostTensor"
    )


def as_tensors(layout: Layout, region: Region, framework: str = "torch") -> dict[str, Any]:
    """Every tensor of a pulled version, by name, as views into its memory (no copy): the
    `layout` and `region` of what a pull or a borrow returns, viewed by `framework`'s
    plugin (`weightpull.tensor_views`; torch's, `torch.Tensor`s, is built in and needs the
    torch extra).

    Args:
        layout: the version's layout (`pulled.layout`).
        region: the memory it lies in (`pulled.region`).
        framework: whose tensors to make.

    Raises:
        DriverUnavailableError: the framework's views cannot load here (torch is not
            installed); the message names the extra.
        InvalidArgumentError: no plugin views `framework`'s tensors.
    """
    plugin = plugins.find(plugins.TENSOR_VIEWS, framework)
    if plugin is None:
        known = ", ".join(sorted(plugins.plugins(plugins.TENSOR_VIEWS))) or "none"
        raise InvalidArgumentError(f"no tensor views for {framework!r} are installed (known: {known})")
    views: dict[str, Any] = plugins.load(plugin, f"{framework} tensor views")(layout, region)
    return views
