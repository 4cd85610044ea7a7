"""The two roles of the `transport_pull` engine, each on weightpull's own loop (loop.py):
the trainer's `Sending` (a `Publisher` per publishing rank, slots registered once and
served between steps) and a replica worker's `Receiving` (a `Puller` and its mirror, or
a `SlicePuller` and a mirror of its slice, which a prefetch fills ahead)."""

from __future__ import annotations

import logging
import os
import socket
import uuid
from collections.abc import Sequence
from typing import Any

import anyio

from weightpull import Publisher, Puller, create_transport
from weightpull.errors import TornReadError
from weightpull.manifest import Manifest
from weightpull.puller import Pulled
from weightpull.registry import Registry, connect_registry
from weightpull.sharding import Sharding
from weightpull.slice_puller import SlicePulled, SlicePuller
from weightpull.slices import RankSlice

from .loop import Loop
from .settings import Settings
from .slicing import rollout_slice

log = logging.getLogger(__name__)
TORN_RETRIES = 3  # a torn read means a newer version took the slot: read that one instead


def process_name(role: str) -> str:
    return f"verl-{role}-{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:4]}"


def connect(address: str) -> Registry:
    """The registry at `address`: `ray://NAME` is a named Ray actor, anything else goes to
    `connect_registry` (a served registry)."""
    if address.startswith("ray://"):
        from weightpull.drivers.ray_registry import RayRegistry

        return RayRegistry(address)
    return connect_registry(address)


class Sending:
    """A publishing trainer rank (each rank its shard, or the master the whole): a
    publisher whose slots are registered at the first publish and kept (and served)
    until `close`."""

    def __init__(self, loop: Loop, settings: Settings, bucket_bytes: int) -> None:
        self.loop = loop
        self.registry = connect(settings.registry)
        self.transport = create_transport(settings.transport)
        self.publisher = Publisher(
            self.registry,
            self.transport,
            num_slots=settings.num_slots,
            when_full="wait",  # verl's rollout waits for this very version: it must not be skipped
            rollout_dtype=settings.rollout_dtype,
            device=settings.device,
            bucket_bytes=bucket_bytes,
            name=process_name("trainer"),
        )
        self._entered = loop.enter(self.publisher)  # serves the transport between publishes

    async def publish(
        self, version: int, tensors: Sequence[tuple[str, Any]], shard: Sharding | None = None
    ) -> dict[str, Any]:
        """Copy `tensors` into a free slot as `version` (or as this rank's `shard` of it)
        and announce it; the publisher's figures, for verl's metrics."""

        async def publish() -> None:
            await self.publisher.publish(version, tensors, shard=shard)

        await self.loop.run(publish)
        return {f"transport_pull/{k}": v for k, v in self.publisher.metrics().items()}

    def close(self) -> None:
        self._entered.__exit__(None, None, None)  # stops serving, deregisters the slots
        self.loop.call(self.transport.aclose)
        self.loop.call(self.registry.aclose)


class Receiving:
    """A replica worker's side: one puller, one mirror. The mirror is handed to verl as
    views while it applies them, so a prefetch waits until that ends (`_mirror`).

    Whole (`rank` None), a `Puller` reads every weight. Sliced, rank `rank` of the
    rollout's `settings.tensor_parallel_size` reads only its slice (`rollout_slice`) with
    a `SlicePuller`, made at the first pull from the version's layout (and again if the
    layout changes)."""

    def __init__(self, loop: Loop, settings: Settings, rank: int | None = None) -> None:
        self.loop = loop
        self.settings = settings
        self.rank = rank
        self.holder = process_name("rollout")
        self.registry = connect(settings.registry)
        self.transport = create_transport(settings.transport)
        self.puller: Puller | SlicePuller | None = (
            Puller(self.registry, self.transport, holder=self.holder, ttl=settings.lease_ttl, device=settings.device)
            if rank is None
            else None
        )
        self.rank_slice: RankSlice | None = None
        self._sliced_for: str | None = None  # the layout signature the slice was made from
        self._last: Pulled | SlicePulled | None = None
        self.pulls, self.bytes_read = 0, 0  # pulls made; bytes the last one read
        self.received: int | None = None  # the version last handed to verl
        self._mirror = anyio.Semaphore(1)  # not a Lock: taken and given back by different tasks

    @property
    def mirror_version(self) -> int | None:
        return None if self.puller is None else self.puller.mirror_version

    def _wanted(self) -> int:
        return 0 if self.received is None else self.received + 1

    async def take(self, min_version: int | None = None) -> Pulled | SlicePulled:
        """(on the loop) Wait for a version at least `min_version` (default: newer than the
        one last received), have it in the mirror, and hold the mirror for the caller
        until `give_back`."""
        wanted = self._wanted() if min_version is None else min_version
        await self.registry.wait_for_version(wanted)
        await self._mirror.acquire()
        try:
            return await self._fill(wanted)
        except BaseException:
            self._mirror.release()
            raise

    async def give_back(self, version: int, applied: bool) -> None:
        """(on the loop) The caller is done with the mirror; `applied`: it loaded all of it."""
        self._mirror.release()
        if applied:
            self.received = version
            await self.registry.report_serving(self.holder, version)

    async def prefetch(self) -> int | None:
        """(on the loop) Pull the newest READY version into the mirror if it is newer than
        both the one last received and the one the mirror holds; the mirror's version."""
        newest = await self.registry.newest()
        async with self._mirror:
            have = max(v for v in (self.received, self.mirror_version, -1) if v is not None)
            if newest is not None and newest.version > have:
                await self._fill(newest.version)
        return self.mirror_version

    async def _fill(self, wanted: int) -> Pulled | SlicePulled:
        """The mirror holding the newest READY version (>= `wanted`): what a prefetch left
        there if nothing newer came since, else a fresh pull."""
        newest = await self.registry.newest()
        assert newest is not None and newest.version >= wanted  # versions never go back
        last = self._last
        if last is not None and self.mirror_version == newest.version == last.version:
            return last
        if self.rank is not None:  # the newest READY manifest, even if `newest` was retired meanwhile
            await self._slice_for(await self.registry.wait_for_version(newest.version))
        assert self.puller is not None
        for attempt in range(TORN_RETRIES):
            try:
                pulled = await self.puller.pull()
            except TornReadError:
                if attempt == TORN_RETRIES - 1:
                    raise
                log.warning("%s: torn read, pulling the newer version", self.holder)
                continue
            if isinstance(pulled, SlicePulled) and pulled.manifest.layout.signature != self._sliced_for:
                # A newer version of another shape came between: its own slice, read again.
                await self._slice_for(pulled.manifest)
                continue
            self._last = pulled
            self.pulls, self.bytes_read = self.pulls + 1, pulled.nbytes
            return pulled
        raise TornReadError(f"{self.holder}: no version stayed put for {TORN_RETRIES} pulls")

    async def _slice_for(self, manifest: Manifest) -> None:
        """A slice puller for `manifest`'s layout: the one made before while the layout
        stays (a model's shapes never change in a run), else a new one and its mirror."""
        signature = manifest.layout.signature
        if self.puller is not None and self._sliced_for == signature:
            return
        assert self.rank is not None
        if self.puller is not None:
            await self.puller.aclose()
        self.rank_slice = rollout_slice(list(manifest.layout.specs), self.rank, self.settings.tensor_parallel_size)
        self.puller = SlicePuller(
            self.registry,
            self.transport,
            self.rank_slice,
            holder=self.holder,
            ttl=self.settings.lease_ttl,
            device=self.settings.device,
        )
        self._sliced_for, self._last = signature, None

    def close(self) -> None:
        if self.puller is not None:
            self.loop.call(self.puller.aclose)
        self.loop.call(self.transport.aclose)
        self.loop.call(self.registry.aclose)
