"""Weights that derive from the version alone, so every process can say what a version
must hold, and bit-level comparison of what arrived."""

import torch

SHAPES = {
    "embed.weight": (257, 64),
    "layers.0.proj.weight": (64, 192),
    "layers.0.norm.weight": (64,),
    "head.bias": (3,),
}


def weights(version: int) -> dict[str, torch.Tensor]:
    """fp32 tensors seeded by `version` (a trainer's state after that step)."""
    g = torch.Generator().manual_seed(1000 + version)
    return {name: torch.randn(shape, generator=g) for name, shape in SHAPES.items()}


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def same_bits(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[str]:
    """Names whose dtype, shape or bytes differ, and names missing on either side."""
    bad = sorted(set(got) ^ set(want))
    for name in set(got) & set(want):
        g, w = got[name], want[name]
        if g.dtype != w.dtype or g.shape != w.shape or bits(g) != bits(w):
            bad.append(name)
    return sorted(bad)
