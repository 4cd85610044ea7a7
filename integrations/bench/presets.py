"""Tensor sets shaped like real models, by name: what a publish moves.

One generator: `fsdp_bench.qwen3_shaped` (the FSDP bench's meta-device Qwen3), read for
its parameter names and shapes, with tied embeddings left out as checkpoints leave them.
"""

from __future__ import annotations

import math

import attrs


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
        from weightpull.integrations.fsdp_bench import qwen3_shaped

        model = qwen3_shaped(self.layers, self.hidden, self.inter, self.vocab, self.heads, self.kv_heads, self.head_dim)
        return [(n, tuple(p.shape)) for n, p in model.named_parameters() if not (self.tied and n == "lm_head.weight")]

    def bf16_bytes(self) -> int:
        return sum(2 * math.prod(s) for _, s in self.shapes())


PRESETS = {p.name: p for p in (
    Preset("tiny", "a toy Qwen3 (for tests)", 2, 64, 128, 512, 4, 2, 16, tied=True),
    Preset("0.6b", "Qwen3-0.6B", 28, 1024, 3072, 151936, 16, 8, 128, tied=True),
    Preset("8b", "Qwen3-8B", 36, 4096, 12288, 151936, 32, 8, 128, tied=False),
)}


def default_preset(cuda: bool) -> str:
    """The 8B set needs ~115 GB of GPU memory at once; CPU machines get the 0.6B one."""
    return "8b" if cuda else "0.6b"
