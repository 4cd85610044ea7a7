"""The two roles of the `transport_pull` engine, each on weightpull's own loop (loop.py):
the trainer's `Sending` (a `Publisher`, slots registered once and served between steps)
and a replica's `Receiving` (a `Puller` and its mirror, which a prefetch fills ahead)."""

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
from weightpull.puller import Pulled
from weightpull.registry import Registry, connect_registry

from .loop import Loop
from .settings import Settings

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
    """The trainer's master rank: a publisher whose slots are registered at the first
    publish and kept (and served) until `close`."""

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

    async def publish(self, version: int, tensors: Sequence[tuple[str, Any]]) -> dict[str, Any]:
        """Copy `tensors` into a free slot as `version` and announce it; the publisher's
        figures, for verl's metrics."""
        await self.loop.run(self.publisher.publish, version, tensors)
        return {f"transport_pull/{k}": v for k, v in self.publisher.metrics().items()}

    def close(self) -> None:
        self._entered.__exit__(None, None, None)  # stops serving, deregisters the slots
        self.loop.call(self.transport.aclose)
        self.loop.call(self.registry.aclose)


class Receiving:
    """A replica's side: one puller, one mirror. The mirror is handed to verl as views
    while it applies them, so a prefetch waits until that ends (`_mirror`)."""

    def __init__(self, loop: Loop, settings: Settings) -> None:
        self.loop = loop
        self.holder = process_name("rollout")
        self.registry = connect(settings.registry)
        self.transport = create_transport(settings.transport)
        self.puller = Puller(
            self.registry, self.transport, holder=self.holder, ttl=settings.lease_ttl, device=settings.device
        )
        self.received: int | None = None  # the version last handed to verl
        self._mirror = anyio.Semaphore(1)  # not a Lock: taken and given back by different tasks

    def _wanted(self) -> int:
        return 0 if self.received is None else self.received + 1

    async def take(self, min_version: int | None = None) -> Pulled:
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
            have = max(v for v in (self.received, self.puller.mirror_version, -1) if v is not None)
            if newest is not None and newest.version > have:
                await self._fill(newest.version)
        return self.puller.mirror_version

    async def _fill(self, wanted: int) -> Pulled:
        """The mirror holding the newest READY version (>= `wanted`): what a prefetch left
        there if nothing newer came since, else a fresh pull."""
        newest = await self.registry.newest()
        assert newest is not None and newest.version >= wanted  # versions never go back
        if self.puller.mirror_version == newest.version and self.puller.mirror is not None:
            return Pulled(newest.version, newest, self.puller.mirror, 0.0, 0)
        for attempt in range(TORN_RETRIES):
            try:
                return await self.puller.pull()
            except TornReadError:
                if attempt == TORN_RETRIES - 1:
                    raise
                log.warning("%s: torn read, pulling the newer version", self.holder)
        raise AssertionError("unreachable")

    def close(self) -> None:
        self.loop.call(self.puller.aclose)
        self.loop.call(self.transport.aclose)
        self.loop.call(self.registry.aclose)
