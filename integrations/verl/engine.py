"""`transport_pull`: a verl 0.9.1 checkpoint engine that moves weights by pull.

verl's `CheckpointEngineManager` runs every update in lockstep: `prepare` on every worker,
`build_topology`, `init_process_group`, then the trainer's `send_weights` beside every
replica worker's `receive_weights`, then `finalize`. Here the topology is the registry's
address, known to all from the config, so the lockstep calls cost nothing: slots and
mirrors are registered once (at the first publish and the first pull) and kept across
updates. `send_weights` publishes (the trainer's cost is one copy into a slot);
`receive_weights` waits for a version newer than the one it last received and pulls it
under a lease, unless a `prefetch` already did while the replica was generating.

verl builds the engine on trainer ranks with `is_master` and on replica workers without
it; which role an engine plays is known from the call it gets. With `publish: sharded`
(the default) every trainer rank publishes its dim-0 shard of the version (shards.py),
so no rank holds the whole model; with `publish: whole` rank 0 publishes all of it and
the others only take part in gathering it. A rollout worker pulls the whole version, or
with `sliced` only its tensor-parallel rank's slice (slicing.py), and hands its engine
checkpoint-shaped tensors either way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from typing import Any

import torch
from verl.checkpoint_engine.base import CheckpointEngine, CheckpointEngineRegistry
from verl.workers.rollout.utils import ensure_async_iterator

from weightpull.errors import InvalidArgumentError
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.slice_puller import SlicePulled

from . import loop
from .settings import Settings
from .shards import Held, nbytes, take_shard, trainer_place
from .sides import Receiving, Sending
from .slicing import checkpoint_tensors

log = logging.getLogger(__name__)
BACKEND = "transport_pull"


@CheckpointEngineRegistry.register(BACKEND)
class TransportPullCheckpointEngine(CheckpointEngine):
    """verl's `transport_pull` checkpoint engine: the trainer's workers publish each
    version, the rollout's pull it, through a registry both reach (docs/guides/verl.md).

    Args:
        bucket_size: verl's `update_weights_bucket_megabytes`, in bytes: it bounds one
            bucket of the layout, so one read.
        is_master: Whether this worker is verl's master of the engine.
        **engine_kwargs: `engine_kwargs.transport_pull` (see `Settings`).

    Raises:
        InvalidArgumentError: A setting is missing or of the wrong kind.
    """

    def __init__(self, bucket_size: int, is_master: bool = False, **engine_kwargs: Any) -> None:
        self.settings = Settings.from_kwargs(engine_kwargs)
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.rank: int | None = None
        self._loop: loop.Loop | None = None
        self._sending: Sending | None = None
        self._receiving: Receiving | None = None
        self._last_sent: int | None = None
        self.held = Held()  # bytes of the weights the last send_weights held

    # -- verl's lockstep: cheap after the first ----------------------------------------------

    def prepare(self) -> dict[str, Any]:
        """Nothing to allocate per update: slots and the mirror stay registered. The
        metadata names the registry, which is all a peer needs."""
        return {"registry": self.settings.registry}

    @classmethod
    def build_topology(
        cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list[dict]
    ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
        """No pairs to wire: every worker finds the others' versions in the registry. The
        ranks are kept for logs; the registries named must agree."""
        registries = {m["registry"] for m in metadata if isinstance(m, dict) and "registry" in m}
        if len(registries) > 1:
            raise InvalidArgumentError(f"transport_pull workers name different registries: {sorted(registries)}")
        total = actor_wg_world_size + rollout_world_size
        return {"rank": list(range(actor_wg_world_size))}, {"rank": list(range(actor_wg_world_size, total))}

    def init_process_group(self, rank: int = -1, **_: Any) -> None:
        self.rank = rank

    def finalize(self) -> None:
        """Nothing to free: deregistering slots or a mirror per update is what this engine
        avoids (`close` ends them)."""

    # -- the trainer -------------------------------------------------------------------------

    @torch.no_grad()
    async def send_weights(
        self, weights: Iterable[tuple[str, torch.Tensor]] | AsyncIterator[tuple[str, torch.Tensor]], global_steps=None
    ) -> dict[str, Any]:
        """Publish `weights` as version `global_steps` (else the next one).

        Sharded (`publish: sharded`, more than one trainer rank): every rank keeps its
        dim-0 rows of each weight as it comes, lets the whole weight go, and publishes
        them as its shard of the version; it returns once its shard is committed, and the
        version turns READY when every rank's is. Whole: the master rank publishes every
        weight and returns once the version is READY; the other ranks iterate them
        (gathering a sharded weight is collective) and publish nothing. Either way the
        trainer's cost is the copy into a slot; replicas read it afterwards, on their own
        time. `transport_pull/held_bytes_peak` says the most bytes of the weights this
        rank held at once.

        Raises:
            InvalidArgumentError: (sharded) a weight has no dim 0, or is a DTensor on a
                mesh that orders the trainer ranks otherwise: publish whole instead.
        """
        index, count = trainer_place()
        self.held = held = Held()
        shard = None
        if self.settings.publish == "sharded" and count > 1:
            tensors, shard = await take_shard(weights, index, count, self.settings.rollout_dtype, held)
        else:
            tensors = []
            async for name, tensor in ensure_async_iterator(weights):
                size = nbytes(tensor) if isinstance(tensor, torch.Tensor) else 0
                held.taking(size)
                if self.is_master:
                    tensors.append((name, tensor))
                    held.keep(size)
            if not self.is_master:
                return {}
        version = self._next_version(global_steps)
        if self._sending is None:
            self._sending = Sending(self._shared_loop(), self.settings, self.bucket_size)
        metrics = await self._sending.publish(version, tensors, shard)
        del tensors
        self._last_sent = version
        return {**metrics, "transport_pull/held_bytes_peak": held.peak}

    def _next_version(self, global_steps: int | None) -> int:
        """`global_steps`, the trainer's step, when it is newer than the last version sent;
        else the next number (verl may sync twice at one step: after a validation, a
        resume), so that replicas still see a newer version."""
        last = self._last_sent
        if global_steps is not None and (last is None or global_steps > last):
            return int(global_steps)
        version = 0 if last is None else last + 1
        if global_steps is not None:
            log.info(
                "transport_pull: step %s was already published; publishing it as version %s", global_steps, version
            )
        return version

    # -- a replica ---------------------------------------------------------------------------

    @torch.no_grad()
    async def receive_weights(self, global_steps=None) -> AsyncGenerator[tuple[str, torch.Tensor], None]:
        """Every weight of the first version newer than the one last received (waiting for
        one), as views of the mirror, valid until the generator ends. The version counts
        as received once the caller has taken all of it."""
        receiving = self._receiver()
        run = receiving.loop.run
        pulled = await run(receiving.take)
        applied = False
        try:
            if isinstance(pulled, SlicePulled):
                assert receiving.rank_slice is not None
                mirror = as_tensors(pulled.plan.mirror, pulled.region)
                for name, tensor in checkpoint_tensors(pulled.manifest.layout, receiving.rank_slice, mirror):
                    yield name, tensor
            else:
                for name, tensor in as_tensors(pulled.layout, pulled.region).items():
                    yield name, tensor
            applied = True
        finally:
            await run(receiving.give_back, pulled.version, applied)

    def prefetch(self, wait: bool = False) -> int | None:
        """Start pulling the newest version into the mirror while the engine still
        generates (verl's async and standalone rollout call it between requests); the next
        `receive_weights` then only hands the mirror over. Returns at once, or with `wait`
        when the mirror is filled, with the version it holds."""
        receiving = self._receiver()
        future = receiving.loop.start(receiving.prefetch)
        return future.result() if wait else None

    @property
    def received_version(self) -> int | None:
        """The version this replica last received whole (None before the first)."""
        return None if self._receiving is None else self._receiving.received

    @property
    def rank_slice(self) -> Any:
        """A sliced replica worker's `RankSlice` once it pulled (None elsewhere): which box
        of each weight it read, so which elements of what it yields hold the weights."""
        return None if self._receiving is None else self._receiving.rank_slice

    @property
    def pull_figures(self) -> dict[str, int]:
        """A replica worker's pulls so far and the bytes its last one read."""
        r = self._receiving
        return {} if r is None else {"pulls": r.pulls, "bytes_read": r.bytes_read}

    @property
    def publisher(self) -> Any:
        """This trainer rank's `Publisher` once it published (None elsewhere)."""
        return None if self._sending is None else self._sending.publisher

    @property
    def puller(self) -> Any:
        """A replica's `Puller` once it received or prefetched (None elsewhere)."""
        return None if self._receiving is None else self._receiving.puller

    def _receiver(self) -> Receiving:
        if self._receiving is None:
            rank = self._rollout_rank() if self.settings.slices else None
            self._receiving = Receiving(self._shared_loop(), self.settings, rank)
        return self._receiving

    def _rollout_rank(self) -> int:
        """This rollout worker's tensor-parallel rank: its rank in the rollout's worker
        group (verl's `Worker` sets `RANK`) modulo the tensor-parallel size, as verl's
        server adapter pairs workers with the engine's ranks."""
        rank = os.environ.get("RANK")
        if rank is None or not rank.isdigit():
            raise InvalidArgumentError(
                f"transport_pull.sliced needs the rollout worker's rank in $RANK (verl's Worker sets it), got {rank!r}"
            )
        return int(rank) % self.settings.tensor_parallel_size

    # -- lifecycle ---------------------------------------------------------------------------

    def _shared_loop(self) -> loop.Loop:
        if self._loop is None:
            self._loop = loop.shared()
        return self._loop

    def close(self) -> None:
        """Deregister the slots and the mirror and drop the registry's handle. verl never
        calls it (a worker's engine lives as long as the worker); tests do."""
        sending, self._sending = self._sending, None
        receiving, self._receiving = self._receiving, None
        if sending is not None:
            sending.close()
        if receiving is not None:
            receiving.close()
