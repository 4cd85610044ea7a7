"""The layout planner: where each tensor lives in a slot, grouped into buckets.

A layout depends only on the tensors' (name, dtype, shape), the bucket size and the
alignment, so both sides can plan it and a signature tells when the model changed shape.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from . import schema
from .errors import InvalidArgumentError

DTYPE_SIZES: Mapping[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}

DEFAULT_BUCKET_BYTES = 64 << 20
DEFAULT_ALIGN = 256  # keeps every tensor aligned for any dtype and for GPU copies


def _check_name(_: Any, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(f"tensor name must be a non-empty string, got {value!r}")


def _check_dtype(instance: Any, _: attrs.Attribute[str], value: str) -> None:
    if value not in DTYPE_SIZES:
        raise InvalidArgumentError(
            f"tensor {instance.name!r}: unsupported dtype {value!r} (supported: {', '.join(DTYPE_SIZES)})"
        )


def _to_shape(value: Iterable[int]) -> tuple[int, ...]:
    shape = tuple(value)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidArgumentError(f"shape must be non-negative integers, got {shape!r}")
    return shape


@attrs.frozen
class TensorSpec:
    """A tensor as published: its name, its dtype after any cast, its shape.

    Args:
        name: A non-empty name, unique in its layout.
        dtype: One of `DTYPE_SIZES` ("bfloat16", "float32", ...).
        shape: Non-negative sizes.

    Raises:
        InvalidArgumentError: An empty name, a dtype not supported, or a negative or
            non-integer size.
    """

    name: str = attrs.field(validator=_check_name)
    dtype: str = attrs.field(validator=_check_dtype)
    shape: tuple[int, ...] = attrs.field(converter=_to_shape)

    @property
    def numel(self) -> int:
        """Its number of elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        """Its size in bytes."""
        return self.numel * DTYPE_SIZES[self.dtype]


@attrs.frozen(cache_hash=True)  # a key of each slot's views, looked up per tensor per publish
class Placement:
    """Where one tensor's bytes start in the slot, and in which bucket.

    Attributes:
        spec: The tensor.
        offset: Its first byte in the slot.
        bucket: The index of the bucket it lies in.
    """

    spec: TensorSpec
    offset: int
    bucket: int

    @property
    def end(self) -> int:
        """One past its last byte in the slot."""
        return self.offset + self.spec.nbytes


@attrs.frozen
class Bucket:
    """A contiguous byte range of the slot, read as one transfer.

    Attributes:
        index: Its place among the layout's buckets.
        offset: Its first byte in the slot.
        nbytes: Its size.
        names: The tensors in it, in slot order.
    """

    index: int
    offset: int
    nbytes: int
    names: tuple[str, ...]


@attrs.frozen
class Layout(schema.Record):
    """Where every tensor of a version lies in its slot, grouped into buckets
    (`plan_layout` makes one). Index it by tensor name for the `Placement`.

    Attributes:
        placements: Every tensor's placement, in the order planned.
        buckets: The buckets, in slot order.
        total_bytes: The slot size it needs.
        bucket_bytes: The bucket size it was planned with.
        align: The alignment of every offset.
        signature: Changes whenever a tensor's name, dtype or shape, or the packing, does.
    """

    placements: tuple[Placement, ...]
    buckets: tuple[Bucket, ...]
    total_bytes: int
    bucket_bytes: int
    align: int
    signature: str
    _by_name: Mapping[str, Placement] = attrs.field(eq=False, repr=False)

    def __getitem__(self, name: str) -> Placement:
        """The placement of the tensor called `name`.

        Raises:
            KeyError: No tensor of that name.
        """
        try:
            return self._by_name[name]
        except KeyError:
            raise KeyError(f"no tensor named {name!r} in this layout") from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def __len__(self) -> int:
        return len(self.placements)

    @property
    def specs(self) -> tuple[TensorSpec, ...]:
        """Every tensor, in the order planned."""
        return tuple(p.spec for p in self.placements)


@attrs.frozen
class _LayoutForm:
    """A layout on the wire: its specs and packing; the rest is re-planned from them."""

    tensors: tuple[tuple[str, str, tuple[int, ...]], ...]
    bucket_bytes: int
    align: int
    signature: str


# A model's layout crosses the wire with every manifest (a stream's twice), and checking and
# re-planning thousands of tensors takes milliseconds: each side keeps the last few it
# made or checked, keyed by their exact wire form, so the same layout is done once.
_LAYOUTS_KEPT = 8
_forms: OrderedDict[str, dict[str, Any]] = OrderedDict()  # signature -> wire form
_planned: OrderedDict[str, Layout] = OrderedDict()  # wire form, as JSON -> layout


def _keep(cache: OrderedDict[str, Any], key: str, value: Any) -> None:
    cache[key] = value
    while len(cache) > _LAYOUTS_KEPT:
        cache.popitem(last=False)


def _unstructure_layout(layout: Layout) -> dict[str, Any]:
    form = _forms.get(layout.signature)
    if form is None:
        tensors = tuple((s.name, s.dtype, s.shape) for s in layout.specs)
        form = schema.as_object(_LayoutForm(tensors, layout.bucket_bytes, layout.align, layout.signature), _LayoutForm)
        _keep(_forms, layout.signature, form)
    return dict(form)  # its tensor list is shared: wire forms are encoded, never edited


def _structure_layout(data: Any, _: type) -> Layout:
    try:
        key = json.dumps(data, separators=(",", ":"))
    except (TypeError, ValueError):  # not a wire form at all: the strict check below says why
        key = None
    if key is not None and (layout := _planned.get(key)) is not None:
        return layout  # this exact form was checked and planned before
    form = schema.converter.structure(data, _LayoutForm)
    layout = plan_layout([TensorSpec(*t) for t in form.tensors], bucket_bytes=form.bucket_bytes, align=form.align)
    if layout.signature != form.signature:
        raise InvalidArgumentError(f"layout signature mismatch: planned {layout.signature}, sent {form.signature}")
    if key is not None:
        _keep(_planned, key, layout)
    return layout


schema.converter.register_unstructure_hook(Layout, _unstructure_layout)
schema.converter.register_structure_hook(Layout, _structure_layout)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


def layout_signature(specs: Iterable[TensorSpec], bucket_bytes: int, align: int) -> str:
    """Changes whenever any tensor's name, dtype or shape, or the packing, changes."""
    body = json.dumps(
        [[s.name, s.dtype, list(s.shape)] for s in specs] + [bucket_bytes, align],
        separators=(",", ":"),
    )
    return hashlib.sha256(body.encode()).hexdigest()[:32]


def plan_layout(
    specs: Iterable[TensorSpec],
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    align: int = DEFAULT_ALIGN,
) -> Layout:
    """Pack tensors, in the order given, into buckets of at most `bucket_bytes`; a
    tensor larger than a bucket gets a bucket of its own. Offsets are `align`-aligned.

    Args:
        specs: The tensors, in slot order.
        bucket_bytes: The most bytes a bucket holds (but a tensor larger alone).
        align: The alignment of every tensor's offset, a power of two.

    Returns:
        The layout; both sides plan the same one from the same arguments.

    Raises:
        InvalidArgumentError: No tensors, a name twice, `bucket_bytes` not positive, or
            `align` not a power of two.
    """
    specs = list(specs)
    if not specs:
        raise InvalidArgumentError("a layout needs at least one tensor")
    if not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
        raise InvalidArgumentError(f"bucket_bytes must be a positive int, got {bucket_bytes!r}")
    if not isinstance(align, int) or align <= 0 or align & (align - 1):
        raise InvalidArgumentError(f"align must be a power of two, got {align!r}")
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise InvalidArgumentError(f"tensor name {s.name!r} appears twice")
        seen.add(s.name)

    placements: list[Placement] = []
    buckets: list[Bucket] = []
    start = cursor = 0  # the open bucket's start, and the next free byte
    names: list[str] = []

    def close() -> None:
        nonlocal start, names
        if names:
            buckets.append(Bucket(len(buckets), start, cursor - start, tuple(names)))
        start, names = _round_up(cursor, align), []

    for spec in specs:
        offset = _round_up(cursor, align)
        if names and offset + spec.nbytes - start > bucket_bytes:
            close()
            offset = start
        placements.append(Placement(spec, offset, len(buckets)))
        names.append(spec.name)
        cursor = offset + spec.nbytes
        if spec.nbytes >= bucket_bytes:  # a bucket of its own; nothing joins it
            close()
    close()
    total = _round_up(cursor, align)
    return Layout(
        placements=tuple(placements),
        buckets=tuple(buckets),
        total_bytes=total,
        bucket_bytes=bucket_bytes,
        align=align,
        signature=layout_signature(specs, bucket_bytes, align),
        by_name={p.spec.name: p for p in placements},
    )
