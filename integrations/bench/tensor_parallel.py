"""The tensor-parallel ranks the benches give a replica: vLLM's layout for Qwen3, a
Qwen3-shaped model of about a given size, its bytes from a seed, and an oracle of what a
rank's slice must hold.

The layout (`tp_slice`) is vLLM's for Qwen3 (fused qkv and gate_up column-parallel,
o_proj and down_proj row-parallel, vocab-parallel embedding and LM head padded to 64,
norms replicated), built here for a bench's model; a vLLM replica derives its own from the
engine (`weightpull.integrations.vllm.slices`). The oracle (`expected`) builds a parameter
from the whole tensors by numpy indexing of its pieces' boxes, apart from the reads
`plan_slice` makes. Needs numpy, not torch (the fan-out's rank processes import it), but
for `scaled`, which reads a Qwen3's shapes on torch's meta device (`presets`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from weightpull.layout import TensorSpec
from weightpull.slices import Param, RankSlice, fuse, replicated, sharded, vocab

Shapes = Sequence[tuple[str, tuple[int, ...]]]

LAYERS = 8  # a scaled model's layers: its hidden size grows with the bytes asked for
_PER_H2 = 2 * (12 * LAYERS + 32)  # bf16 bytes per hidden**2: 12 per layer, 32 for the embedding and LM head


def tp_slice(shapes: Shapes, rank: int, ranks: int, dtype: str = "bfloat16") -> RankSlice:
    """Rank `rank` of `ranks` of a Qwen3 as vLLM shards it (see the module's docstring)."""
    specs = {name: TensorSpec(name, dtype, shape) for name, shape in shapes}
    params: list[Param] = []
    for name, spec in specs.items():
        leaf = name.rpartition(".")[2]
        if leaf != "weight":
            params.append(replicated(spec))
        elif name.endswith("self_attn.q_proj.weight"):
            base = name.removesuffix("q_proj.weight")
            parts = [sharded(specs[f"{base}{p}_proj.weight"], 0, rank, ranks) for p in "qkv"]
            params.append(fuse(f"{base}qkv_proj.weight", parts))
        elif name.endswith("mlp.gate_proj.weight"):
            base = name.removesuffix("gate_proj.weight")
            parts = [sharded(specs[f"{base}{p}_proj.weight"], 0, rank, ranks) for p in ("gate", "up")]
            params.append(fuse(f"{base}gate_up_proj.weight", parts))
        elif name.endswith(("k_proj.weight", "v_proj.weight", "up_proj.weight")):
            continue  # fused above
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            params.append(sharded(spec, 1, rank, ranks))
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            params.append(vocab(spec, rank, ranks, pad_to=64))
        else:  # norms
            params.append(replicated(spec))
    return RankSlice(rank, ranks, params)


def scaled(nbytes: int) -> list[tuple[str, tuple[int, ...]]]:
    """A Qwen3 of `LAYERS` layers, untied, whose bf16 tensors come to about `nbytes`: hidden
    h a multiple of 128 (at least 128), MLP 3h, vocab 16h, heads of 64 (half as many KV
    heads). 256 MiB gives h = 1024: 256 MiB and its norms."""
    from .presets import Preset

    h = max(128, round(math.sqrt(nbytes / _PER_H2) / 128) * 128)
    heads = h // 64
    preset = Preset("scaled", "a Qwen3 scaled to a size", LAYERS, h, 3 * h, 16 * h, heads, heads // 2, 64, tied=False)
    return preset.shapes()


def tensors(shapes: Shapes, seed: int) -> dict[str, Any]:
    """Every tensor's bf16 bits (uint16 numpy arrays) from one seeded stream: the same in
    every process that asks."""
    import numpy as np

    rng = np.random.default_rng(seed)
    return {name: rng.integers(0, 1 << 16, size=shape, dtype=np.uint16) for name, shape in shapes}


def expected(whole: Mapping[str, Any], param: Param) -> Any:
    """`param` built from `whole` tensors by numpy indexing: what its slice must hold
    (elements no piece covers, a padded vocab's rows, zero)."""
    import numpy as np

    out = np.zeros(param.shape, dtype=next(iter(whole.values())).dtype)
    for piece in param.pieces:
        src = whole[piece.source][tuple(slice(a, b) for a, b in piece.box)]
        lead = len(param.shape) - src.ndim
        at = tuple(slice(a, a + 1) for a in piece.at[:lead]) + tuple(
            slice(a, a + e) for a, e in zip(piece.at[lead:], src.shape, strict=True)
        )
        out[at] = src.reshape(out[at].shape)
    return out
