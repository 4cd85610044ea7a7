"""The fan-out across emulated hosts in each form of a version (`bench fanout --form`):
delta, fp8 and fp8 delta, each copy checked against the oracle, the delta replicas
patching the base they pulled first.

They need root (CI runs as root), as tests/test_hosts.py does; each test checks that
every namespace it made is gone afterwards, also when the test body failed.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from weightpull.integrations.bench import hosts as hostsmod

from .test_hosts import nothing_left_behind  # noqa: F401  (autouse: every namespace a test made, gone after it)

pytestmark = pytest.mark.skipif(hostsmod.unavailable_reason() is not None, reason=str(hostsmod.unavailable_reason()))

SIZE = 16 << 20  # a Qwen3-shaped model of hidden 256: 16 MiB in bf16


def fp8_share(size: int) -> float:
    """The bytes of the scaled model in block fp8 over its bf16 bytes, from its shapes: each
    linear weight a byte an element and a float32 scale a 128 x 128 block, the rest bf16.
    (0.63 for this model, whose embedding and head are a quarter of its bytes; 0.58 for
    Qwen3-8B's shape, where they are 15%.)"""
    from weightpull.integrations import fp8
    from weightpull.integrations.bench import tensor_parallel

    shapes = tensor_parallel.scaled(size)
    full = sum(2 * math.prod(s) for _, s in shapes)
    out = 0
    for name, shape in shapes:
        if fp8.quantizes(name, shape):
            out += math.prod(shape) + 4 * math.prod(fp8.scale_shape(shape))
        else:
            out += 2 * math.prod(shape)
    return out / full


def _checked(result: dict[str, Any], form: str) -> list[dict[str, Any]]:
    """The run's rows, each copy byte-exact against the oracle and its digests checked."""
    assert result["form"] == form and result["wire_bytes"] > 0, result
    rows: list[dict[str, Any]] = result["rows"]
    for row in rows:
        assert row["byte_exact"] and row["digests_checked"], row
        assert len(row["wire_bytes"]) == len(row["patched"]) == row["replicas"], row
    return rows


def test_each_form_of_a_version_is_byte_exact_and_the_delta_replicas_patch() -> None:
    from weightpull.integrations.bench.fanout import DEFAULT_CHANGED, run_fanout

    common: dict[str, Any] = dict(size=SIZE, bucket=2 << 20, rate="100mbit")
    delta = run_fanout([1], form="delta", **common)  # (three delta replicas patch in the relays' test)
    fp8 = run_fanout([1], form="fp8", **common)
    fp8_delta = run_fanout([2], form="fp8-delta", **common)
    full = delta["full_bytes"]
    assert full == fp8["full_bytes"] == fp8_delta["full_bytes"] == pytest.approx(SIZE, rel=0.01)

    # delta: each replica read the delta section alone (4 bytes a changed bf16 element) and patched its base
    (row,) = _checked(delta, "delta")
    assert row["patched"] == [True] and row["wire_bytes"] == [delta["delta_bytes"]], row
    assert delta["wire_bytes"] == delta["delta_bytes"] == pytest.approx(4 * DEFAULT_CHANGED * full / 2, rel=0.05)
    assert delta["wire_bytes"] / full < 0.05

    # fp8: the whole version, read whole: its e4m3 weights, their scales and the bf16 rest
    (row,) = _checked(fp8, "fp8")
    assert not any(row["patched"]) and fp8["delta_bytes"] is None, row
    assert fp8["wire_bytes"] / full == pytest.approx(fp8_share(SIZE), abs=0.005)
    assert 0.55 < fp8["wire_bytes"] / full < 0.65

    # fp8 delta: the delta of the fp8 version, patched onto the fp8 base: fewer bytes than bf16's
    (row,) = _checked(fp8_delta, "fp8-delta")
    assert all(row["patched"]) and row["wire_bytes"] == [fp8_delta["delta_bytes"]] * 2, row
    assert fp8_delta["version_bytes"] == fp8["version_bytes"]
    assert fp8_delta["wire_bytes"] < 0.05 * fp8["wire_bytes"] and fp8_delta["wire_bytes"] < delta["wire_bytes"]


def test_relays_patch_the_delta_too_and_serve_it() -> None:
    """Three relaying replicas, a reader at the trainer's slot at once (cap 1): each holds
    the base, each reads the delta section alone, from the slot or from a replica that
    patched it already, and patches its own base."""
    from weightpull.integrations.bench.fanout import run_fanout

    result = run_fanout([3], size=SIZE, bucket=2 << 20, rate="100mbit", relays=True, cap=1, form="delta")
    (row,) = _checked(result, "delta")
    assert all(row["patched"]) and row["wire_bytes"] == [result["delta_bytes"]] * 3, row
    assert row["sources"].count("trainer") >= 1 and set(row["sources"]) <= {
        "trainer",
        "replica1",
        "replica2",
        "replica3",
    }, row


def test_a_form_the_bench_cannot_measure_is_refused_before_any_host_is_made() -> None:
    from weightpull.errors import InvalidArgumentError
    from weightpull.integrations.bench.fanout import parse_forms, run_fanout

    assert parse_forms("full,delta, fp8,fp8-delta") == ["full", "delta", "fp8", "fp8-delta"]
    for text in ("", "bf16", "delta,delta"):
        with pytest.raises(InvalidArgumentError, match="--form takes"):
            parse_forms(text)
    with pytest.raises(InvalidArgumentError, match="form must be one of"):
        run_fanout([1], form="int4")
    with pytest.raises(InvalidArgumentError, match="SlicePuller reads its slice"):  # not supported by the core
        run_fanout([1], form="delta", tp=2)
    with pytest.raises(InvalidArgumentError, match="changed must be"):
        run_fanout([1], form="delta", changed=1.5)
