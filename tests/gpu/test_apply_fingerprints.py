"""The vLLM worker's apply check on the GPU, without vLLM: fingerprints taken where the
weights live, on model-shaped tensors, agree with the host's for the same bytes (the
Triton kernels: one tensor at a time, and a whole set in one launch) and catch a weight the
apply left behind."""

from __future__ import annotations

import torch

from weightpull.integrations.bench.gpu import bench_apply_check, make_tensors
from weightpull.integrations.torch_tensors import fingerprints

SHAPES = [
    ("model.embed_tokens.weight", (1000, 256)),
    ("model.layers.0.self_attn.qkv_proj.weight", (768, 256)),
    ("model.layers.0.mlp.experts.w13_weight", (4, 512, 256)),
    ("model.norm.weight", (256,)),
]


def test_fingerprints_on_the_gpu_equal_the_hosts_and_show_a_stale_weight():
    mirror = make_tensors(SHAPES, "cuda:0", seed=2)
    weights = {name: torch.empty_like(t) for name, t in mirror.items()}
    for name, t in mirror.items():  # the apply
        weights[name].copy_(t)
    on_gpu = fingerprints(weights)
    assert on_gpu == fingerprints({n: t.cpu() for n, t in mirror.items()})
    weights["model.layers.0.mlp.experts.w13_weight"][3].copy_(make_tensors(SHAPES, "cuda:0", seed=1)[SHAPES[2][0]][3])
    stale = fingerprints(weights)
    assert [n for n in on_gpu if on_gpu[n] != stale[n]] == ["model.layers.0.mlp.experts.w13_weight"]


def test_the_apply_check_bench_runs_and_is_exact():
    result = bench_apply_check(1, lambda line: None)
    assert result["exact"] and result["bytes"] > 16e9 and result["fingerprint_by"] == "triton"
    assert result["check_over_apply"] == round(result["check_ms"] / result["apply_ms"], 2)
    assert result["kernel_settings"] and all(k["same"] for k in result["kernel_settings"])


def test_the_triton_kernel_is_the_one_taken_and_equals_the_hosts_on_the_same_bytes():
    import pytest

    from weightpull.integrations.torch_tensors import fingerprint_implementation

    assert fingerprint_implementation() == "triton"  # Triton comes with torch on a CUDA machine
    generator = torch.Generator(device="cuda:0").manual_seed(4)
    cases = {
        "bf16 odd": torch.randn(4097, 3, device="cuda:0", generator=generator).bfloat16(),  # 2-byte words
        "fp32": torch.randn(65521 * 3 + 1, device="cuda:0", generator=generator),  # 4-byte words
        "int64 spans": torch.randint(-(2**62), 2**62, (2048 * 16 * 3 + 5,), device="cuda:0", generator=generator),
        "uint8 odd": torch.randint(0, 256, (131071,), device="cuda:0", generator=generator, dtype=torch.uint8),
        "fp16 one": torch.ones(1, device="cuda:0", dtype=torch.float16),
        "large": torch.randint(0, 256, ((1 << 31) + 24,), device="cuda:0", generator=generator, dtype=torch.uint8),
    }
    cases["misaligned"] = torch.randint(0, 256, (4099,), device="cuda:0", generator=generator, dtype=torch.uint8)[3:]
    cases["empty"] = torch.empty(0, device="cuda:0")
    on_gpu = fingerprints(cases)  # more than FEW tensors: the set kernel (one launch per word width)
    on_host = fingerprints({n: t.cpu() for n, t in cases.items()})
    assert on_gpu == on_host
    assert [fingerprints({n: t})[n] for n, t in cases.items()] == list(on_host.values())  # one at a time
    del cases["empty"]
    for name, t in cases.items():
        raw = t.view(-1).view(torch.uint8)
        raw[raw.numel() // 2] ^= 1  # one bit, somewhere in the middle
        assert fingerprints({name: t})[name] != on_gpu[name], name
    if on_gpu["large"] == 0:
        pytest.fail("the large tensor's fingerprint is 0: its programs past 2**31 bytes did nothing")


def test_a_set_kernel_that_does_not_build_falls_back_to_one_launch_per_tensor_loudly(monkeypatch):
    import pytest
    import triton

    from weightpull.integrations import fingerprint_kernel
    from weightpull.integrations.torch_tensors import fingerprint_tensors

    tensors = [torch.randn(1000 + i, 64, device="cuda:0") for i in range(6)]
    want = fingerprint_tensors(tensors)

    def fails(*args, **kwargs):
        raise triton.CompilationError(None, None, "not here")

    monkeypatch.setattr(fingerprint_kernel, "_group", fails)
    monkeypatch.setattr(fingerprint_kernel, "SET_KERNEL_FAILED", [])
    with pytest.warns(UserWarning, match="one launch per tensor"):
        assert torch.equal(fingerprint_tensors(tensors), want)
    assert fingerprint_kernel.SET_KERNEL_FAILED and torch.equal(fingerprint_tensors(tensors), want)
