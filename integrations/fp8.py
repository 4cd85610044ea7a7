"""Block-scaled fp8 on the wire: a version's linear weights cast to float8 e4m3 with one
scale per 128 x 128 block, as DeepSeek-V3's and Qwen3-FP8's checkpoints store them, for
replicas whose engine serves such a checkpoint (it loads the version through its own fp8
path: no requantization on the replica).

The checkpoint's form, which this module keeps exactly:

- each quantized weight ``<name>.weight`` is ``float8_e4m3fn`` of the weight's shape, and
  beside it ``<name>.weight_scale_inv``, ``float32`` of shape ``[ceil(out/128),
  ceil(in/128)]``: the block's largest magnitude over 448 (e4m3's largest), by which the
  engine multiplies the block back (``weight ≈ fp8 * scale_inv``; a short edge block is
  scaled as if zero-padded to 128);
- the config says ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3",
  "activation_scheme": "dynamic", "weight_block_size": [128, 128]}`` (`CONFIG`);
- what is quantized: the 2-D weights of linear layers (names ending ``_proj.weight``:
  attention's q/k/v/o, the MLP's gate/up/down, each expert's); embeddings, the output head
  and norms stay bf16 (the rollout dtype), as those checkpoints keep them.

`expand` turns a model's named tensors into the published ones: each quantized weight
becomes two entries (`Fp8Part`s of one `Fp8Weight`, quantized once, on the weight's own
device, when the first part is copied), the rest pass as they are (the publisher casts
fp32 to the rollout dtype as ever). `TorchAdapter` and `SnapshotPublisher(fp8=True)` copy
the parts into the slot; `check_servable` refuses an fp8 version to a replica that serves
another dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import torch

from weightpull.errors import InvalidArgumentError
from weightpull.layout import Layout, TensorSpec

BLOCK = 128
FP8 = "float8_e4m3fn"
SCALE = "float32"  # DeepSeek-V3's and Qwen3-FP8's scale dtype
SCALE_SUFFIX = "_scale_inv"  # `<name>.weight` -> `<name>.weight_scale_inv`
E4M3_MAX = 448.0
CONFIG: Mapping[str, Any] = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [BLOCK, BLOCK],
}
_LINEAR = re.compile(r"_proj\.weight$")


def quantizes(name: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor is a linear layer's weight the fp8 checkpoints quantize."""
    return len(shape) == 2 and bool(_LINEAR.search(name))


def scale_shape(shape: tuple[int, ...]) -> tuple[int, int]:
    """The shape of a weight's block scales: one per 128 x 128 block, edges included."""
    rows, cols = shape
    return math.ceil(rows / BLOCK), math.ceil(cols / BLOCK)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the weight in e4m3, its float32 block scales), on the weight's device: each 128 x
    128 block divided by its largest magnitude over 448, so that it spans e4m3's range."""
    rows, cols = weight.shape
    br, bc = scale_shape((rows, cols))
    w = weight.detach().float()
    padded = torch.zeros(br * BLOCK, bc * BLOCK, dtype=torch.float32, device=w.device)
    padded[:rows, :cols] = w
    blocks = padded.view(br, BLOCK, bc, BLOCK)
    amax = blocks.abs().amax(dim=(1, 3))  # [br, bc]
    scale = amax / E4M3_MAX
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero block stays zero
    q = (blocks / safe[:, None, :, None]).clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.view(br * BLOCK, bc * BLOCK)[:rows, :cols].contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """The float32 weight an engine computes with: each block of `q` times its scale."""
    rows, cols = q.shape
    expand = scale_inv.repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return q.float() * expand


class Fp8Weight:
    """One weight to be published in fp8: quantized once, at the first copy of either part."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.weight = weight
        self._done: tuple[torch.Tensor, torch.Tensor] | None = None

    def parts(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._done is None:
            with torch.no_grad():
                self._done = quantize(self.weight)
        return self._done

    def release(self) -> None:
        """Drop the quantized copy (both parts were copied)."""
        self._done = None


class Fp8Part:
    """One published tensor of a quantized weight: its e4m3 values (`scale=False`) or its
    block scales (`scale=True`), as `TensorAdapter` describes and copies it."""

    framework = "torch"  # the publisher copies it with the torch adapter

    def __init__(self, weight: Fp8Weight, *, scale: bool) -> None:
        self.weight, self.scale = weight, scale
        shape = tuple(weight.weight.shape)
        self.shape, self.dtype = (scale_shape(shape), SCALE) if scale else (shape, FP8)

    @property
    def is_cuda(self) -> bool:
        return bool(self.weight.weight.is_cuda)

    def tensor(self) -> torch.Tensor:
        q, s = self.weight.parts()
        return s if self.scale else q


def expand(tensors: Mapping[str, Any] | Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
    """A model's named tensors as an fp8 version publishes them: each linear weight as its
    e4m3 values under its own name and its scales under `<name>_scale_inv`, side by side;
    every other tensor as it is (the publisher casts fp32 to the rollout dtype)."""
    items = tensors.items() if isinstance(tensors, Mapping) else tensors
    for name, value in items:
        if isinstance(value, torch.Tensor) and quantizes(name, tuple(value.shape)):
            weight = Fp8Weight(value)
            yield name, Fp8Part(weight, scale=False)
            yield name + SCALE_SUFFIX, Fp8Part(weight, scale=True)
        else:
            yield name, value


def specs(given: Iterable[TensorSpec], rollout_dtype: str | None = "bfloat16") -> list[TensorSpec]:
    """The published specs of a model's specs (as `expand` publishes its tensors)."""
    out = []
    for s in given:
        if quantizes(s.name, s.shape):
            out += [TensorSpec(s.name, FP8, s.shape), TensorSpec(s.name + SCALE_SUFFIX, SCALE, scale_shape(s.shape))]
        else:
            keep = rollout_dtype is None or s.dtype != "float32"
            out.append(TensorSpec(s.name, s.dtype if keep else rollout_dtype, s.shape))
    return out


def is_fp8(layout: Layout) -> bool:
    """Whether a version was published in block fp8 (its layout holds e4m3 weights and
    their `_scale_inv` scales)."""
    names = {s.name for s in layout.specs}
    return any(s.dtype == FP8 and s.name + SCALE_SUFFIX in names for s in layout.specs)


def check_servable(layout: Layout, version: int, quantization: Mapping[str, Any] | None, *, replica: str = "") -> None:
    """Refuse a version whose form the replica's engine does not serve: an fp8 version to a
    replica whose checkpoint is not block fp8 (`quantization`: its config's
    `quantization_config`, None for none), or a bf16 one to a replica that serves fp8.

    Raises:
        InvalidArgumentError: naming the version, the replica and the fix.
    """
    fp8_replica = quantization is not None and quantization.get("quant_method") == "fp8"
    block = list(quantization.get("weight_block_size") or ()) if quantization else []
    who = f"replica {replica!r}" if replica else "this replica"
    if is_fp8(layout) and not (fp8_replica and block == [BLOCK, BLOCK]):
        serves = "an unquantized checkpoint" if quantization is None else f"quantization_config {dict(quantization)}"
        raise InvalidArgumentError(
            f"v{version} was published in block fp8 (e4m3, {BLOCK}x{BLOCK} scales) and {who} serves {serves}: "
            "start the replica from a block-fp8 checkpoint of the model (quantization_config "
            f"{dict(CONFIG)}), or publish without fp8"
        )
    if fp8_replica and not is_fp8(layout):
        raise InvalidArgumentError(
            f"v{version} was published unquantized and {who} serves a block-fp8 checkpoint: publish with fp8, "
            "or start the replica from the unquantized checkpoint"
        )
