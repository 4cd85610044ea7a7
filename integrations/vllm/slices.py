"""A worker's slice, from the engine itself: which elements of each published tensor this
tensor-parallel rank's own weight loaders read.

vLLM's loaders narrow each checkpoint tensor to the rank's share (column- or row-parallel,
vocab-parallel with padding, q/k/v and gate/up into fused parameters, experts into
stacks) and copy it in. `record_reads` loads probe tensors through the rank's own
checkpoint-format reload (`apply.load`) and records, by their views, the elements of each
tensor that any operation of the load read: no table of vLLM's layouts is written here.
It then proves the record by the engine's own result: a second load of the same probes,
with every element outside the recorded boxes changed, must leave every parameter and
buffer of the model the same, bit for bit. The model is then reloaded from the weights
it held before (its checkpoint, or the version it serves).

The rank pulls exactly those boxes (`rank_slice`, planned by `weightpull.slices` from the
trainer's shards), and the apply rebuilds checkpoint-shaped tensors holding them
(`checkpoint_weights`) for the same reload path: the CPU backend computes from packed
copies it makes after loading, so its own reload must run; elements the loaders never
read are left unwritten.

Why views and not probe values: the loaded parameters are bf16, which holds integers
exactly only to 256, so positions would take several probe loads of a base-256 code; the
views say the same in one load, and the second load checks it exactly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightpull.errors import ApplyCheckError
from weightpull.layout import TensorSpec
from weightpull.slice_puller import SlicePulled
from weightpull.slices import Param, Piece, RankSlice

from ..torch_tensors import fingerprints
from . import apply

Box = tuple[tuple[int, int], ...]


def _box(view: torch.Tensor, base: torch.Tensor) -> Box:
    """The elements of contiguous `base` that `view` reaches, as a box: exact for a view
    made by narrowing (strides unchanged); the bounding box of its span otherwise."""
    shape = tuple(base.shape)
    strides = [math.prod(shape[i + 1 :]) for i in range(len(shape))]
    offset = view.storage_offset() - base.storage_offset()
    start = []
    rest = offset
    for st in strides:
        start.append(rest // st)
        rest %= st
    narrowed = view.dim() == base.dim() and all(
        s == st or n == 1 for s, st, n in zip(view.stride(), strides, view.shape, strict=True)
    )
    if narrowed and all(a + n <= d for a, n, d in zip(start, view.shape, shape, strict=True)):
        return tuple((a, a + n) for a, n in zip(start, view.shape, strict=True))
    return tuple((0, d) for d in shape)  # a transposed or flattened read: take the whole tensor


class _Recorder(TorchDispatchMode):
    """Records the boxes of `probes` that each tensor operation reads (for `copy_`, its
    source only: its destination is written, not read; views read nothing)."""

    def __init__(self, probes: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.storages = {p.untyped_storage().data_ptr(): name for name, p in probes.items() if p.numel()}
        self.probes = probes
        self.boxes: dict[str, set[Box]] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "is_view", False) or func is torch.ops.aten.detach.default:
            return func(*args, **(kwargs or {}))  # a narrow or view reads nothing; its later use does
        for arg in args[1:] if func is torch.ops.aten.copy_.default else args:
            if isinstance(arg, torch.Tensor) and not arg.is_meta and arg.numel():
                name = self.storages.get(arg.untyped_storage().data_ptr())
                if name is not None:
                    self.boxes.setdefault(name, set()).add(_box(arg, self.probes[name]))
        return func(*args, **(kwargs or {}))


def _merge(boxes: set[Box]) -> list[Box]:
    """Boxes none of which lies inside another (a loader may read a share, then part of it)."""
    out = []
    for b in sorted(boxes, key=lambda b: -math.prod(hi - lo for lo, hi in b)):
        if not any(all(lo2 <= lo and hi <= hi2 for (lo, hi), (lo2, hi2) in zip(b, o, strict=True)) for o in out):
            out.append(b)
    return sorted(out)


def _probe(specs: Iterable[TensorSpec], seed: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    out = {}
    for s in specs:
        dtype = getattr(torch, s.dtype)
        out[s.name] = torch.randn(s.shape, generator=generator, dtype=torch.float32).to(dtype)
    return out


def _state(model: torch.nn.Module) -> dict[str, int]:
    tensors = {f"p:{n}": p for n, p in model.named_parameters()} | {f"b:{n}": b for n, b in model.named_buffers()}
    return fingerprints({k: t for k, t in tensors.items() if t.numel()})


def record_reads(
    runner: Any,
    specs: list[TensorSpec],
    *,
    ties: dict[str, list[str]],
    restore: Iterable[tuple[str, torch.Tensor]],
) -> dict[str, list[Box]]:
    """Per published tensor, the boxes this rank's loaders read (a tensor they never read
    is left out: another rank's experts). Leaves the model holding `restore`."""
    try:
        probes = _probe(specs, seed=1)
        recorder = _Recorder(probes)
        with recorder:
            apply.load(runner, iter(probes.items()), ties=ties, check=False)
        reads = {name: _merge(boxes) for name, boxes in recorder.boxes.items()}
        first = _state(runner.get_model())
        # The proof: every element outside the boxes changed, and the model must not notice.
        other = _probe(specs, seed=2)
        for name, tensor in other.items():
            for box in reads.get(name, []):
                index = tuple(slice(a, b) for a, b in box)
                tensor[index] = probes[name][index]
        apply.load(runner, iter((n, t) for n, t in other.items() if n in reads), ties=ties, check=False)
        second = _state(runner.get_model())
        changed = sorted(k for k in first if first[k] != second.get(k))
        if changed:
            raise ApplyCheckError(
                f"the recorded slice misses elements the engine's loaders use: {changed[:6]} changed "
                "when only elements outside it did"
            )
    finally:
        apply.load(runner, restore, ties=ties, check=False)
    return reads


def rank_slice(reads: dict[str, list[Box]], specs: list[TensorSpec], rank: int, ranks: int) -> RankSlice:
    """This rank's mirror: each box read, as a parameter of its own (named `name` for a
    tensor read as one box, `name#i` otherwise), in the version's order."""
    params = []
    for spec in specs:
        boxes = reads.get(spec.name, [])
        for i, box in enumerate(boxes):
            name = spec.name if len(boxes) == 1 else f"{spec.name}#{i}"
            shape = [b - a for a, b in box]
            params.append(Param(name, spec.dtype, shape, [Piece(spec.name, box, [0] * len(box))]))
    return RankSlice(rank, ranks, params)


def checkpoint_weights(
    pulled: SlicePulled, sliced: RankSlice, specs: list[TensorSpec]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Checkpoint-shaped tensors holding this rank's boxes (`sliced`'s), for its own
    reload. The rest of each is left unwritten (`torch.empty`: its loaders never read it,
    and pages never touched cost nothing)."""
    from ..torch_tensors import as_tensors

    mirror = as_tensors(pulled.plan.mirror, pulled.region)
    by_source: dict[str, list[Param]] = {}
    for param in sliced.params:
        by_source.setdefault(param.pieces[0].source, []).append(param)
    for spec in specs:
        params = by_source.get(spec.name)
        if not params:
            continue
        full = torch.empty(spec.shape, dtype=getattr(torch, spec.dtype), device=mirror[params[0].name].device)
        for param in params:
            full[tuple(slice(a, b) for a, b in param.pieces[0].box)] = mirror[param.name]
        yield spec.name, full
