"""The apply's paths on a real vLLM engine on the GPU (where vLLM is installed: the H200
script's `tests` job; tests/test_vllm_apply_paths.py runs the same engine process on the
CPU): on a GPU every layer that holds weights, the embedding and the head too, loads
straight into the kernels' tensors, the check copies nothing and fingerprints by Triton,
and every path leaves the same bytes and outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM on the GPU: docs/results/scripts/h200-vllm.sh installs it and runs this")


@pytest.fixture(scope="module")
def report() -> dict:
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "ERROR"}
    done = subprocess.run(
        [sys.executable, "-m", "tests.test_vllm_apply_paths"],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
        cwd=Path(__file__).parent.parent.parent,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_on_a_gpu_every_layer_with_weights_loads_straight_and_every_path_agrees(report):
    straight = set(report["identity"])
    assert {"model.embed_tokens", "lm_head", "model.norm", "model.layers.1.mlp.gate_up_proj"} <= straight
    assert "model.layers.0.self_attn.attn" not in straight
    paths = report["paths"]
    assert len({json.dumps(p["state"], sort_keys=True) for p in paths.values()}) == 1
    assert len({json.dumps(p["tokens"]) for p in paths.values()}) == 1
    assert report["v1_tokens"] != paths["direct"]["tokens"]
    direct = paths["direct"]["report"]
    assert direct["direct"] == len(straight) and direct["layers"] == 0 and direct["scratch"] == 0
    assert direct["checked"] == len(straight) and direct["fingerprint_by"] == "triton"
    assert paths["layerwise"]["report"]["scratch"] == 0  # identity layers: checked as loaded, no copy
    assert paths["reference"]["report"]["scratch"] == paths["reference"]["report"]["layers"] > 0


def test_on_a_gpu_the_direct_path_refuses_a_partial_or_clobbered_layer(report):
    errors = report["errors"]
    assert errors["partial"].startswith("IncompleteApplyError") and "layers.1.self_attn.qkv_proj" in errors["partial"]
    assert (
        errors["clobbered"].startswith("ApplyCheckError") and "layers.0.input_layernorm.weight" in errors["clobbered"]
    )
    assert report["restored_tokens"] == report["paths"]["direct"]["tokens"]
