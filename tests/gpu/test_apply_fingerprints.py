"""The vLLM worker's apply check on the GPU, without vLLM (which cannot run on the GPU
machine): fingerprints taken where the weights live, on model-shaped tensors, agree with
the host's for the same bytes and catch a weight the apply left behind."""

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
    assert result["exact"] and result["check_ms"] > 0 and result["bytes"] > 16e9
