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
from typing import Self, Unpack

import anyio
import attrs

from . import transports
from .clock import Clock, MonotonicClock
from .connections import Connections
from .errors import (
    NoProgressError,
    PeerGoneError,
    RegionNotRegisteredError,
)
from .layout import DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES
from .leasing import FlatLeaseArgs, LeaseClient, Pacer
from .manifest import Manifest
from .puller import check_transport
from .registry import Lease, Registry
from .settings import LeaseSettings, merge
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
    """One tensor-parallel rank of a replica: pulls only its slice of each version.

    Rank `rank_slice.rank` holds `rank_slice`'s parameters in a mirror on `device` packed
    by (`bucket_bytes`, `align`). The lease, renewal and stall rules are the `Puller`'s,
    and so is `publisher` (the line followed); the lease settings come grouped
    (`lease=LeaseSettings(...)`) or flat (`ttl=`, `renew_every=`, `stall_timeout=`), as
    a `Puller`'s do. Versions carry no digests for slices (a sharded version records
    none), so none are checked.

    Args:
        registry: The registry versions are leased from.
        transport: The driver that reads the bytes.
        rank_slice: This rank's parameters (`RankSlice`).
        holder: The name leases are held under; None: one below the registry's
            principal's name.
        device: Where the mirror lies: "cpu", or a GPU ("cuda:0").
        staging: Feed a GPU mirror through pinned host memory; None decides by the
            transport.
        bucket_bytes: The bucket size the mirror is packed by.
        align: The alignment the mirror is packed by.
        clock: The local clock; `MonotonicClock` if None.
        publisher: The line of versions followed (its publisher principal's name).
        lease: The lease settings (`LeaseSettings`).
        **flat: The same lease settings one by one (`FlatLeaseArgs`).

    Raises:
        InvalidArgumentError: a lease setting is out of range (all named at once), a flat
            one contradicts `lease`, or `publisher` is not a principal's name.
    """

    def __init__(
        self,
        registry: Registry,
        transport: Transport,
        rank_slice: RankSlice,
        *,
        holder: str | None = None,
        device: str = "cpu",
        staging: bool | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        align: int = DEFAULT_ALIGN,
        clock: Clock | None = None,
        publisher: str | None = None,
        lease: LeaseSettings | None = None,
        **flat: Unpack[FlatLeaseArgs],
    ) -> None:
        unknown = sorted(set(flat) - {"ttl", "renew_every", "stall_timeout"})
        if unknown:
            raise TypeError(f"SlicePuller() got an unexpected keyword argument {unknown[0]!r}")
        settings = merge(lease, LeaseSettings, dict(flat), "lease")
        self.registry = registry
        self.transport = transports.for_device(transport, device, staging)
        self.rank_slice = rank_slice
        self.clock = clock or MonotonicClock()
        self.leases = LeaseClient(registry, settings, holder=holder, clock=self.clock, publisher=publisher)
        self.holder, self.publisher = self.leases.holder, self.leases.publisher
        self.ttl, self.renew_every, self.stall_timeout = settings.ttl, settings.renew_interval, settings.stall_timeout
        self.device = device
        self.bucket_bytes, self.align = bucket_bytes, align
        self.mirror: Region | None = None
        self.mirror_version: int | None = None
        self._mirror_layout: str | None = None
        self._plans: OrderedDict[tuple[int, str, tuple[bytes, ...]], SlicePlan] = OrderedDict()
        self._remotes = Connections(self.transport)
        self._lock: anyio.Lock | None = None

    async def pull(self, version: int | None = None) -> SlicePulled:
        """This rank's slice of the newest READY version (or `version`); the lease is
        released on every path.

        Args:
            version: The version to pull; None: the newest.

        Returns:
            This rank's verified slice, valid until the next pull into this mirror starts.

        Raises:
            TornReadError: the lease lapsed during the read.
            NoProgressError: no read landed for `stall_timeout`.
            TransportError: the transport's error, after cancelling the other reads.
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            return await self._pull(version)

    async def _pull(self, version: int | None) -> SlicePulled:
        started = self.clock.now()
        lease, pacer = await self.leases.acquire(version)
        try:
            manifest = await self.registry.get(lease.version)
            check_transport(manifest, self.transport)
            plan = self._plan(manifest)
            mirror = self._mirror_for(plan)
            remotes = [self._remote(s, keep=len(plan.sources)) for s in plan.sources]
            self.mirror_version = None
            try:
                lease, renewals = await self._read_all(lease, pacer, manifest, plan, remotes, mirror)
            except (RegionNotRegisteredError, PeerGoneError, NoProgressError):
                self._forget(plan)
                raise
            self.mirror_version = manifest.version
            return SlicePulled(manifest.version, manifest, plan, mirror, self.clock.now() - started, renewals)
        finally:
            await self.leases.release(lease)

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
        pacer: Pacer,
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

        return await self.leases.read(
            lease,
            pacer,
            read_all if plan.reads else None,
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

    def _remote(self, descriptor: bytes, keep: int = 1) -> Remote:
        return self._remotes.get(descriptor, keep)

    def _forget(self, plan: SlicePlan) -> None:
        self._remotes.forget(plan.sources)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):
            await self.aclose()

    async def aclose(self) -> None:
        """Disconnect from every slot and deregister the mirror; the registry and the
        transport stay the caller's."""
        self._remotes.close()
        if self.mirror is not None:
            self.transport.deregister(self.mirror)
            self.mirror = None
            self.mirror_version = None
