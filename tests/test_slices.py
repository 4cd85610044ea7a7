"""The slice planner: every rank's reads from M trainer shards rebuild exactly the slice a
full tensor would give, reading only that rank's share plus what it replicates."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightpull.errors import InvalidArgumentError
from weightpull.layout import TensorSpec, plan_layout
from weightpull.manifest import Manifest
from weightpull.sharding import Shard, chunk_rows, shard_layout
from weightpull.slices import (
    Param,
    Piece,
    RankSlice,
    SlicePlan,
    fuse,
    plan_slice,
    replicated,
    sharded,
    stack,
    vocab,
)

DTYPE = "int32"  # every element distinct, so a misplaced one shows


def _version(specs: list[TensorSpec], cuts: list[list[tuple[int, int]]] | None, seed: int = 0):
    """A version of `specs` (random values) as a manifest and its slots' bytes; `cuts[s]`
    are shard s's rows of each tensor (None: one unsharded slot)."""
    rng = np.random.default_rng(seed)
    full = {s.name: rng.integers(-(2**31), 2**31 - 1, size=s.shape, dtype=np.int32) for s in specs}
    layout = plan_layout(specs, bucket_bytes=4096, align=64)
    if cuts is None:
        slot = bytearray(layout.total_bytes)
        for p in layout.placements:
            slot[p.offset : p.end] = full[p.spec.name].tobytes()
        return Manifest(1, layout, "fake", b"slot", 0, "trainer"), [slot], full
    shards, slots = [], []
    for i, rows in enumerate(cuts):
        packed = shard_layout(layout, rows)
        slot = bytearray(packed.total_bytes)
        for p, (a, b) in zip(packed.placements, rows, strict=True):
            slot[p.offset : p.end] = full[p.spec.name][a:b].tobytes()
        shards.append(Shard(i, len(cuts), f"trainer-{i}", i, f"slot-{i}".encode(), rows))
        slots.append(slot)
    first = shards[0]
    manifest = Manifest(1, layout, "fake", first.source, first.slot, first.publisher, shards=shards)
    return manifest, slots, full


def _run(plan: SlicePlan, slots: list[bytearray]) -> bytearray:
    """Make the plan's reads, row by row, as a transport without 2-D reads would."""
    mirror = bytearray(plan.mirror.total_bytes)
    for read in plan.reads:
        for src, dst, n in read.rows():
            mirror[dst : dst + n] = slots[read.shard][src : src + n]
    return mirror


def _param(plan: SlicePlan, mirror: bytearray, name: str) -> np.ndarray:
    p = plan.mirror[name]
    return np.frombuffer(bytes(mirror[p.offset : p.end]), dtype=np.int32).reshape(p.spec.shape)


# -- a tiny transformer-shaped model, and each rank's slice of it as vLLM lays it out -----


def _model(vocab_size: int, hidden: int, heads: int, kv: int, inter: int, experts: int) -> list[TensorSpec]:
    hd = 2
    specs = [
        TensorSpec("embed", DTYPE, (vocab_size, hidden)),
        TensorSpec("norm", DTYPE, (hidden,)),
        TensorSpec("q", DTYPE, (heads * hd, hidden)),
        TensorSpec("k", DTYPE, (kv * hd, hidden)),
        TensorSpec("v", DTYPE, (kv * hd, hidden)),
        TensorSpec("q_bias", DTYPE, (heads * hd,)),
        TensorSpec("o", DTYPE, (hidden, heads * hd)),
        TensorSpec("o_bias", DTYPE, (hidden,)),
        TensorSpec("gate", DTYPE, (inter, hidden)),
        TensorSpec("up", DTYPE, (inter, hidden)),
        TensorSpec("down", DTYPE, (hidden, inter)),
    ]
    for e in range(experts):
        specs += [
            TensorSpec(f"e{e}.gate", DTYPE, (inter, hidden)),
            TensorSpec(f"e{e}.up", DTYPE, (inter, hidden)),
            TensorSpec(f"e{e}.down", DTYPE, (hidden, inter)),
        ]
    return specs


def _slice(specs: list[TensorSpec], rank: int, ranks: int, experts: int) -> RankSlice:
    by = {s.name: s for s in specs}
    params = [
        vocab(by["embed"], rank, ranks, pad_to=2 * ranks),
        replicated(by["norm"]),
        fuse("qkv", [sharded(by[n], 0, rank, ranks) for n in ("q", "k", "v")]),
        sharded(by["q_bias"], 0, rank, ranks),
        sharded(by["o"], 1, rank, ranks),
        replicated(by["o_bias"]),
        fuse("gate_up", [sharded(by["gate"], 0, rank, ranks), sharded(by["up"], 0, rank, ranks)]),
        sharded(by["down"], 1, rank, ranks),
    ]
    if experts:  # experts tensor-parallel within each, as vLLM's fused MoE does
        mine = range(experts)
        params.append(
            stack(
                "w13",
                [fuse(f"w13.{e}", [sharded(by[f"e{e}.{n}"], 0, rank, ranks) for n in ("gate", "up")]) for e in mine],
            )
        )
        params.append(stack("w2", [sharded(by[f"e{e}.down"], 1, rank, ranks) for e in mine]))
    return RankSlice(rank, ranks, params)


def _want(full: dict[str, np.ndarray], rank: int, ranks: int, experts: int) -> dict[str, np.ndarray]:
    """What each parameter of rank `rank` holds, by numpy on the full tensors."""

    def part(name: str, dim: int) -> np.ndarray:
        return np.split(full[name], ranks, axis=dim)[rank]

    emb = full["embed"]
    pad = 2 * ranks
    padded = np.zeros((-(-emb.shape[0] // pad) * pad, emb.shape[1]), dtype=emb.dtype)
    padded[: emb.shape[0]] = emb
    want = {
        "embed": np.split(padded, ranks)[rank],
        "norm": full["norm"],
        "qkv": np.concatenate([part(n, 0) for n in ("q", "k", "v")]),
        "q_bias": part("q_bias", 0),
        "o": part("o", 1),
        "o_bias": full["o_bias"],
        "gate_up": np.concatenate([part("gate", 0), part("up", 0)]),
        "down": part("down", 1),
    }
    if experts:
        want["w13"] = np.stack([np.concatenate([part(f"e{e}.gate", 0), part(f"e{e}.up", 0)]) for e in range(experts)])
        want["w2"] = np.stack([part(f"e{e}.down", 1) for e in range(experts)])
    return want


@st.composite
def _cases(draw):
    ranks = draw(st.sampled_from([1, 2, 3, 4]))
    shards = draw(st.integers(1, 5))
    kv = draw(st.integers(1, 2)) * ranks
    heads = kv * draw(st.integers(1, 2))
    hidden = draw(st.integers(1, 3)) * ranks
    inter = draw(st.integers(1, 3)) * ranks
    vocab_size = draw(st.integers(1, 13)) * ranks
    experts = draw(st.integers(0, 2))
    specs = _model(vocab_size, hidden, heads, kv, inter, experts)
    even = draw(st.booleans())
    cuts = []  # shard i's rows of each tensor: FSDP2's chunks, or uneven random cuts
    bounds = {
        s.name: sorted(draw(st.lists(st.integers(0, s.shape[0]), min_size=shards - 1, max_size=shards - 1)))
        for s in specs
    }
    for i in range(shards):
        rows = []
        for s in specs:
            if even:
                rows.append(chunk_rows(s.shape[0], i, shards))
            else:
                b = [0, *bounds[s.name], s.shape[0]]
                rows.append((b[i], b[i + 1]))
        cuts.append(rows)
    return specs, cuts, ranks, experts, draw(st.booleans())


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_cases())
def test_every_rank_gets_exactly_its_slice_from_any_shards(case):
    specs, cuts, ranks, experts, unsharded = case
    manifest, slots, full = _version(specs, None if unsharded else cuts)
    replicated_bytes = 4 * sum(full[n].size for n in ("norm", "o_bias"))
    whole = 4 * sum(a.size for a in full.values())
    read_total = 0
    for rank in range(ranks):
        plan = plan_slice(manifest, _slice(specs, rank, ranks, experts))
        mirror = _run(plan, slots)
        for name, want in _want(full, rank, ranks, experts).items():
            np.testing.assert_array_equal(_param(plan, mirror, name), want, err_msg=f"rank {rank} {name}")
        # No byte read twice, none read that the rank does not keep.
        spans = sorted((r.shard, s, s + n) for r in plan.reads for s, _, n in r.rows())
        assert all(a[0] != b[0] or a[2] <= b[1] for a, b in zip(spans, spans[1:], strict=False))
        dsts = sorted((d, d + n) for r in plan.reads for _, d, n in r.rows())
        assert all(a[1] <= b[0] for a, b in zip(dsts, dsts[1:], strict=False))
        read_total += plan.nbytes - replicated_bytes
    # Over all ranks, everything but the replicated tensors is read exactly once.
    assert read_total == whole - replicated_bytes


def test_row_parallel_share_is_one_2d_read_per_shard():
    """A row-parallel weight's share, from M shards, is M 2-D reads, not a row each."""
    spec = TensorSpec("o", DTYPE, (64, 32))
    cuts = [[chunk_rows(64, i, 2)] for i in range(2)]
    manifest, slots, full = _version([spec], cuts)
    plan = plan_slice(manifest, RankSlice(1, 4, [sharded(spec, 1, 1, 4)]))
    assert len(plan.reads) == 2 and plan.pieces == 64
    assert {(r.width, r.height, r.src_pitch, r.dst_pitch) for r in plan.reads} == {(32, 32, 128, 32)}
    np.testing.assert_array_equal(_param(plan, _run(plan, slots), "o"), full["o"][:, 8:16])


def test_column_parallel_share_is_one_read_per_shard_it_spans():
    spec = TensorSpec("q", DTYPE, (12, 8))
    cuts = [[chunk_rows(12, i, 3)] for i in range(3)]  # rows 0-4, 4-8, 8-12
    manifest, slots, full = _version([spec], cuts)
    plan = plan_slice(manifest, RankSlice(0, 2, [sharded(spec, 0, 0, 2)]))  # rows 0-6: shards 0 and 1
    assert [(r.shard, r.height, r.nbytes) for r in plan.reads] == [(0, 1, 4 * 8 * 4), (1, 1, 2 * 8 * 4)]
    np.testing.assert_array_equal(_param(plan, _run(plan, slots), "q"), full["q"][:6])


def test_bad_slices_are_refused_by_name():
    spec = TensorSpec("w", DTYPE, (4, 4))
    manifest, _, _ = _version([spec], None)
    with pytest.raises(InvalidArgumentError, match="no tensor 'nope'"):
        plan_slice(manifest, RankSlice(0, 1, [Param("w", DTYPE, (4, 4), [Piece("nope", [(0, 4), (0, 4)], [0, 0])])]))
    with pytest.raises(InvalidArgumentError, match="lies outside 'w'"):
        plan_slice(manifest, RankSlice(0, 1, [Param("w", DTYPE, (5, 4), [Piece("w", [(0, 5), (0, 4)], [0, 0])])]))
    with pytest.raises(InvalidArgumentError, match="is float32; its source 'w' is int32"):
        plan_slice(manifest, RankSlice(0, 1, [replicated(TensorSpec("w", "float32", (4, 4)))]))
    with pytest.raises(InvalidArgumentError, match="does not fit"):
        Param("w", DTYPE, (2, 4), [Piece("w", [(0, 4), (0, 4)], [0, 0])])
    with pytest.raises(InvalidArgumentError, match="they overlap"):
        Param("w", DTYPE, (4, 4), [Piece("w", [(0, 4), (0, 4)], [0, 0]), Piece("w", [(0, 1), (0, 1)], [0, 0])])
    with pytest.raises(InvalidArgumentError, match="does not split evenly"):
        sharded(spec, 1, 0, 3)
    with pytest.raises(InvalidArgumentError, match=r"rank must be in \[0, ranks\)"):
        RankSlice(2, 2, [replicated(spec)])
    half = Shard(0, 2, "t0", 0, b"s0", [(0, 2)])  # one shard of two: not yet complete
    partial = Manifest(1, manifest.layout, "fake", b"s0", 0, "t0", shards=[half])
    with pytest.raises(InvalidArgumentError, match="missing shards"):
        plan_slice(partial, RankSlice(0, 1, [replicated(spec)]))
