"""The slice puller: one tensor-parallel rank of a replica pulls only its slice.

It leases a version as the `Puller` does, plans its reads with `plan_slice` (from the
trainer's M shards straight into this rank's mirror, 2-D where rows are strided), makes
them while renewing the lease, and keeps the copy only if the lease is still valid
after the last byte landed: the same guarantee, on fewer bytes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Self

import anyio
import attrs

from . import transports
from .clock import Clock, MonotonicClock
from .errors import (
    NoProgressError,
    PeerGoneError,
    RegionNotRegisteredError,
)
from .layout import DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES
from .manifest import Manifest
from .puller import (
    DEFAULT_STALL_TIMEOUT,
    _default_holder,
    _Pacer,
    check_lease_settings,
    check_line,
    check_transport,
    line_args,
    read_under_lease,
    release_quietly,
)
from .registry import Lease, Registry
from .slices import RankSlice, SlicePlan, SliceRead, plan_slice
from .transport import Read2D, Region, Remote, Transport

log = logging.getLogger(__name__)

_BATCH_BYTES = 64 << 20  # progress is counted per batch: one lands well within a stall timeout
_BATCH_READS = 4096
_PLANS_KEPT = 4


@attrs.frozen
class SlicePulled:
    """This rank's complete, verified slice of one version, in its mirror; valid until
    the next pull into the same mirror starts."""

    version: int
    manifest: Manifest
    plan: SlicePlan
    region: Region
    seconds: float
    renewals: int

    @property
    def nbytes(self) -> int:
        """Bytes this rank read."""
        return self.plan.nbytes

    def view(self, name: str) -> memoryview:
        """The bytes of parameter `name` in a host mirror."""
        p = self.plan.mirror[name]
        return self.region.host_view()[p.offset : p.end]


def _batches(reads: Sequence[SliceRead]) -> list[list[SliceRead]]:
    out: list[list[SliceRead]] = [[]]
    size = 0
    for r in reads:
        if out[-1] and (size + r.nbytes > _BATCH_BYTES or len(out[-1]) >= _BATCH_READS):
            out.append([])
            size = 0
        out[-1].append(r)
        size += r.nbytes
    return [b for b in out if b]


class SlicePuller:
    def __init__(
        self,
        registry: Registry,
        transport: Transport,
        rank_slice: RankSlice,
        *,
        holder: str | None = None,
        ttl: float = 10.0,
        renew_every: float | None = None,
        device: str = "cpu",
        staging: bool | None = None,
        stall_timeout: float | None = DEFAULT_STALL_TIMEOUT,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        align: int = DEFAULT_ALIGN,
        clock: Clock | None = None,
        publisher: str | None = None,
    ) -> None:
        """Rank `rank_slice.rank` of a replica, holding `rank_slice`'s parameters in a
        mirror on `device` packed by (`bucket_bytes`, `align`). The lease, renewal and
        stall rules are the `Puller`'s, and so is `publisher` (the line followed). Versions carry no digests for slices (a sharded
        version records none), so none are checked."""
        self.renew_every = check_lease_settings(ttl, renew_every, stall_timeout)
        self.registry = registry
        self.transport = transports.for_device(transport, device, staging)
        self.rank_slice = rank_slice
        self.holder = holder or _default_holder(registry)
        self.publisher = check_line(publisher)
        self.ttl = ttl
        self.device = device
        self.stall_timeout = stall_timeout
        self.bucket_bytes, self.align = bucket_bytes, align
        self.clock = clock or MonotonicClock()
        self.mirror: Region | None = None
        self.mirror_version: int | None = None
        self._mirror_layout: str | None = None
        self._plans: OrderedDict[tuple[int, str, tuple[bytes, ...]], SlicePlan] = OrderedDict()
        self._remotes: dict[bytes, Remote] = {}
        self._lock: anyio.Lock | None = None

    async def pull(self, version: int | None = None) -> SlicePulled:
        """This rank's slice of the newest READY version (or `version`). Raises as
        `Puller.pull` does: `TornReadError` when the lease lapsed during the read,
        `NoProgressError` on a stall, the transport's error otherwise; the lease is
        released on every path."""
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            return await self._pull(version)

    async def _pull(self, version: int | None) -> SlicePulled:
        started = self.clock.now()
        lease = await self.registry.acquire(version, ttl=self.ttl, holder=self.holder, **line_args(self.publisher))
        pacer = _Pacer(self.renew_every, self.ttl, lease, started, self.clock.now())
        try:
            manifest = await self.registry.get(lease.version)
            check_transport(manifest, self.transport)
            plan = self._plan(manifest)
            mirror = self._mirror_for(plan)
            remotes = [self._remote(s) for s in plan.sources]
            self.mirror_version = None
            try:
                lease, renewals = await self._read_all(lease, pacer, manifest, plan, remotes, mirror)
            except (RegionNotRegisteredError, PeerGoneError, NoProgressError):
                self._forget(plan)
                raise
            self.mirror_version = manifest.version
            return SlicePulled(manifest.version, manifest, plan, mirror, self.clock.now() - started, renewals)
        finally:
            await release_quietly(self.registry, lease, self.holder)

    def _plan(self, manifest: Manifest) -> SlicePlan:
        """Plans depend on the layout, the shards' rows and their slots: made once per
        version (its slots in the key, whatever the registry does with its numbers)."""
        key = (manifest.version, manifest.layout.signature, tuple(s.source for s in manifest.shards))
        plan = self._plans.get(key)
        if plan is None:
            plan = plan_slice(manifest, self.rank_slice, bucket_bytes=self.bucket_bytes, align=self.align)
            self._plans[key] = plan
            while len(self._plans) > _PLANS_KEPT:
                self._plans.popitem(last=False)
        return plan

    async def _read_all(
        self,
        lease: Lease,
        pacer: _Pacer,
        manifest: Manifest,
        plan: SlicePlan,
        remotes: list[Remote],
        mirror: Region,
    ) -> tuple[Lease, int]:
        """Every read of the plan, in batches at once (flat and 2-D), under the lease."""

        async def batch(reads: list[SliceRead], done: Callable[[int], None]) -> None:
            flat = [(remotes[r.shard], r.src, mirror, r.dst, r.width) for r in reads if r.height == 1]
            strided: list[Read2D] = [
                (remotes[r.shard], r.src, r.src_pitch, mirror, r.dst, r.dst_pitch, r.width, r.height)
                for r in reads
                if r.height > 1
            ]
            if flat:
                await self.transport.read_many(flat)
            if strided:
                await self.transport.read_2d_many(strided)
            done(sum(r.nbytes for r in reads))

        async def read_all(note: Callable[[int], None]) -> None:
            async with anyio.create_task_group() as readers:
                for reads in _batches(plan.reads):
                    readers.start_soon(batch, reads, note)

        return await read_under_lease(
            self.registry,
            lease,
            pacer,
            read_all if plan.reads else None,
            clock=self.clock,
            holder=self.holder,
            stall_timeout=self.stall_timeout,
            what=f"v{manifest.version}'s slice",
            total=plan.nbytes,
            source=f" over {manifest.transport}",
            copy="slice",
        )

    def _mirror_for(self, plan: SlicePlan) -> Region:
        """This rank's mirror; a new one only when the plan needs more room. Bytes no read
        writes (a vocab's padding rows) stay as allocated: zero. A new mirror only when
        its layout changes (rare: the model changed shape)."""
        if self.mirror is not None and self._mirror_layout == plan.mirror.signature:
            return self.mirror
        if self.mirror is not None:  # another layout: a fresh mirror, so its unread bytes are zero
            self.transport.deregister(self.mirror)
        self.mirror = self.transport.allocate(plan.mirror.total_bytes, self.device)
        self._mirror_layout = plan.mirror.signature
        return self.mirror

    def _remote(self, descriptor: bytes) -> Remote:
        remote = self._remotes.get(descriptor)
        if remote is None:
            remote = self._remotes[descriptor] = self.transport.connect(descriptor)
        return remote

    def _forget(self, plan: SlicePlan) -> None:
        for descriptor in plan.sources:
            remote = self._remotes.pop(descriptor, None)
            if remote is not None:
                self.transport.disconnect(remote)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    async def aclose(self) -> None:
        """Disconnect from every slot and deregister the mirror; the registry and the
        transport stay the caller's."""
        for remote in self._remotes.values():
            self.transport.disconnect(remote)
        self._remotes.clear()
        if self.mirror is not None:
            self.transport.deregister(self.mirror)
            self.mirror = None
            self.mirror_version = None
