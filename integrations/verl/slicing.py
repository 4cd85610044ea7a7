"""A rollout rank's slice of a Hugging Face checkpoint, from the tensors' names: verl's
checkpoint engine runs beside the inference engine, not inside it, so it cannot record
the slice from the engine's own loaders as the vLLM integration does
(`weightpull.integrations.vllm.slices`).

The rule is vLLM's tensor-parallel layout of the decoder families verl trains (Llama,
Qwen2/3, Mistral, their MoE forms), read from each tensor's module name, and errs only
towards reading more: a tensor it does not know is read whole, as is one that does not
split evenly, and so are `k_proj`/`v_proj` (with fewer KV heads than ranks vLLM
replicates them, and which head a rank holds needs the model's config). The rank then
hands its engine checkpoint-shaped tensors holding its boxes (`checkpoint_tensors`);
the loaders read nothing else.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from weightpull.errors import InvalidArgumentError
from weightpull.layout import Layout, TensorSpec
from weightpull.slices import Param, RankSlice, replicated, sharded, vocab

COLUMN = frozenset({"q_proj", "gate_proj", "up_proj"})  # split along dim 0 (weight and bias)
ROW = frozenset({"o_proj", "down_proj"})  # weight split along dim 1; a bias whole
VOCAB = frozenset({"embed_tokens", "lm_head"})  # vocab-parallel, padded to 64
VOCAB_PAD = 64


def _param(spec: TensorSpec, rank: int, ranks: int) -> Param:
    module, _, leaf = spec.name.rpartition(".")
    kind = module.rpartition(".")[2]
    try:
        if kind in COLUMN and spec.shape:
            return sharded(spec, 0, rank, ranks)
        if kind in ROW and leaf == "weight" and len(spec.shape) == 2:
            return sharded(spec, 1, rank, ranks)
        if kind in VOCAB and leaf == "weight" and len(spec.shape) == 2:
            return vocab(spec, rank, ranks, pad_to=VOCAB_PAD)
    except InvalidArgumentError:  # does not split evenly: the engine would not split it so either
        pass
    return replicated(spec)


def rollout_slice(specs: list[TensorSpec], rank: int, ranks: int) -> RankSlice:
    """Rank `rank` of `ranks`: one parameter per published tensor (named as it), holding
    the box of it this rank's loaders read.

    Args:
        specs: The version's tensors (its manifest's layout).
        rank: The rollout worker's tensor-parallel rank.
        ranks: The rollout's tensor-parallel size.

    Raises:
        InvalidArgumentError: `rank` lies outside [0, ranks), or no tensors.
    """
    return RankSlice(rank, ranks, [_param(s, rank, ranks) for s in specs])


def checkpoint_tensors(
    full: Layout, rank_slice: RankSlice, mirror: dict[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of `full`, checkpoint-shaped, holding this rank's boxes read into
    `mirror` (the slice's views): a tensor read whole is its view; any other a new tensor
    with its box copied in and the rest left unwritten (`torch.empty`: the loaders never
    read it, and host pages never touched cost nothing). Made one at a time."""
    params = {p.name: p for p in rank_slice.params}
    for spec in full.specs:
        param = params[spec.name]
        if [(p.box, p.at) for p in param.pieces] == [(tuple((0, d) for d in spec.shape), (0,) * len(spec.shape))]:
            yield spec.name, mirror[spec.name]  # read whole: the mirror's view is the tensor
            continue
        held = mirror[spec.name]
        out = torch.empty(spec.shape, dtype=held.dtype, device=held.device)
        for piece in param.pieces:
            out[tuple(slice(a, b) for a, b in piece.box)] = held[
                tuple(slice(a, a + e) for a, e in zip(piece.at, piece.extent, strict=True))
            ]
        yield spec.name, out
