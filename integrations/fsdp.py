"""The trainer's side for FSDP2 (`fully_shard`) models: publish at start and after each
optimizer step, under the model's Hugging Face checkpoint names. The trainer only
publishes; nothing it calls steers rollout.

Two modes:

- **gathered**: every rank all-gathers each parameter (`full_tensor()`), one at a time,
  and rank 0 snapshots the full tensors and publishes them as one plain version, as verl
  does.
- **sharded**: each rank snapshots its own shard of every parameter and publishes it into
  its own slots as one shard of a sharded version (see `weightpull.sharding`); pullers
  read every shard into place. No rank gathers anything.

Either way `publish` returns once the snapshot (cast to the rollout dtype, on the
parameters' device) is complete, and the copy to host and the announcement finish in
the background (`weightpull.integrations.torch_snapshot`).
"""

from __future__ import annotations

import enum
import time
import uuid
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from weightpull.errors import InvalidArgumentError, PublishError
from weightpull.layout import TensorSpec
from weightpull.principals import Principal, Role
from weightpull.registry import Registry, connect_registry
from weightpull.sharding import Sharding, chunk_rows
from weightpull.transport import Transport

from .torch_snapshot import BlockingTime, SnapshotPublisher, Ticket, spec_of

# Module names wrappers splice into parameter names: FSDP1, activation checkpointing,
# torch.compile. A checkpoint has none of them.
WRAPPERS = frozenset({"_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod"})


def hf_name(fqn: str) -> str:
    """The checkpoint name of a parameter: its name with wrapper modules left out."""
    return ".".join(part for part in fqn.split(".") if part not in WRAPPERS)


def named_state(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Every parameter and persistent buffer under its checkpoint name; a tied weight
    once, under its first name (as `save_pretrained` writes it)."""
    seen: set[int] = set()
    out = []
    for fqn, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out.append((hf_name(fqn), tensor))
    return out


class Mode(enum.Enum):
    """How `FSDPPublisher` publishes: each rank its own rows (`SHARDED`, a sharded version,
    no gather), or rank 0 the whole model gathered (`GATHERED`)."""

    GATHERED = "gathered"
    SHARDED = "sharded"


def _dim0_shard(name: str, tensor: DTensor) -> tuple[int, int, int]:
    """(shard index, shard count, first row held) of an FSDP2 parameter."""
    mesh = tensor.device_mesh
    if mesh.ndim != 1 or tuple(tensor.placements) != (Shard(0),):
        raise InvalidArgumentError(
            f"{name!r} is placed {tuple(tensor.placements)} on a {mesh.ndim}-d mesh; sharded publishing "
            "takes FSDP2's default, Shard(0) on a 1-d mesh (use mode='gathered' otherwise)"
        )
    index, count = mesh.get_local_rank(), mesh.size()
    start, stop = chunk_rows(tensor.shape[0], index, count)
    if tensor.to_local().shape[0] != stop - start:
        raise InvalidArgumentError(
            f"{name!r}: this rank holds {tensor.to_local().shape[0]} rows, not the {stop - start} "
            "of torch.chunk's rule that FSDP2 follows"
        )
    return index, count, start


def _principal_name(registry: Registry) -> str | None:
    principal = getattr(registry, "principal", None)
    return principal.name if isinstance(principal, Principal) and principal.role is Role.PUBLISHER else None


class FSDPPublisher:
    """Publishes an FSDP2 model's weights; make one on every rank. `close()` when done:
    the slots go with it.

    Args:
        model: The FSDP2 model.
        mode: `Mode.SHARDED` (each rank publishes its rows) or `Mode.GATHERED`, or their
            values.
        registry: A `Registry`, or the address of a served one (None:
            `$WEIGHTPULL_REGISTRY`).
        transport: A `Transport` or a driver name; replicas in other processes need one
            that crosses processes ("nixl").
        rollout_dtype: The dtype tensors are published in; None keeps each one's own.
        name: The publisher's name; each rank publishes as `NAME/rankN` (default: the
            registry key's principal, else a random one).
        **options: Keyword arguments of each rank's `Publisher` (`num_slots`,
            `when_full`, `bucket_bytes`, ...).

    Raises:
        InvalidArgumentError: `mode` is neither, or (sharded) a parameter is not placed
            `Shard(0)` on a 1-d mesh.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        mode: Mode | str = Mode.SHARDED,
        registry: Registry | str | None = None,
        transport: Transport | str = "nixl",
        rollout_dtype: Any = "bfloat16",
        name: str | None = None,
        **options: Any,
    ) -> None:
        try:
            self.mode = Mode(mode)
        except ValueError:
            raise InvalidArgumentError(f"mode must be 'gathered' or 'sharded', got {mode!r}") from None
        self.model = model
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.blocking = BlockingTime()
        state = named_state(model)
        if registry is None or isinstance(registry, str):  # connected here, so the name can follow its key
            registry = connect_registry(registry)
            owns_registry = True
        else:
            owns_registry = False
        # One publisher principal, every rank under its name: they act as one publisher.
        name = f"{name or _principal_name(registry) or 'fsdp-' + uuid.uuid4().hex[:8]}/rank{self.rank}"
        self.sharding: Sharding | None = None
        specs: list[TensorSpec] | None = None
        if self.mode is Mode.SHARDED:
            self.sharding = self._sharding(state)
            specs = [spec_of(n, t, None) for n, t in self._local(state)]
        elif self.rank == 0:
            specs = [spec_of(n, t, None) for n, t in state]  # a DTensor's shape is the full one
        device = state[0][1].device if state else torch.device("cpu")
        self._snapshot = (
            None
            if specs is None
            else SnapshotPublisher(
                registry,
                transport,
                specs,
                device=device,
                rollout_dtype=rollout_dtype,
                name=name,
                close_registry=owns_registry,
                sharding=self.sharding,
                **options,
            )
        )

    # -- publishing ------------------------------------------------------------------------

    def publish(self, version: int) -> Ticket:
        """Snapshot the weights as `version` and return; they are announced in the
        background. Call it on every rank, with the same version."""
        started = time.perf_counter()
        state = named_state(self.model)
        if self.mode is Mode.SHARDED:
            assert self._snapshot is not None
            ticket = self._snapshot.publish(version, self._local(state), shard=self.sharding)
        elif self._snapshot is not None:
            ticket = self._snapshot.publish(version, self._gathered(version, state))
        else:  # the other ranks of a gather: they take part, and publish nothing
            for _ in self._gathered(version, state):
                pass
            ticket = Ticket(version, time.perf_counter() - started)
        self.blocking.add(ticket.blocking_s)
        return ticket

    def attach(self, optimizer: torch.optim.Optimizer, first_version: int = 0) -> Any:
        """Publish `first_version` now, and the next version after every `optimizer.step()`.
        Returns the hook's handle (`.remove()` detaches)."""
        versions = iter(range(first_version + 1, 2**63))
        self.publish(first_version)
        return optimizer.register_step_post_hook(lambda *_: self.publish(next(versions)))

    def wait(self, timeout: float | None = None):
        """Wait until this rank's last publish is announced; its `PublishResult`, or None."""
        return None if self._snapshot is None else self._snapshot.wait(timeout)

    @property
    def publisher(self):
        """This rank's core `Publisher`, or None (the other ranks of a gather)."""
        return None if self._snapshot is None else self._snapshot.publisher

    def close(self) -> None:
        if self._snapshot is not None:
            self._snapshot.close()

    def __enter__(self) -> FSDPPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- what each mode publishes ----------------------------------------------------------

    def _sharding(self, state: list[tuple[str, torch.Tensor]]) -> Sharding:
        """Where this rank's rows sit: its shard of every FSDP2 parameter; and, on shard 0
        alone, the whole of any tensor every rank holds (buffers, unsharded parameters)."""
        placed = {n: _dim0_shard(n, t) for n, t in state if isinstance(t, DTensor)}
        meshes = {(i, c) for i, c, _ in placed.values()}
        if len(meshes) > 1:
            raise InvalidArgumentError(f"parameters are sharded over different meshes: {sorted(meshes)}")
        index, count = meshes.pop() if meshes else (self.rank, dist.get_world_size() if dist.is_initialized() else 1)
        for n, t in state:
            if not isinstance(t, DTensor) and t.dim() == 0:
                raise InvalidArgumentError(f"{n!r} has no dim 0 to shard; publish it with mode='gathered'")
        shapes = {n: tuple(t.shape) for n, t in state}
        starts = {n: placed[n][2] if n in placed else 0 for n, _ in state}
        return Sharding(index, count, shapes, starts)

    def _local(self, state: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        assert self.sharding is not None
        for n, t in state:
            if isinstance(t, DTensor):
                yield n, t.to_local()
            else:
                yield n, t if self.sharding.index == 0 else t[:0]

    def _gathered(self, version: int, state: list[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Full tensors, gathered one at a time, so that only one is whole at once."""
        for n, t in state:
            if not isinstance(t, DTensor):
                yield n, t
                continue
            try:
                full = t.full_tensor()
            except Exception as exc:  # a rank died, or the group broke: nothing was begun
                raise PublishError(f"gathering {n!r} for v{version} failed: {exc!r}") from exc
            yield n, full
            del full
