"""The slice puller: one tensor-parallel rank of a replica pulls only its slice.

It leases a version as the `Puller` does, plans its reads with `plan_slice` (from the
trainer's M shards straight into this rank's mirror, 2-D where rows are strided), makes
them while renewing the lease, and keeps the copy only if the lease is still valid
after the last byte landed: the same guarantee, on fewer bytes.

With `stream`, it reads a version while the trainer still writes it, each read once the
buckets it lies in are committed; with `host`, the registry may place it at a relay of
its own layout (`slice_key`), whose mirror it reads whole and checks against the slice's
digests; with `relay`, it offers its mirror, once whole, to ranks of that layout.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Self, Unpack, cast

import anyio
import attrs

from . import slice_digests, transports
from .clock import Clock, MonotonicClock
from .connections import Connections
from .errors import (
    DigestMismatchError,
    NoProgressError,
    NoSourceError,
    PeerGoneError,
    RegionNotRegisteredError,
    TornReadError,
    TransportError,
    VersionStateError,
    WeightpullError,
)
from .layout import DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES
from .leasing import FlatLeaseArgs, LeaseClient, Pacer
from .manifest import Manifest
from .puller import _SourceFailed, check_transport, from_sources
from .records import Progress
from .registry import Lease, Registry, ReservingRegistry, SliceRelayingRegistry, StreamingRegistry, as_streaming
from .relaying import RelayServer
from .settings import Digester, LeaseSettings, RelaySettings, digester_hint, merge, refuse
from .slices import RankSlice, SlicePlan, SliceRead, bucket_needs, plan_slice, slice_key
from .states import VersionState
from .transport import Read2D, Region, Remote, Transport, fault_in

log = logging.getLogger(__name__)

_BATCH_BYTES = 64 << 20  # progress is counted per batch: one lands well within a stall timeout
# Batches read at once. Reads asked together share the link and land together (NIXL over
# UCX's tcp interleaves them), so with every batch asked at once none landed before the
# last did: a slow shared link (4 replicas of 2 ranks at 1 Gbit/s) then looked stalled.
_BATCHES_IN_FLIGHT = 2
_BATCH_READS = 4096
_PLANS_KEPT = 4
_LEASE_FIELDS = ("ttl", "renew_every", "stall_timeout")
_RELAY_FIELDS = ("host", "relay", "relay_cap")
_WHOLE = (VersionState.READY, VersionState.RETIRED)


class FlatSlicePullerArgs(FlatLeaseArgs, total=False):
    """The settings a `SlicePuller` also takes one by one, as a `Puller` does."""

    host: str | None  # RelaySettings
    relay: bool  # RelaySettings
    relay_cap: int | None  # RelaySettings


@attrs.frozen
class SlicePulled:
    """This rank's complete, verified slice of one version, in its mirror; valid until
    the next pull into the same mirror starts. `source` is where it came from: "" for
    the trainer's slots, else the relay (its holder name)."""

    version: int
    manifest: Manifest
    plan: SlicePlan
    region: Region
    seconds: float
    renewals: int
    source: str = ""

    @property
    def nbytes(self) -> int:
        """Bytes this rank read."""
        return self.plan.nbytes if not self.source else self.plan.mirror.total_bytes

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
    and so is `publisher` (the line followed); the settings come grouped
    (`lease=LeaseSettings(...)`, `relaying=RelaySettings(...)`) or flat (`ttl=`,
    `renew_every=`, `stall_timeout=`, `host=`, `relay=`, `relay_cap=`), as a `Puller`'s
    do. The publisher's digests are of its slots' buckets, which a slice cuts across, so
    a copy read from the slots is vouched for by its lease alone.

    With `stream`, a pull of the newest version also takes one still being written
    (STREAMING, unsharded: sharded versions do not stream): each read is made once the
    publisher marked the buckets it lies in, and the copy is kept only if the version
    turns READY while the lease holds (else `TornReadError`), as a `Puller`'s.

    With `host`, each lease is placed by the registry at the trainer's slots or at the
    mirror of a rank of another replica that holds the same layout (`layout_key`,
    offered with `relay`), the same host's first. A relay's mirror is read whole and
    checked bucket by bucket against the slice's digests, which the layout's first relay
    computed over its copy from the trainer's slots (`weightpull.slice_digests`); a
    relay that fails mid-read (gone, stalled, bytes that do not match) is excluded and
    the whole slice is read again elsewhere, up to `MAX_SOURCE_TRIES` sources. A rank
    whose layout no relay holds reads the trainer's slots.

    `prepare` registers the mirror ahead (its size is the slice's) and maps the slots
    publishers reserved, so that the first version moves as the rest do.

    With `relay` (and `host`), each good pull offers the mirror, once whole, to ranks of
    the same layout (at most `relay_cap` at once), with the slice's digests when it came
    from the trainer's slots. The next pull first withdraws the offer and waits for its
    readers' leases to end (each within its TTL), then overwrites the mirror.

    Args:
        registry: The registry versions are leased from (a `StreamingRegistry` with
            `stream`, a `SliceRelayingRegistry` with `host`).
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
        stream: Read versions still being written (see above).
        digester: Computes wsum64 digests where a GPU mirror lies (a `Digester`): needed
            with `host` on a GPU (`weightpull.integrations.torch_digests.wsum64_digests`).
        lease: The lease settings (`LeaseSettings`).
        relaying: The relay settings (`RelaySettings`: `host`, `relay`, `relay_cap`; a
            spare mirror is not for slices).
        **flat: The same settings one by one (`FlatSlicePullerArgs`).

    Raises:
        InvalidArgumentError: a setting is out of range or breaks a rule with another
            (all named at once), a flat one contradicts `lease`/`relaying`, the registry
            cannot stream (`stream`) or place slices (`host`), or `publisher` is not a
            principal's name.
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
        stream: bool = False,
        digester: Digester | None = None,
        lease: LeaseSettings | None = None,
        relaying: RelaySettings | None = None,
        **flat: Unpack[FlatSlicePullerArgs],
    ) -> None:
        unknown = sorted(set(flat) - {*_LEASE_FIELDS, *_RELAY_FIELDS})
        if unknown:
            raise TypeError(f"SlicePuller() got an unexpected keyword argument {unknown[0]!r}")
        given: dict[str, object] = dict(flat)
        settings = merge(lease, LeaseSettings, {k: given[k] for k in _LEASE_FIELDS if k in given}, "lease")
        relays = merge(relaying, RelaySettings, {k: given[k] for k in _RELAY_FIELDS if k in given}, "relaying")
        staged = device != "cpu" and (staging if staging is not None else not transport.reads_into_gpu)
        self._check(registry, relays, device, stream, digester, staged=staged)  # named before any driver loads
        self.transport = transports.for_device(transport, device, staging)
        self.registry = registry
        self.rank_slice = rank_slice
        self.clock = clock or MonotonicClock()
        self.leases = LeaseClient(registry, settings, holder=holder, clock=self.clock, publisher=publisher)
        self.holder, self.publisher = self.leases.holder, self.leases.publisher
        self.ttl, self.renew_every, self.stall_timeout = settings.ttl, settings.renew_interval, settings.stall_timeout
        self.host, self.relay, self.relay_cap = relays.host, relays.relay, relays.relay_cap
        self.relays = RelayServer(registry, relays, holder=self.holder, clock=self.clock, ttl=settings.ttl)
        self.stream, self.digester = stream, digester
        self.device = device
        self.bucket_bytes, self.align = bucket_bytes, align
        self.layout_key = slice_key(rank_slice, bucket_bytes=bucket_bytes, align=align)
        self.mirror: Region | None = None
        self.mirror_version: int | None = None
        self._mirror_layout: str | None = None
        self._clean = True  # the bytes no read of the slots writes are zero
        self._plans: OrderedDict[tuple[int, str, tuple[bytes, ...]], SlicePlan] = OrderedDict()
        self._remotes = Connections(self.transport)
        self._lock: anyio.Lock | None = None

    @staticmethod
    def _check(
        registry: Registry,
        relays: RelaySettings,
        device: str,
        stream: bool,
        digester: Digester | None,
        *,
        staged: bool,
    ) -> None:
        """Every rule the settings break with one another, the registry or the driver, named at once."""
        problems = []
        if relays.spare_mirror:
            problems.append("a slice's relay keeps no spare mirror (spare_mirror=True): leave it unset")
        if stream and not isinstance(registry, StreamingRegistry):
            problems.append(f"{type(registry).__name__} cannot stream versions (stream=True)")
        if relays.host is not None and not isinstance(registry, SliceRelayingRegistry):
            problems.append(f"{type(registry).__name__} places no slices at relays (host=): it has no part_digests")
        if relays.host is not None and device != "cpu" and digester is None:
            problems.append(
                f"a slice read from a relay (host=) is checked against its digests: a mirror on {device!r} checks "
                f"them with digester={digester_hint()}"
            )
        if relays.relay and staged:
            problems.append(
                f"a relay offers its mirror to other replicas, and a mirror on {device!r} fed through host staging "
                f"cannot be exported: relay from a host mirror, or over a driver that reads into {device!r} "
                "(staging=False)"
            )
        refuse(problems, "SlicePuller")

    @property
    def offered(self) -> int | None:
        """The version this mirror is offered for, as a relay; None: not offered."""
        return self.relays.offered

    async def prepare(self, *, mirror: bool = True) -> int:
        """Do now what the first pull would do first: register the mirror, whose size the
        rank's slice sets (no manifest needed), and connect to and map each slot that
        publishers over this transport reserved ahead (`Publisher.reserve`; a slice reads
        from every shard's). Pulls wait for it; a slot that cannot be mapped is logged and
        left to the first pull, which fails on it as it would have anyway.

        Args:
            mirror: Register the mirror too.

        Returns:
            The slots mapped: 0 while none is reserved (or the registry takes no
            reservations).
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            if mirror and self.mirror is None:
                layout = self.rank_slice.layout(bucket_bytes=self.bucket_bytes, align=self.align)
                self.mirror = await self._allocate(layout.total_bytes)
                self._mirror_layout, self._clean = layout.signature, True
            if not isinstance(self.registry, ReservingRegistry):
                return 0
            found = [r for r in await self.registry.reservations() if r.transport == self.transport.name]
            return await self._remotes.map_ahead([s for r in found for s in r.sources], self.device, self.holder)

    async def pull(self, version: int | None = None) -> SlicePulled:
        """This rank's slice of the newest READY version (or `version`; with `stream`, a
        STREAMING one too); the lease is released on every path.

        Args:
            version: The version to pull; None: the newest.

        Returns:
            This rank's verified slice, valid until the next pull into this mirror starts.

        Raises:
            TornReadError: the lease lapsed during the read, or a stream ended otherwise.
            NoProgressError: no read landed for `stall_timeout`.
            DigestMismatchError: every source tried was a relay whose bytes did not match.
            TransportError: the transport's error, after cancelling the other reads.
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            return await from_sources(self._pull, version, holder=self.holder, what="'s slice")

    async def _pull(self, version: int | None, exclude: list[str]) -> SlicePulled:
        started = self.clock.now()
        await self.relays.keep_for_readers()  # the mirror is overwritten below: its readers end first
        part = self.layout_key if self.host is not None else None
        lease, pacer = await self.leases.acquire(
            version, streaming=self.stream, host=self.host, exclude=tuple(exclude), part=part
        )
        try:
            manifest = await self.registry.get(lease.version)
            check_transport(manifest, self.transport)
            plan = self._plan(manifest)
            mirror = self._mirror_for(plan)
            self.mirror_version = None  # overwritten from here on
            if lease.source:
                lease, renewals = await self._from_relay(lease, pacer, manifest, plan, mirror)
            else:
                if not self._clean:  # a relay's failed copy left bytes where no read of the plan writes
                    mirror = self._mirror_for(plan, fresh=True)
                remotes = [self._remote(s, keep=len(plan.sources)) for s in plan.sources]
                try:
                    lease, renewals = await self._read_all(lease, pacer, manifest, plan, remotes, mirror)
                except (RegionNotRegisteredError, PeerGoneError, NoProgressError):
                    self._forget(plan)
                    raise
            self.mirror_version = manifest.version
            pulled = SlicePulled(
                manifest.version, manifest, plan, mirror, self.clock.now() - started, renewals, lease.source
            )
        finally:
            await self.leases.release(lease)
        if self.relay:
            await self._offer(pulled)
        return pulled

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
        """Every read of the plan, in batches at once (flat and 2-D), under the lease; of a
        version still streamed, each once the buckets it lies in are committed, and then
        the version's READY awaited."""

        in_flight = anyio.CapacityLimiter(_BATCHES_IN_FLIGHT)

        async def batch(reads: list[SliceRead], done: Callable[[int], None]) -> None:
            async with in_flight:
                await read(reads, done)

        async def read(reads: list[SliceRead], done: Callable[[int], None]) -> None:
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
            ended: list[Progress] = []
            async with anyio.create_task_group() as readers:
                if not self.stream or manifest.shards:
                    for reads in _batches(plan.reads):
                        readers.start_soon(batch, reads, note)
                else:

                    def issue(reads: list[SliceRead]) -> None:
                        readers.start_soon(batch, reads, note)

                    await self._stream_reads(manifest, plan, note, ended, issue)
            if self.stream and not manifest.shards and not (ended and ended[-1].state in _WHOLE):
                await self._until_ready(manifest)

        return await self.leases.read(
            lease,
            pacer,
            read_all if plan.reads or self.stream else None,
            what=f"v{manifest.version}'s slice",
            total=plan.nbytes,
            source=f" over {manifest.transport}",
            copy="slice",
        )

    async def _stream_reads(
        self,
        manifest: Manifest,
        plan: SlicePlan,
        note: Callable[[int], None],
        ended: list[Progress],
        issue: Callable[[list[SliceRead]], None],
    ) -> None:
        """Issue each read of a version's one slot once the publisher committed the
        buckets it lies in (`bucket_needs`), in batches as marks come; a stream seen
        ended goes into `ended`."""
        needs = bucket_needs(plan, manifest.layout)
        order = sorted(range(len(plan.reads)), key=lambda i: needs[i])
        issued = 0
        while issued < len(order):
            progress = await self._wait_for_buckets(manifest, needs[order[issued]])
            streaming = progress.state is VersionState.STREAMING
            if not streaming:
                ended.append(progress)
            upto = issued
            while upto < len(order) and (not streaming or needs[order[upto]] <= progress.committed):
                upto += 1
            note(0)  # the publisher moved: not a stall
            for reads in _batches([plan.reads[i] for i in order[issued:upto]]):
                issue(reads)
            issued = upto

    async def _wait_for_buckets(self, manifest: Manifest, at_least: int) -> Progress:
        """The stream's progress once `at_least` buckets may be read, or it ended; one that
        ended unfinished is a torn copy."""
        try:
            return await as_streaming(self.registry).wait_for_buckets(manifest.version, at_least)
        except VersionStateError as exc:
            raise TornReadError(f"{self.holder}: {exc}; the slice was rejected") from exc

    async def _until_ready(self, manifest: Manifest) -> None:
        """Return once the version is READY; a stream that ends otherwise is torn."""
        progress = await self._wait_for_buckets(manifest, len(manifest.layout.buckets) + 1)  # only its end answers
        if progress.state not in _WHOLE:  # RETIRED only from READY
            why = f" ({progress.reason})" if progress.reason else ""
            raise TornReadError(
                f"{self.holder}: v{manifest.version} ended {progress.state}{why} while streamed; the slice was rejected"
            )

    async def _from_relay(
        self, lease: Lease, pacer: Pacer, manifest: Manifest, plan: SlicePlan, mirror: Region
    ) -> tuple[Lease, int]:
        """The slice read whole from the relay the lease was placed at (its mirror has this
        rank's layout), then checked against the layout's digests. Any failure of the
        relay's is `_SourceFailed`: the slice is read afresh elsewhere."""
        source, layout = lease.source, plan.mirror
        try:
            digests = await cast(SliceRelayingRegistry, self.registry).part_digests(lease.version, self.layout_key)
            if digests is None:  # the registry offers no slice without them: a relay of another release
                raise DigestMismatchError(f"v{lease.version}'s slice came from relay {source!r} with no digests")
            remote = self._remote(lease.descriptor)
            reads = [(remote, b.offset, mirror, b.offset, b.nbytes) for b in layout.buckets]

            async def read_all(note: Callable[[int], None]) -> None:
                await self.transport.read_many(reads)
                note(layout.total_bytes)

            lease, renewals = await self.leases.read(
                lease,
                pacer,
                read_all if reads else None,
                what=f"v{manifest.version}'s slice",
                total=layout.total_bytes,
                source=f" from relay {source!r}",
                copy="slice",
            )
            await slice_digests.verify(layout, mirror, digests, self.digester, version=manifest.version, source=source)
        except (TransportError, NoProgressError, DigestMismatchError, NoSourceError) as exc:
            self._clean = False  # its bytes may lie in the padding too, which a read of the slots never writes
            self._remotes.forget([lease.descriptor])
            raise _SourceFailed(source, lease.version) from exc
        return lease, renewals

    async def _offer(self, pulled: SlicePulled) -> None:
        """With `relay`: offer the mirror (whole) to ranks of this layout, with the slice's
        digests when it came from the trainer's slots. A failure is logged: this rank's
        own pull stands."""
        assert self.mirror is not None
        try:
            digests = None
            if not pulled.source:
                digests = await slice_digests.compute(pulled.plan.mirror, self.mirror, self.digester)
            await self.relays.offer(
                pulled.version,
                self.transport.export(self.mirror),
                cap=self.relay_cap,
                part=self.layout_key,
                digests=digests,
            )
        except WeightpullError as exc:
            log.warning("%s: could not offer v%s's slice as a relay: %s", self.holder, pulled.version, exc)

    async def _allocate(self, nbytes: int) -> Region:
        """A mirror made ahead, its pages touched (with zeros: what a read of the slots
        leaves unwritten must be zero), so that the first pull runs as the rest."""

        def allocate() -> Region:
            region = self.transport.allocate(nbytes, self.device)
            fault_in(region)
            return region

        return await anyio.to_thread.run_sync(allocate) if self.transport.slow_allocate else allocate()

    def _mirror_for(self, plan: SlicePlan, *, fresh: bool = False) -> Region:
        """This rank's mirror. Bytes no read of the slots writes (a vocab's padding rows,
        alignment) stay as allocated: zero. A new mirror only when its layout changes
        (rare: the model changed shape), or, `fresh`, after a relay's copy failed in it
        (its bytes may lie there: a read of the slots would leave them)."""
        if not fresh and self.mirror is not None and self._mirror_layout == plan.mirror.signature:
            return self.mirror
        if self.mirror is not None:  # a fresh mirror, so its unread bytes are zero
            self.transport.deregister(self.mirror)
        self.mirror = self.transport.allocate(plan.mirror.total_bytes, self.device)
        self._mirror_layout = plan.mirror.signature
        self._clean = True
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
        """Withdraw this rank's offer (if any), disconnect from every source and deregister
        the mirror; the registry and the transport stay the caller's."""
        if self.relays.offered is not None:
            with anyio.CancelScope(shield=True):
                try:
                    await self.relays.registry.withdraw(self.relays.offered, holder=self.holder)
                except WeightpullError as exc:  # its readers find the mirror gone and read elsewhere
                    log.warning("%s: could not withdraw its slice's offer: %s", self.holder, exc)
            self.relays.offered = None
        self._remotes.close()
        if self.mirror is not None:
            self.transport.deregister(self.mirror)
            self.mirror = None
            self.mirror_version = None
