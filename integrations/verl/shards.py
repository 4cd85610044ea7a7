"""A trainer rank's shard of the weights verl hands `send_weights`, taken one weight at a
time so that no rank holds the whole model.

verl's FSDP engines yield each weight whole (`get_per_tensor_param`: every rank
all-gathers it, `full_tensor()`), one at a time. Each rank keeps only its dim-0 rows of
each (torch.chunk's rule, which FSDP2 follows), cast to the rollout dtype, and lets the
whole one go before the next comes; a DTensor placed `Shard(0)` on a 1-d mesh of the
trainer ranks (what an FSDP2 parameter is) gives its local rows as they are, gathering
nothing, and one placed otherwise is gathered, then taken as a whole weight. The rows of all
ranks make one sharded version (`weightpull.sharding`), which pullers read into place.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterable
from typing import Any

import attrs
import torch
from verl.workers.rollout.utils import ensure_async_iterator

from weightpull.errors import InvalidArgumentError
from weightpull.sharding import Sharding, chunk_rows
from weightpull.tensors import cast_target, normalize_dtype


def trainer_place() -> tuple[int, int]:
    """(rank, world size) of this trainer rank: torch.distributed's default group once
    initialized (verl's FSDP workers), else what verl's `Worker` put in the environment,
    else a lone rank."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


@attrs.define
class Held:
    """Bytes the engine held of the weights it was given: `now` (kept for the publish)
    and `peak` (the most at once, counting the weight being taken)."""

    now: int = 0
    peak: int = 0

    def taking(self, incoming: int) -> None:
        self.peak = max(self.peak, self.now + incoming)

    def keep(self, nbytes: int) -> None:
        self.now += nbytes
        self.peak = max(self.peak, self.now)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _as_rows(t: Any, count: int) -> bool:
    """Whether a DTensor's own rows are this rank's shard: FSDP2's `Shard(0)` on a 1-d mesh
    of the trainer ranks. It says the same on every rank, so every rank takes the same
    path (a gather is collective)."""
    from torch.distributed.tensor import Shard

    return t.device_mesh.ndim == 1 and t.device_mesh.size() == count and tuple(t.placements) == (Shard(0),)


def _local_rows(name: str, t: Any, index: int, count: int) -> tuple[torch.Tensor, int]:
    """(this rank's rows of a DTensor placed `Shard(0)` over the trainer ranks, the
    first row's index)."""
    mesh = t.device_mesh
    if mesh.get_local_rank() != index:
        raise InvalidArgumentError(
            f"{name!r} is shard {mesh.get_local_rank()} of {mesh.size()} but this trainer rank is {index} of {count}; "
            "transport_pull.publish='sharded' takes a mesh in the trainer ranks' order (set publish to 'whole' otherwise)"
        )
    start, stop = chunk_rows(t.shape[0], index, count)
    local = t.to_local()
    if local.shape[0] != stop - start:
        raise InvalidArgumentError(f"{name!r}: this rank holds {local.shape[0]} rows, not torch.chunk's {stop - start}")
    return local.detach(), start


async def take_shard(
    weights: Iterable[tuple[str, Any]] | AsyncIterator[tuple[str, Any]],
    index: int,
    count: int,
    rollout_dtype: str | None,
    held: Held,
) -> tuple[list[tuple[str, torch.Tensor]], Sharding]:
    """Rank `index` of `count`'s rows of every weight, and where they sit. A DTensor
    placed otherwise than FSDP2's `Shard(0)` over the trainer ranks (tensor-parallel,
    HSDP's 2-d mesh) is gathered first (`full_tensor()`, on every rank alike), then
    taken as a whole weight is.

    Raises:
        InvalidArgumentError: A weight has no dim 0 (a scalar), or is a DTensor whose
            mesh orders the trainer ranks otherwise: publish whole instead.
    """
    from torch.distributed.tensor import DTensor

    out: list[tuple[str, torch.Tensor]] = []
    shapes: dict[str, tuple[int, ...]] = {}
    starts: dict[str, int] = {}
    async for name, t in ensure_async_iterator(weights):
        if t.dim() == 0:
            raise InvalidArgumentError(
                f"{name!r} is a scalar, with no dim 0 to shard; set transport_pull.publish to 'whole'"
            )
        shapes[name] = tuple(t.shape)  # a DTensor's shape is the whole one
        if isinstance(t, DTensor) and _as_rows(t, count):
            local, start = _local_rows(name, t, index, count)
        else:
            if isinstance(t, DTensor):
                t = t.full_tensor()
            held.taking(nbytes(t))
            start, stop = chunk_rows(t.shape[0], index, count)
            rows = t.detach()[start:stop]
            target = getattr(torch, cast_target(normalize_dtype(t.dtype), rollout_dtype))
            # A copy of the rows alone, in the slot's dtype: the whole weight goes with `t`.
            local = rows.to(target, copy=True, memory_format=torch.contiguous_format)
            del rows  # a view: it would keep the whole weight alive until the next one
        del t
        held.keep(nbytes(local))
        out.append((name, local))
        starts[name] = start
    return out, Sharding(index, count, shapes, starts)
