"""Versions sharded along dim 0: N publishers each hold rows of every tensor.

A sharded version's manifest keeps the *full* layout (the tensors as a reader wants
them) and one `Shard` per publisher: its slot, and which rows of each tensor it holds.
A shard's slot is packed by `shard_layout`, which both sides compute, so a reader reads
each shard's rows of a tensor straight into their place in its full-layout mirror: rows
are contiguous bytes of a contiguous tensor, so nothing is copied twice.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import attrs

from . import schema
from .errors import InvalidArgumentError
from .layout import DTYPE_SIZES, Layout, TensorSpec, plan_layout

Rows = tuple[int, int]  # [start, stop) along dim 0


def _rows(value: Any) -> tuple[Rows, ...]:
    try:
        return tuple((int(a), int(b)) for a, b in value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"rows must be [start, stop) pairs, got {value!r}") from exc


def _int(what: str, value: Any, low: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise InvalidArgumentError(f"{what} must be an int >= {low}, got {value!r}")
    return value


def check_shard(index: Any, count: Any) -> tuple[int, int]:
    """(index, count) once index lies in [0, count).

    Raises:
        InvalidArgumentError: `count` is not an int >= 1, or `index` lies outside.
    """
    count = _int("shard count", count, 1)
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < count:
        raise InvalidArgumentError(f"shard index must be in [0, {count}), got {index!r}")
    return index, count


def row_bytes(spec: TensorSpec) -> int:
    """Bytes of one dim-0 row."""
    return DTYPE_SIZES[spec.dtype] * math.prod(spec.shape[1:])


def chunk_rows(total: int, index: int, count: int) -> Rows:
    """The rows shard `index` of `count` holds under torch.chunk's rule, which FSDP2
    follows: chunks of ceil(total / count) rows; the last may be short, later ones empty."""
    size = -(-total // count)
    start = min(index * size, total)
    return start, min(start + size, total)


def shard_layout(layout: Layout, rows: Sequence[Rows]) -> Layout:
    """How a shard packs its rows of `layout`'s tensors into its slot.

    Args:
        layout: The full layout.
        rows: The [start, stop) rows of dim 0 it holds of each tensor, in order.

    Returns:
        The shard's slot layout, packed as `layout` is.
    """
    specs = [
        TensorSpec(s.name, s.dtype, (stop - start, *s.shape[1:]))
        for s, (start, stop) in zip(layout.specs, rows, strict=True)
    ]
    return plan_layout(specs, bucket_bytes=layout.bucket_bytes, align=layout.align)


@attrs.frozen
class Shard(schema.Record):
    """One publisher's part of a sharded version: where its slot is, and the rows
    [start, stop) of dim 0 it holds of each tensor of the manifest's layout, in order.

    Attributes:
        index: Its place among the shards, in [0, count).
        count: How many shards the version has.
        publisher: The shard publisher's name.
        slot: Its slot's index among that publisher's.
        source: Its slot's descriptor.
        rows: The [start, stop) rows it holds of each tensor.

    Raises:
        InvalidArgumentError: An index outside [0, count), a negative slot, an empty
            publisher, or rows that are not [start, stop) pairs.
    """

    index: int
    count: int
    publisher: str
    slot: int
    source: bytes
    rows: tuple[Rows, ...] = attrs.field(converter=_rows)

    def __attrs_post_init__(self) -> None:
        check_shard(self.index, self.count)
        _int("shard slot", self.slot)
        if not isinstance(self.publisher, str) or not self.publisher:
            raise InvalidArgumentError(f"shard publisher must be a non-empty string, got {self.publisher!r}")

    def check(self, layout: Layout) -> None:
        """Raise unless these rows fit `layout`'s tensors.

        Raises:
            InvalidArgumentError: Rows of a different number of tensors, a tensor without
                dim 0, or rows outside a tensor's.
        """
        if len(self.rows) != len(layout):
            raise InvalidArgumentError(
                f"shard {self.index} names rows of {len(self.rows)} tensors; the layout has {len(layout)}"
            )
        for spec, (start, stop) in zip(layout.specs, self.rows, strict=True):
            if not spec.shape:
                raise InvalidArgumentError(f"tensor {spec.name!r} has no dim 0 to shard")
            if not 0 <= start <= stop <= spec.shape[0]:
                raise InvalidArgumentError(
                    f"shard {self.index}: rows [{start}, {stop}) of {spec.name!r} fall outside its {spec.shape[0]} rows"
                )

    def reads(self, layout: Layout) -> Iterator[tuple[int, int, int]]:
        """(offset in this shard's slot, offset in a full-layout mirror, bytes) of each
        tensor it holds rows of."""
        packed = shard_layout(layout, self.rows)
        for full, mine, (start, _) in zip(layout.placements, packed.placements, self.rows, strict=True):
            if mine.spec.nbytes:
                yield mine.offset, full.offset + start * row_bytes(full.spec), mine.spec.nbytes


def check_shards(layout: Layout, shards: Sequence[Shard]) -> None:
    """Raise unless `shards` are distinct parts of one sharding, each fitting `layout`;
    once all `count` are there, their rows must tile every tensor exactly.

    Raises:
        InvalidArgumentError: Shards of different counts or the same index twice, rows
            that do not fit, or (all there) a gap or an overlap.
    """
    if not shards:
        return
    count = shards[0].count
    indices = [s.index for s in shards]
    if any(s.count != count for s in shards) or len(set(indices)) != len(indices):
        raise InvalidArgumentError(f"shards {sorted(indices)} are not distinct parts of one sharding of {count}")
    for s in shards:
        s.check(layout)
    if len(shards) < count:
        return
    for i, spec in enumerate(layout.specs):
        spans = sorted(s.rows[i] for s in shards if s.rows[i][0] < s.rows[i][1])
        bounds = [0] + [b for span in spans for b in span] + [spec.shape[0]]
        if any(bounds[k] != bounds[k + 1] for k in range(0, len(bounds), 2)):  # a gap or an overlap
            raise InvalidArgumentError(
                f"the shards' rows of {spec.name!r} ({spans}) do not tile its {spec.shape[0]} rows exactly"
            )


@attrs.frozen
class Sharding:
    """A shard publisher's place in a sharded version: shard `index` of `count`. For each
    tensor it publishes, `shapes` gives the full shape and `starts` the first dim-0 row
    it holds; it holds as many rows as its own tensor has. A sharded trainer's rank hands
    one to its `Publisher` (`publish(..., sharding=)`).

    Attributes:
        index: This shard's place, in [0, count).
        count: How many shards the version has.
        shapes: Each tensor's full shape.
        starts: Each tensor's first dim-0 row held here.

    Raises:
        InvalidArgumentError: An index outside [0, count).
    """

    index: int
    count: int
    shapes: Mapping[str, tuple[int, ...]]
    starts: Mapping[str, int]

    def __attrs_post_init__(self) -> None:
        check_shard(self.index, self.count)

    def plan(
        self, local: Sequence[TensorSpec], *, bucket_bytes: int, align: int
    ) -> tuple[Layout, tuple[Rows, ...], Layout]:
        """(the full layout, the rows held of each tensor, this shard's slot layout)
        for the tensors this shard holds, `local`.

        Args:
            local: The tensors this shard holds, as its rank has them.
            bucket_bytes: The bucket size of both layouts.
            align: Their alignment.

        Raises:
            InvalidArgumentError: `shapes` and `starts` do not name exactly the tensors of
                `local`, or a tensor is not a dim-0 slice of its full shape.
        """
        names = [s.name for s in local]
        if set(names) != set(self.shapes) or set(names) != set(self.starts):
            missing = sorted((set(self.shapes) | set(self.starts)) - set(names))
            extra = sorted(set(names) - (set(self.shapes) & set(self.starts)))
            raise InvalidArgumentError(
                f"shard {self.index}: shapes and starts must name exactly the tensors published; "
                f"not published: {missing}, without a shape or start: {extra}"
            )
        full, rows = [], []
        for spec in local:
            shape, start = tuple(self.shapes[spec.name]), self.starts[spec.name]
            if not shape or not spec.shape or spec.shape[1:] != shape[1:]:
                raise InvalidArgumentError(
                    f"shard {self.index}: {spec.name!r} of shape {list(spec.shape)} is not a dim-0 slice "
                    f"of its full shape {list(shape)}"
                )
            stop = _int(f"start of {spec.name!r}", start) + spec.shape[0]
            if stop > shape[0]:
                raise InvalidArgumentError(
                    f"shard {self.index}: rows [{start}, {stop}) of {spec.name!r} exceed its {shape[0]} rows"
                )
            full.append(TensorSpec(spec.name, spec.dtype, shape))
            rows.append((start, stop))
        layout = plan_layout(full, bucket_bytes=bucket_bytes, align=align)
        return layout, tuple(rows), shard_layout(layout, rows)
