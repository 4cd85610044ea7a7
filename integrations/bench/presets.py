"""Tensor sets shaped like real models, by name: what a publish moves.

One generator: `qwen3_shaped`, a meta-device Qwen3 (the FSDP bench's model too), read for
its parameter names and shapes, with tied embeddings left out as checkpoints leave them.
"""

from __future__ import annotations

import math
from typing import Any

import attrs


def qwen3_shaped(layers: int, hidden: int, inter: int, vocab: int, heads: int, kv_heads: int, head_dim: int) -> Any:
    """Qwen3's tensors under their checkpoint names, on the meta device (no forward)."""
    import torch
    from torch import nn

    def linear(n_out: int, n_in: int) -> nn.Module:
        return nn.Linear(n_in, n_out, bias=False)

    def norm(n: int) -> nn.Module:
        m = nn.Module()
        m.weight = nn.Parameter(torch.empty(n))
        return m

    def layer() -> nn.Module:
        attn = nn.Module()
        attn.q_proj, attn.k_proj = linear(heads * head_dim, hidden), linear(kv_heads * head_dim, hidden)
        attn.v_proj, attn.o_proj = linear(kv_heads * head_dim, hidden), linear(hidden, heads * head_dim)
        attn.q_norm, attn.k_norm = norm(head_dim), norm(head_dim)
        mlp = nn.Module()
        mlp.gate_proj, mlp.up_proj, mlp.down_proj = linear(inter, hidden), linear(inter, hidden), linear(hidden, inter)
        m = nn.Module()
        m.input_layernorm, m.self_attn, m.post_attention_layernorm, m.mlp = norm(hidden), attn, norm(hidden), mlp
        return m

    with torch.device("meta"):
        body = nn.Module()
        body.embed_tokens = nn.Embedding(vocab, hidden)
        body.layers = nn.ModuleList(layer() for _ in range(layers))
        body.norm = norm(hidden)
        model = nn.Module()
        model.model, model.lm_head = body, linear(vocab, hidden)
    return model


@attrs.frozen
class Preset:
    name: str
    model: str  # what it is shaped like
    layers: int
    hidden: int
    inter: int
    vocab: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool  # lm_head shares the embedding, so it is not published twice

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        model = qwen3_shaped(self.layers, self.hidden, self.inter, self.vocab, self.heads, self.kv_heads, self.head_dim)
        return [(n, tuple(p.shape)) for n, p in model.named_parameters() if not (self.tied and n == "lm_head.weight")]

    def bf16_bytes(self) -> int:
        return sum(2 * math.prod(s) for _, s in self.shapes())


PRESETS = {
    p.name: p
    for p in (
        Preset("tiny", "a toy Qwen3 (for tests)", 2, 64, 128, 512, 4, 2, 16, tied=True),
        Preset("0.6b", "Qwen3-0.6B", 28, 1024, 3072, 151936, 16, 8, 128, tied=True),
        Preset("8b", "Qwen3-8B", 36, 4096, 12288, 151936, 32, 8, 128, tied=False),
    )
}


def default_preset(cuda: bool) -> str:
    """The 8B set needs ~115 GB of GPU memory at once; CPU machines get the 0.6B one."""
    return "8b" if cuda else "0.6b"
