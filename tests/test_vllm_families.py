"""The tiny model families behind tests/vllm_families.py: no engine, a few seconds."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.vllm_families import PROMPTS, compare
from weightpull.integrations.vllm.tiny import FAMILIES, base_weights, make_model, save, version_weights


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpoint_names_are_what_save_pretrained_writes(family, tmp_path):
    model = make_model(family)
    base = base_weights(model)
    checkpoint = version_weights(model, base, 3, names="checkpoint")
    written = load_file(save(model, tmp_path, torch.float32) / "model.safetensors")
    assert written.keys() == checkpoint.keys()
    assert all(torch.equal(written[k], checkpoint[k]) for k in written)
    state = version_weights(model, base, 3, names="state_dict")
    assert state.keys() == model.state_dict().keys()
    if family == "llama-tied":
        assert "lm_head.weight" in state and "lm_head.weight" not in checkpoint
    if family == "qwen3-moe":  # fused 3-D in state_dict(), per expert in the checkpoint
        assert state["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 128, 128)
        assert checkpoint["model.layers.0.mlp.experts.3.gate_proj.weight"].shape == (64, 128)
        assert not any(".experts.gate_up_proj" in k for k in checkpoint)


def test_versions_are_reproducible_and_differ():
    a, b = make_model("qwen3"), make_model("qwen3")
    base_a, base_b = base_weights(a), base_weights(b)
    v1 = version_weights(a, base_a, 1)
    assert all(torch.equal(v1[k], t) for k, t in version_weights(b, base_b, 1).items())
    assert not torch.equal(v1["model.embed_tokens.weight"], version_weights(b, base_b, 2)["model.embed_tokens.weight"])


def test_compare_names_each_difference():
    run = [{"tokens": [1, 2], "logprob": -1.0, "cached": 0} for _ in PROMPTS]
    other = [dict(r) for r in run]
    other[2] = {"tokens": [1, 3], "logprob": -1.5, "cached": 96}
    assert compare(run, [dict(r, cached=96) for r in run]) == []
    assert compare(run, other) == [
        "long-again: tokens [1, 3] != [1, 2]",
        "long-again: first-token logprob -1.5 != -1.0",
    ]
