"""A tiny random Llama, made locally, for the vLLM demo and tests: no downloads.

The "trainer" is Hugging Face transformers' own model; each version's weights are the
base weights plus noise seeded by the version, so anyone can rebuild any version.
`hf_greedy` is the reference a replica's greedy output must equal.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

CONFIG = dict(
    hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
    vocab_size=1024, max_position_embeddings=512, tie_word_embeddings=False,
)


def make_tiny_llama(path: str | Path, seed: int = 0) -> Any:
    """Save a random float32 Llama (hidden 128, 2 layers, vocab 1024) to `path`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.float32).eval()
    model.save_pretrained(path)
    return model


def set_version(model: Any, base: dict[str, torch.Tensor], version: int, scale: float = 0.05) -> dict[str, torch.Tensor]:
    """Load version `version` into `model` (the trainer's step) and return its state dict,
    named as the checkpoint names them."""
    g = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(base[name] + scale * torch.randn(p.shape, generator=g))
    return dict(model.state_dict())


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy continuation of `prompt` (never stopping early)."""
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()
