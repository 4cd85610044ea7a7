"""`python -m weightpull.integrations.bench.delta`: the counts it bases the delta's unit on."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch")
from weightpull.integrations.bench import delta  # noqa: E402


def test_compare_counts_elements_blocks_and_bytes() -> None:
    old = {"x": np.zeros(100, np.uint16), "y": np.zeros(10, np.uint16)}
    new = {k: v.copy() for k, v in old.items()}
    new["x"][99] = 1  # the last, short block of x (36 elements)
    new["y"][0] = 1  # y's only block (10 elements)
    got = delta.compare(old, new, blocks=(64,))
    assert (got["elements"], got["changed"]) == (110, 2)
    assert got["block_fraction"] == {"64": 2 / 3}
    full = 2 * 110
    assert got["bytes_fraction"]["sparse16"] == (2 * 4 + 4 * 1) / full  # two changes, one chunk's count
    assert got["bytes_fraction"]["sparse32"] == 2 * 6 / full
    assert got["bytes_fraction"]["bitmap"] == (14 + 2 * 2) / full
    assert got["bytes_fraction"]["blocks64"] == (2 * (36 + 10) + 4 * 2) / full


def test_unchanged_versions_cost_no_change() -> None:
    same = {"w": np.arange(4096, dtype=np.uint16)}
    got = delta.compare(same, same, blocks=(64, 1024))
    assert got["changed"] == 0 and got["block_fraction"] == {"64": 0.0, "1024": 0.0}


def test_speed_patches_exactly_and_counts_bytes() -> None:
    got = delta.speed(0.02, 64, nbytes=1 << 20, repeat=1)  # asserts both patches give the new bytes
    n = (1 << 20) // 2
    assert got["sparse"]["delta_bytes"] == int(n * 0.02) * 4 + 4 * (n // delta.CHUNK)
    assert got["blocks"]["delta_bytes"] > got["sparse"]["delta_bytes"]  # 2% at random touches most blocks of 64


def test_wire_publishes_both_forms_and_patches_each_version_exactly() -> None:
    import torch

    g = torch.Generator().manual_seed(0)
    first = {"layers.0.q_proj.weight": torch.randn(256, 128, generator=g), "norm.weight": torch.ones(128)}
    second = {n: t.clone() for n, t in first.items()}
    second["layers.0.q_proj.weight"][0, :8] *= 0.5  # not the block's largest: its scale stays
    second["norm.weight"][:3] = 2.0
    said: list[str] = []
    got = delta.wire([first, second], said.append)  # asserts every pulled copy against the form's own cast
    bf16, fp8 = got["bf16"], got["fp8"]
    assert said == ["bf16: 1 of 1 versions patched from their delta", "fp8: 1 of 1 versions patched from their delta"]
    assert bf16["bytes"] == 2 * (256 * 128 + 128) and fp8["bytes"] < bf16["bytes"]
    assert bf16["read_bytes"] == bf16["delta_bytes"] < bf16["bytes"] / 10  # the patching replica read the delta alone
    assert bf16["classes"]["other"]["changed"] == 3 / 128 and fp8["classes"]["other"]["changed"] > 0
    assert 0 < fp8["classes"]["linear"]["changed"] * (256 * 128 + 8) <= 8  # those e4m3 bytes at most
