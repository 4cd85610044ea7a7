"""The verifiable task the demo's trainer learns: reverse a short string of digits.

A prompt is BOS, `digits` digits, SEP; the answer is the digits reversed, one token each.
The reward is per digit (1 where the token is right), so a group of samples of one prompt
gives each position its own advantage (GRPO's group baseline, per token) and an untrained
model still earns some reward. The model is a tiny Llama vLLM serves as it is.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

BOS, SEP = 1, 2
DIGIT0 = 4  # token of the digit 0; 4..13 are the digits
VOCAB = 64  # a multiple of 64: vLLM pads the vocabulary to one, and a padded embedding would not load whole

CONFIG = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=64,  # vLLM's CPU attention takes 64 and 128
    vocab_size=VOCAB,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    bos_token_id=BOS,
    eos_token_id=3,
    pad_token_id=0,
)


def make_model(seed: int = 0) -> Any:
    """The tiny Llama (float32), seeded: every trainer rank makes the same one."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**CONFIG)).to(torch.float32)


def save_model(path: str | Path, seed: int = 0) -> None:
    """What the replicas start from (their agents load every version over it)."""
    make_model(seed).save_pretrained(path)


def prompt_tokens(rng: random.Random, digits: int) -> list[int]:
    return [BOS, *(DIGIT0 + rng.randrange(10) for _ in range(digits)), SEP]


def answer(prompt: list[int]) -> list[int]:
    return list(reversed(prompt[1:-1]))


def rewards(prompt: list[int], completion: list[int] | tuple[int, ...]) -> list[float]:
    """Per position: 1.0 where the completion's token is the right digit."""
    want = answer(prompt)
    got = list(completion) + [-1] * (len(want) - len(completion))
    return [float(g == w) for g, w in zip(got, want, strict=False)]
