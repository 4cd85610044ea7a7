"""Slices: what one tensor-parallel rank of a replica holds, and the reads that fetch it.

A replica of N ranks declares, per rank, its engine parameters (name, dtype, local shape)
and where each comes from: `Piece`s, each a box of one source tensor of the version, put
at a place in the parameter. That one form says column-parallel (a box along dim 0),
row-parallel (dim 1), vocab-parallel with padding (a box shorter than the parameter;
the rest stays zero), fusions (q/k/v, gate/up: boxes of several tensors along one dim)
and stacked experts (a 2-D box at one index of a 3-D parameter).

`plan_slice` turns a rank's slice and a version's manifest (M trainer shards, each
holding dim-0 rows of every tensor, or one unsharded slot) into reads straight from the
trainer's slots into the rank's mirror: no gathering, no side holding a full tensor. A
read is 2-D (`height` rows of `width` bytes, each a pitch apart on either side); a read
of height 1 is a plain one. Pure: no I/O.

`slice_key` names what a rank's mirror holds, whatever rank holds it: replicas whose
ranks have the same key hold the same bytes of a version, so one may read another's
mirror whole (a sliced relay). `bucket_needs` says, of a version still streamed, how many
of its slot's buckets each read waits for.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import attrs

from .errors import InvalidArgumentError
from .layout import DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES, DTYPE_SIZES, Layout, TensorSpec, plan_layout
from .manifest import Manifest
from .sharding import shard_layout

Span = tuple[int, int]  # [start, stop)


def _spans(value: Iterable[Any]) -> tuple[Span, ...]:
    try:
        return tuple((int(a), int(b)) for a, b in value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"a box is [start, stop) pairs, one per dim; got {value!r}") from exc


def _pieces(value: Iterable[Piece]) -> tuple[Piece, ...]:
    return tuple(value)


def _params(value: Iterable[Param]) -> tuple[Param, ...]:
    return tuple(value)


def _ints(value: Iterable[Any]) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentError(f"a place is one int per dim; got {value!r}") from exc


@attrs.frozen
class Piece:
    """Elements `box` (one [start, stop) per dim) of source tensor `source`, landing in a
    parameter with their first element at `at` (one index per parameter dim). A
    parameter may have more dims than its source: the leading extra ones take extent 1
    (one expert of a stack).

    Raises:
        InvalidArgumentError: `box` is not [start, stop) pairs, or `at` not ints.
    """

    source: str
    box: tuple[Span, ...] = attrs.field(converter=_spans)
    at: tuple[int, ...] = attrs.field(converter=_ints)

    @property
    def extent(self) -> tuple[int, ...]:
        """The box's size along each dim."""
        return tuple(b - a for a, b in self.box)

    @property
    def numel(self) -> int:
        """The elements it covers."""
        return math.prod(self.extent)


@attrs.frozen
class Param:
    """One engine parameter of one rank, and the pieces it is made of. Elements no piece
    covers stay zero (a vocab's padding rows). Made by `replicated`, `sharded`, `vocab`,
    `fuse` and `stack`, or by hand.

    Attributes:
        name: The engine's parameter name.
        dtype: Its dtype, its sources' (reads copy bytes; nothing is cast).
        shape: Its shape on this rank.
        pieces: Where its elements come from.

    Raises:
        InvalidArgumentError: A bad name, dtype or shape, a piece with the wrong number of
            dims or that does not fit, or pieces that overlap.
    """

    name: str
    dtype: str
    shape: tuple[int, ...] = attrs.field(converter=_ints)
    pieces: tuple[Piece, ...] = attrs.field(converter=_pieces)

    def __attrs_post_init__(self) -> None:
        spec = TensorSpec(self.name, self.dtype, self.shape)  # checks the name, dtype and shape
        covered = 0
        for p in self.pieces:
            lead = len(self.shape) - len(p.box)
            if lead < 0 or len(p.at) != len(self.shape):
                raise InvalidArgumentError(
                    f"parameter {self.name!r} of shape {list(self.shape)}: a piece of {p.source!r} with box "
                    f"{list(p.box)} at {list(p.at)} has the wrong number of dims"
                )
            extent = (1,) * lead + p.extent
            if any(a < 0 or a > b for a, b in p.box) or any(
                a < 0 or a + e > d for a, e, d in zip(p.at, extent, self.shape, strict=True)
            ):
                raise InvalidArgumentError(
                    f"parameter {self.name!r} of shape {list(self.shape)}: the piece of {p.source!r} with box "
                    f"{list(p.box)} at {list(p.at)} does not fit"
                )
            covered += p.numel
        if covered > spec.numel:  # overlapping pieces: one element would come from two places
            raise InvalidArgumentError(
                f"parameter {self.name!r}: its pieces cover {covered} elements of its {spec.numel}; they overlap"
            )

    @property
    def spec(self) -> TensorSpec:
        """It as a tensor of the rank's mirror."""
        return TensorSpec(self.name, self.dtype, self.shape)


@attrs.frozen
class RankSlice:
    """What rank `rank` of a replica's `ranks` holds: its parameters, in mirror order.
    A `SlicePuller` pulls it; the vLLM integration records it from the engine.

    Attributes:
        rank: This rank, in [0, ranks).
        ranks: The replica's tensor-parallel size.
        params: Its parameters, in the order its mirror holds them.

    Raises:
        InvalidArgumentError: A rank outside [0, ranks), or no parameter.
    """

    rank: int
    ranks: int
    params: tuple[Param, ...] = attrs.field(converter=_params)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.ranks, int) or self.ranks < 1 or not 0 <= self.rank < self.ranks:
            raise InvalidArgumentError(f"rank must be in [0, ranks) with ranks >= 1, got {self.rank} of {self.ranks}")
        if not self.params:
            raise InvalidArgumentError(f"rank {self.rank}'s slice names no parameter")

    def layout(self, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, align: int = DEFAULT_ALIGN) -> Layout:
        """The rank's mirror: its parameters packed as a slot is.

        Args:
            bucket_bytes: The bucket size to pack by.
            align: The alignment of each parameter.
        """
        return plan_layout([p.spec for p in self.params], bucket_bytes=bucket_bytes, align=align)


# -- building slices ----------------------------------------------------------------------


def split(total: int, rank: int, ranks: int) -> Span:
    """Rank `rank`'s even share of `total` (vLLM's tensor-parallel rule: it must divide).

    Raises:
        InvalidArgumentError: `total` does not split evenly over `ranks`.
    """
    if total % ranks:
        raise InvalidArgumentError(f"{total} does not split evenly over {ranks} ranks")
    size = total // ranks
    return rank * size, (rank + 1) * size


def _whole(shape: Sequence[int]) -> list[Span]:
    return [(0, d) for d in shape]


def replicated(spec: TensorSpec, name: str | None = None) -> Param:
    """The whole tensor on every rank (norms, row-parallel biases).

    Args:
        spec: The version's tensor.
        name: The engine's name for it, if not the tensor's.
    """
    return Param(
        name or spec.name, spec.dtype, spec.shape, [Piece(spec.name, _whole(spec.shape), [0] * len(spec.shape))]
    )


def sharded(spec: TensorSpec, dim: int, rank: int, ranks: int, name: str | None = None) -> Param:
    """Rank `rank`'s share along `dim`: 0 for column-parallel, 1 for row-parallel.

    Args:
        spec: The version's tensor.
        dim: The dim it is split along.
        rank: This rank.
        ranks: The replica's tensor-parallel size.
        name: The engine's name for it, if not the tensor's.

    Raises:
        InvalidArgumentError: The tensor has no dim `dim`, or it does not split evenly.
    """
    if not 0 <= dim < len(spec.shape):
        raise InvalidArgumentError(f"{spec.name!r} of shape {list(spec.shape)} has no dim {dim}")
    box = _whole(spec.shape)
    box[dim] = split(spec.shape[dim], rank, ranks)
    shape = [b - a for a, b in box]
    return Param(name or spec.name, spec.dtype, shape, [Piece(spec.name, box, [0] * len(shape))])


def vocab(spec: TensorSpec, rank: int, ranks: int, *, pad_to: int = 64, name: str | None = None) -> Param:
    """A vocab-parallel embedding (or LM head): the vocab padded up to a multiple of
    `pad_to` (vLLM pads to 64), then split evenly; the padding rows stay zero.

    Args:
        spec: The version's embedding (vocab along dim 0).
        rank: This rank.
        ranks: The replica's tensor-parallel size.
        pad_to: The multiple the vocab is padded up to.
        name: The engine's name for it, if not the tensor's.

    Raises:
        InvalidArgumentError: The padded vocab does not split evenly.
    """
    padded = -(-spec.shape[0] // pad_to) * pad_to
    start, stop = split(padded, rank, ranks)
    shape = (stop - start, *spec.shape[1:])
    real = min(stop, spec.shape[0]) - start
    pieces = []
    if real > 0:
        pieces.append(Piece(spec.name, [(start, start + real), *_whole(spec.shape[1:])], [0] * len(shape)))
    return Param(name or spec.name, spec.dtype, shape, pieces)


def fuse(name: str, parts: Sequence[Param], dim: int = 0) -> Param:
    """`parts` side by side along `dim` in one parameter (q/k/v, gate/up).

    Args:
        name: The fused parameter's name.
        parts: The parameters fused, in order.
        dim: The dim they lie along.

    Raises:
        InvalidArgumentError: No parts, or parts whose dtypes or other dims differ.
    """
    if not parts:
        raise InvalidArgumentError(f"fused parameter {name!r} needs parts")
    first = parts[0]
    for p in parts:
        if (
            p.dtype != first.dtype
            or len(p.shape) != len(first.shape)
            or any(a != b for i, (a, b) in enumerate(zip(p.shape, first.shape, strict=True)) if i != dim)
        ):
            raise InvalidArgumentError(
                f"fused parameter {name!r}: {p.name!r} does not match {first.name!r} beside dim {dim}"
            )
    pieces, offset = [], 0
    for p in parts:
        for piece in p.pieces:
            at = list(piece.at)
            at[dim] += offset
            pieces.append(Piece(piece.source, piece.box, at))
        offset += p.shape[dim]
    shape = list(first.shape)
    shape[dim] = offset
    return Param(name, first.dtype, shape, pieces)


def stack(name: str, parts: Sequence[Param]) -> Param:
    """`parts` (experts) stacked along a new leading dim.

    Args:
        name: The stacked parameter's name.
        parts: One parameter an expert, in order.

    Raises:
        InvalidArgumentError: No parts, or parts of different shapes or dtypes.
    """
    if not parts or any(p.shape != parts[0].shape or p.dtype != parts[0].dtype for p in parts):
        raise InvalidArgumentError(f"stacked parameter {name!r} needs parts of one shape and dtype")
    pieces = [Piece(pc.source, pc.box, [i, *pc.at]) for i, p in enumerate(parts) for pc in p.pieces]
    return Param(name, parts[0].dtype, (len(parts), *parts[0].shape), pieces)


# -- planning reads -----------------------------------------------------------------------


@attrs.frozen
class SliceRead:
    """`height` rows of `width` bytes from trainer shard `shard`'s slot at `src` (rows
    `src_pitch` apart) into the mirror at `dst` (rows `dst_pitch` apart)."""

    shard: int
    src: int
    dst: int
    width: int
    height: int = 1
    src_pitch: int = 0
    dst_pitch: int = 0

    @property
    def nbytes(self) -> int:
        return self.width * self.height

    def rows(self) -> Iterator[tuple[int, int, int]]:
        """(src, dst, bytes) of each row: the 1-D reads this read stands for."""
        for i in range(self.height):
            yield self.src + i * self.src_pitch, self.dst + i * self.dst_pitch, self.width


@attrs.frozen
class SlicePlan:
    """A rank's reads of one version: `mirror` is its layout, `sources[i]` the
    descriptor of shard i's slot, `reads` grouped by shard."""

    version: int
    mirror: Layout
    sources: tuple[bytes, ...]
    reads: tuple[SliceRead, ...]

    @property
    def nbytes(self) -> int:
        """Bytes this rank reads."""
        return sum(r.nbytes for r in self.reads)

    @property
    def pieces(self) -> int:
        """1-D reads it would take without 2-D reads."""
        return sum(r.height for r in self.reads)


def _strides(shape: Sequence[int], size: int) -> list[int]:
    out, step = [], size
    for d in reversed(shape):
        out.append(step)
        step *= d
    return out[::-1]


def _box_reads(
    shard: int,
    size: int,
    src: tuple[int, Sequence[int], Sequence[int]],
    dst: tuple[int, Sequence[int], Sequence[int]],
    extent: Sequence[int],
) -> Iterator[SliceRead]:
    """The 2-D reads copying a box of `extent` from one row-major array to another; each
    side is (base offset, array shape, box start), the destination's array with as many
    or more dims (the extra leading ones at the box start's index)."""
    if not all(extent):
        return
    s_base, s_shape, s_start = src
    d_base, d_shape, d_start = dst
    lead = len(d_shape) - len(s_shape)
    s_st = _strides(s_shape, size)
    d_st = _strides(d_shape, size)[lead:]
    s0 = s_base + sum(a * st for a, st in zip(s_start, s_st, strict=True))
    d0 = d_base + sum(a * st for a, st in zip(d_start, _strides(d_shape, size), strict=True))
    n = len(extent)
    # Merge inner dims while the run stays contiguous on both sides.
    run, j = size, n - 1
    while j >= 0 and run == s_st[j] and run == d_st[j]:
        run *= extent[j]
        j -= 1
    if j < 0:  # the whole box is one run
        yield SliceRead(shard, s0, d0, run)
        return
    # Dim j is the 2-D read's rows; dims outside it are enumerated.
    for outer in itertools.product(*(range(e) for e in extent[:j])):
        so = s0 + sum(i * st for i, st in zip(outer, s_st, strict=False))
        do = d0 + sum(i * st for i, st in zip(outer, d_st, strict=False))
        if extent[j] == 1:
            yield SliceRead(shard, so, do, run)
        else:
            yield SliceRead(shard, so, do, run, extent[j], s_st[j], d_st[j])


def _merge(reads: list[SliceRead]) -> list[SliceRead]:
    """Join plain reads that continue one another on both sides."""
    out: list[SliceRead] = []
    for r in sorted(reads, key=lambda r: (r.shard, r.src)):
        last = out[-1] if out else None
        if (
            last is not None
            and last.height == 1
            and r.height == 1
            and last.shard == r.shard
            and last.src + last.width == r.src
            and last.dst + last.width == r.dst
        ):
            out[-1] = attrs.evolve(last, width=last.width + r.width)
        else:
            out.append(r)
    return out


def plan_slice(
    manifest: Manifest,
    rank_slice: RankSlice,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    align: int = DEFAULT_ALIGN,
) -> SlicePlan:
    """The reads that fill rank `rank_slice.rank`'s mirror from `manifest`'s slots.

    Each piece's dim-0 span is cut at the trainer shards' row boundaries; each cut is a
    box of that shard's packed tensor, read as 2-D reads where rows are strided (a
    row-parallel share) and as one run where they are not.

    Args:
        manifest: The version's manifest (every shard's, for a sharded one).
        rank_slice: What the rank holds.
        bucket_bytes: The bucket size of the rank's mirror.
        align: The alignment of its parameters.

    Returns:
        The rank's mirror layout, the shards' descriptors and the reads.

    Raises:
        InvalidArgumentError: The manifest is missing shards, a piece names a tensor the
            version lacks or reaches outside it, or dtypes differ (reads copy bytes;
            nothing is cast).
    """
    if not manifest.complete:
        raise InvalidArgumentError(f"v{manifest.version} is missing shards; a slice is planned from all of them")
    full = manifest.layout
    mirror = rank_slice.layout(bucket_bytes=bucket_bytes, align=align)
    if manifest.shards:
        shards = manifest.shards
        sources = tuple(s.source for s in shards)
        packed = [shard_layout(full, s.rows) for s in shards]
        rows = [s.rows for s in shards]
    else:  # one slot holding every row, packed as the full layout
        sources, packed = (manifest.source,), [full]
        rows = [tuple((0, s.shape[0] if s.shape else 1) for s in full.specs)]
    index = {spec.name: i for i, spec in enumerate(full.specs)}
    reads: list[SliceRead] = []
    for param in rank_slice.params:
        where = mirror[param.name]
        for piece in param.pieces:
            t = index.get(piece.source)
            if t is None:
                raise InvalidArgumentError(
                    f"parameter {param.name!r}: v{manifest.version} has no tensor {piece.source!r}"
                )
            spec = full.specs[t]
            if spec.dtype != param.dtype:
                raise InvalidArgumentError(
                    f"parameter {param.name!r} is {param.dtype}; its source {spec.name!r} is {spec.dtype}"
                )
            if len(piece.box) != len(spec.shape) or any(
                not 0 <= a <= b <= d for (a, b), d in zip(piece.box, spec.shape, strict=True)
            ):
                raise InvalidArgumentError(
                    f"parameter {param.name!r}: box {list(piece.box)} lies outside {spec.name!r} of shape {list(spec.shape)}"
                )
            size = DTYPE_SIZES[spec.dtype]
            if not spec.shape:  # a scalar: unsharded, one read
                reads.append(SliceRead(0, packed[0].placements[t].offset, where.offset, size))
                continue
            lo, hi = piece.box[0]
            for s, (a, b) in enumerate(r[t] for r in rows):
                cut_lo, cut_hi = max(lo, a), min(hi, b)
                if cut_lo >= cut_hi:
                    continue
                held = (b - a, *spec.shape[1:])
                start = (cut_lo - a, *(x for x, _ in piece.box[1:]))
                extent = (cut_hi - cut_lo, *piece.extent[1:])
                lead = len(param.shape) - len(spec.shape)
                at = list(piece.at)
                at[lead] += cut_lo - lo
                reads += _box_reads(
                    s,
                    size,
                    (packed[s].placements[t].offset, held, start),
                    (where.offset, param.shape, at),
                    extent,
                )
    return SlicePlan(manifest.version, mirror, sources, tuple(_merge(reads)))


# -- naming a layout, and streaming ---------------------------------------------------------

SLICE_KEY_PREFIX = "slice-"


def slice_key(rank_slice: RankSlice, *, bucket_bytes: int = DEFAULT_BUCKET_BYTES, align: int = DEFAULT_ALIGN) -> str:
    """A stable name for what `rank_slice`'s mirror holds: a digest of its mirror's
    packing and every piece's box (source tensor, box, place), not of the rank's number,
    so two ranks that hold the same elements in the same places share it. Two mirrors of
    one key hold the same bytes of any one version; a relay of a slice serves readers of
    its key alone (`SlicePuller(host=...)`).

    Args:
        rank_slice: What the rank holds.
        bucket_bytes: The bucket size its mirror is packed by.
        align: The alignment its mirror is packed by.

    Returns:
        ``slice-`` and 32 hex digits (BLAKE2b-128 of the canonical form).
    """
    form = {
        "mirror": rank_slice.layout(bucket_bytes=bucket_bytes, align=align).signature,
        "params": [
            [p.name, p.dtype, list(p.shape), [[c.source, [list(b) for b in c.box], list(c.at)] for c in p.pieces]]
            for p in rank_slice.params
        ],
    }
    text = json.dumps(form, separators=(",", ":"), sort_keys=True)
    return SLICE_KEY_PREFIX + hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def bucket_needs(plan: SlicePlan, layout: Layout) -> tuple[int, ...]:
    """For each read of `plan`, made from one slot packed as `layout` (an unsharded
    version), how many of the slot's first buckets must be committed before it may be
    made: one more than the index of the bucket its last byte lies in. A version is
    streamed in bucket order, so a read may start once that many are marked."""
    starts = [b.offset for b in layout.buckets]
    needs = []
    for r in plan.reads:
        last = r.src + (r.height - 1) * r.src_pitch + r.width - 1
        needs.append(max(1, bisect.bisect_right(starts, last)))
    return tuple(needs)
