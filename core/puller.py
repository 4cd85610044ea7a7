"""The puller: a replica's side. Leases a version, reads every bucket into a local
registered mirror, and hands the copy on only if the lease held throughout.

Why the final lease check is enough: a publisher rewrites a slot only after the registry
reclaims its version, and the registry refuses while any lease on it is alive. A lease,
once lapsed, never becomes valid again. So a lease still valid after the last byte
landed proves no write touched the slot during the read; a lapsed one means the copy
may be torn, and it is rejected.

This module is the read pipeline alone: the lease it reads under is held by a
`weightpull.leasing.LeaseClient`, a relay's mirror is served by a
`weightpull.relaying.RelayServer`, digests are checked by a
`weightpull.checking.DigestChecker`, and the settings are `weightpull.settings`'.
"""

from __future__ import annotations

import functools
import logging
import math
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Self, TypeVar, Unpack, cast

import anyio
import attrs

from . import transports
from .checking import DigestChecker
from .clock import Clock, MonotonicClock
from .connections import Connections
from .delta import Delta, patch
from .errors import (
    DigestMismatchError,
    InvalidArgumentError,
    NoProgressError,
    NoSourceError,
    PeerGoneError,
    RegionNotRegisteredError,
    TornReadError,
    TransportError,
    VersionStateError,
    first_error,
)
from .layout import Layout
from .leasing import (
    DEFAULT_STALL_TIMEOUT,
    FlatLeaseArgs,
    LeaseClient,
    LineArgs,
    Pacer,
    check_lease_settings,
    check_line,
    line_args,
    read_under_lease,
    release_quietly,
)
from .manifest import Manifest
from .records import Progress, PullReport
from .registry import Lease, Registry, RelayingRegistry, ReservingRegistry, as_streaming
from .relaying import RelayServer
from .settings import Digester, LeaseSettings, Patcher, PullerSettings, RelaySettings, merge, patcher_hint
from .states import VersionState
from .transport import Region, Remote, Transport, fault_in

__all__ = [  # what other modules took from here before the lease client and relays had modules of their own
    "DEFAULT_STALL_TIMEOUT",
    "MAX_SOURCE_TRIES",
    "Borrowed",
    "FlatPullerArgs",
    "LeaseSettings",
    "LineArgs",
    "Pulled",
    "Puller",
    "RelaySettings",
    "check_lease_settings",
    "check_line",
    "check_transport",
    "line_args",
    "read_under_lease",
    "release_quietly",
]

log = logging.getLogger(__name__)

_MAX_REMOTES = 16
_T = TypeVar("_T")

MAX_SOURCE_TRIES = 3  # sources a pull with host= tries before it fails
# Reads a relaying pull keeps in flight, taken in bucket order. Reads asked together share
# the link and land together (NIXL over UCX's tcp interleaves them: 16 buckets asked at once
# all landed within 1 ms of each other, at the end); one at a time, each lands, and is
# offered to the relay's readers, as early as it can.
RELAY_READS_IN_FLIGHT = 1


_Read = tuple[Remote, int, Region, int, int]  # (remote, its offset, the mirror, the mirror's offset, bytes)


class _SourceFailed(Exception):
    """A relay failed a pull (its cause says how): read the version afresh elsewhere."""

    def __init__(self, source: str, version: int) -> None:
        super().__init__(f"relay {source!r} failed v{version}")
        self.source, self.version = source, version


async def from_sources(
    pull: Callable[[int | None, list[str]], Awaitable[_T]],
    version: int | None,
    *,
    holder: str,
    what: str = "",
    on_failure: Callable[[], Awaitable[None]] | None = None,
) -> _T:
    """`pull(version, exclude)`, again with the failed relay excluded each time one
    raises `_SourceFailed` (after `on_failure`), `MAX_SOURCE_TRIES` sources at most: the
    same version, from elsewhere, so a copy never mixes two sources. `what` follows the
    version in the warning ("'s slice")."""
    failed: list[str] = []
    while True:
        try:
            return await pull(version, failed)
        except _SourceFailed as exc:
            if on_failure is not None:
                await on_failure()
            failed.append(exc.source)
            version = exc.version
            if len(failed) >= MAX_SOURCE_TRIES:
                raise exc.__cause__ or exc from None
            log.warning(
                "%s: relay %r failed v%s%s (%s); reading it afresh elsewhere",
                holder,
                exc.source,
                exc.version,
                what,
                exc.__cause__,
            )


@attrs.frozen
class _VersionBytes:
    """One version's bytes in `region`, laid out as its manifest says."""

    version: int
    manifest: Manifest
    region: Region

    @property
    def nbytes(self) -> int:
        return self.manifest.nbytes

    @property
    def layout(self) -> Layout:
        return self.manifest.layout

    def view(self, name: str) -> memoryview:
        """The bytes of tensor `name`, where they are in host memory."""
        p = self.manifest.layout[name]
        return self.region.host_view()[p.offset : p.end]


@attrs.frozen
class Pulled(_VersionBytes):
    """A complete, verified copy of one version, in the puller's mirror. It stays valid
    until the next `pull` into the same mirror starts."""

    seconds: float
    renewals: int
    base: int | None = None  # the version it was patched from (its delta); None: read whole


@attrs.frozen
class Borrowed(_VersionBytes):
    """A version read in place: `region` is the publisher's slot itself, mapped into this
    process, as the puller's device reads it (`Puller.borrow`). Valid only inside the
    block that borrowed it; read it, never write it. READY, unless lent while still
    written (`borrow(whole=False)`): then read only the tensors `landed()` has named."""

    # Waits until at least n buckets may be read (a stream's progress); None: lent whole.
    _wait: Callable[[int], Awaitable[Progress]] | None = attrs.field(default=None, repr=False, alias="wait")
    _seen: list[Progress] = attrs.field(factory=list, repr=False, init=False)  # the last progress landed() saw

    async def landed(self) -> AsyncIterator[tuple[str, ...]]:
        """The names of the tensors whose bytes are all in the slot, in batches as the
        publisher commits them (one batch, every tensor, when lent whole): read each batch
        as it comes. A stream that ends otherwise raises `TornReadError`."""
        layout = self.manifest.layout
        total, done = len(layout.buckets), 0
        if self._wait is None or total == 0:
            yield tuple(p.spec.name for p in layout.placements)
            return
        while done < total:
            progress = await self._wait(done + 1)
            self._seen[:] = [progress]
            ready = progress.state in (VersionState.READY, VersionState.RETIRED)
            upto = total if ready else min(progress.committed, total)
            yield tuple(p.spec.name for p in layout.placements if done <= p.bucket < upto)
            done = upto


def check_transport(manifest: Manifest, transport: Transport) -> None:
    if manifest.transport != transport.name:
        raise InvalidArgumentError(
            f"v{manifest.version} was published over {manifest.transport!r}; this puller reads over {transport.name!r}"
        )


class FlatPullerArgs(FlatLeaseArgs, total=False):
    """The settings a `Puller` also takes one by one, as keyword arguments (the form it
    has always had): each is the field of the same name of its group."""

    host: str | None  # RelaySettings
    relay: bool  # RelaySettings
    relay_cap: int | None  # RelaySettings
    spare_mirror: bool  # RelaySettings


_LEASE_FIELDS = ("ttl", "renew_every", "stall_timeout")
_RELAY_FIELDS = ("host", "relay", "relay_cap", "spare_mirror")


def puller_settings(
    *,
    lease: LeaseSettings | None = None,
    relaying: RelaySettings | None = None,
    device: str = "cpu",
    stream: bool = False,
    verify_digests: bool | None = None,
    digester: Digester | None = None,
    **flat: Unpack[FlatPullerArgs],
) -> PullerSettings:
    """The `PullerSettings` of a puller's arguments, grouped and flat alike (`Puller`).

    Raises:
        InvalidArgumentError: a rule of the settings is broken, or a flat argument
            contradicts the settings object given beside it.
        TypeError: an argument no puller takes.
    """
    unknown = sorted(set(flat) - {*_LEASE_FIELDS, *_RELAY_FIELDS})
    if unknown:
        raise TypeError(f"Puller() got an unexpected keyword argument {unknown[0]!r}")
    given: dict[str, object] = dict(flat)
    return PullerSettings(
        lease=merge(lease, LeaseSettings, {k: given[k] for k in _LEASE_FIELDS if k in given}, "lease"),
        relaying=merge(relaying, RelaySettings, {k: given[k] for k in _RELAY_FIELDS if k in given}, "relaying"),
        device=device,
        stream=stream,
        verify_digests=verify_digests,
        digester=digester,
    )


class Puller:
    """A replica's reader: leases a version, reads every bucket into a local registered
    mirror, and hands the copy on only if the lease held throughout (`pull`), or lends the
    publisher's slot in place (`borrow`).

    Its settings come grouped (`lease=LeaseSettings(...)`, `relaying=RelaySettings(...)`)
    or flat, as keyword arguments of the same names (`ttl=`, `renew_every=`,
    `stall_timeout=`, `host=`, `relay=`, `relay_cap=`, `spare_mirror=`): both forms are
    kept, neither warns. A flat argument beside the settings object of its group must
    agree with it. Every rule the settings keep is checked at once, as the puller is
    made (`PullerSettings`), and every one broken is named in one error.

    A pull in which no read lands for `stall_timeout` seconds of the registry's clock
    ends with `NoProgressError`, whatever rate `clock` runs at: the lease's grants,
    stamped by the registry, date each landing (never early; at most a renewal interval
    late, and a renewal is asked at the deadline). Progress is counted per read, and a
    read is at most a bucket, so the bound must exceed the time one bucket takes. While
    a read runs the lease is renewed every `renew_every` seconds of the registry's clock
    (default, and at most, a third of the TTL): the registry's grants measure the local
    clock's rate (`weightpull.leasing.Pacer`), and until they have, the first renewal
    comes early, after an eighth of that interval.

    With `stream`, a pull of the newest version also takes one still being written
    (STREAMING, from a publisher with `stream=True`): it reads each bucket once the
    publisher marks it committed, waits for the rest, and keeps the copy only if the
    version turns READY while the lease holds; a stream that ends otherwise is a
    `TornReadError`.

    With `host`, each lease is placed at the source the registry picks: the version's
    own slot, or the mirror of a replica that offered it (a relay; `offer`), the same
    host's first. Bytes read from a relay are checked bucket by bucket against the
    publisher's digests, always: a mirror on a GPU needs `digester`, and refuses a
    version whose digests are not wsum64 (`InvalidArgumentError`, before reading). When
    a relay fails mid-read (gone, stalled, or bytes that do not match), the whole copy is
    dropped and read again from another source, excluding that one, up to
    `MAX_SOURCE_TRIES` sources: a copy never mixes two sources.

    With `relay`, each pull offers the mirror to other replicas while it is still
    filling (`offer` with `relay_cap`): once its first bucket lands, then advancing the
    count of buckets it holds, so that streaming readers of this relay read each bucket
    once it landed here. A pull that fails withdraws the offer; one that succeeds leaves
    it standing until the next pull. A pull never overwrites a mirror that leases still
    read: it first withdraws the offer and waits for them (each ends within its TTL).
    With `spare_mirror`, a relay keeps a second mirror instead: a pull while the mirror
    is offered goes into the other one, so readers of a relay never hold up its next
    prefetch, at the cost of one more buffer the size of a version on `device`.

    With `deltas` (the default), a version published with a delta against a version this
    puller holds, verified (`Publisher(deltas=True)`), is read as its delta alone: the
    section is checked against its digests, the copy of the base patched, and the result
    checked against the version's digests; a section that does not match, from a relay,
    is a failed relay (read afresh elsewhere); any other patch that does not match is
    read whole, under the same lease (docs/guides/bytes.md). A host mirror is patched on
    the check's threads (`puller.checker.threads`: one per core by default); a mirror on a
    GPU where it lies, by `patcher` (and checked by `digester`), else it reads every
    version whole. The base may lie in this mirror, the spare one a relay keeps, or the
    mirror of one of `siblings` (a replica's other puller), copied from. A puller with
    `host` also reads a version's delta section when it reads it whole, so that as a
    relay it serves deltas of what it holds.

    Args:
        registry: The registry versions are leased from (a `StreamingRegistry` with
            `stream`, a `RelayingRegistry` with `host`).
        transport: The driver that reads the bytes.
        holder: The name leases are held under; None: one below the registry's
            principal's name (`weightpull.leasing.default_holder`).
        publisher: The line of versions followed (its publisher principal's name): the
            newest is that line's newest, and a version of another line is refused
            (`VersionNotFoundError`). None follows the registry's default line: name
            the publisher wherever another may publish (docs/guides/registry-service.md).
        device: Where the mirror lies: "cpu", or a GPU ("cuda:0").
        staging: Feed a GPU mirror through pinned host memory, bucket by bucket; None
            decides by `transport.reads_into_gpu`, True or False forces it.
        stream: Read versions still being written (see above).
        verify_digests: Check the digests a publisher recorded: on the host mirror's
            bytes, or, where they are wsum64 and `digester` is given, by it where the
            mirror lies. None checks what can be checked where the mirror is; True
            insists (a GPU mirror needs `digester`, and a version whose digests it
            cannot check is refused with `InvalidArgumentError`); False checks none
            (but those of bytes read from relays).
        digester: Computes wsum64 digests where a GPU mirror lies (a `Digester`, as a
            publisher's; `weightpull.integrations.torch_digests.wsum64_digests`).
        patcher: Patches a delta where a GPU mirror lies (a `Patcher`;
            `weightpull.integrations.torch_delta.patch_region`); needs `digester`. None:
            such a mirror reads every version whole. Host mirrors need none.
        clock: The local clock; `MonotonicClock` if None.
        lease: The lease settings (`LeaseSettings`: `ttl`, `renew_every`,
            `stall_timeout`).
        relaying: The relay settings (`RelaySettings`: `host`, `relay`, `relay_cap`,
            `spare_mirror`).
        deltas: Patch a held version into a newer one from its delta (see above);
            False reads every version whole.
        **flat: The same settings one by one (`FlatPullerArgs`).

    Raises:
        InvalidArgumentError: a setting is out of range or breaks a rule with another
            (all named at once), a flat argument contradicts `lease`/`relaying`, the
            registry cannot stream (`stream`) or hand out sources (`host`), a relay's
            mirror would be fed through host staging (it cannot be exported), or a
            `patcher` on a GPU has no `digester` to check what it patched.
    """

    def __init__(
        self,
        registry: Registry,
        transport: Transport,
        *,
        holder: str | None = None,
        publisher: str | None = None,
        device: str = "cpu",
        staging: bool | None = None,
        stream: bool = False,
        verify_digests: bool | None = None,
        digester: Digester | None = None,
        patcher: Patcher | None = None,
        clock: Clock | None = None,
        lease: LeaseSettings | None = None,
        relaying: RelaySettings | None = None,
        deltas: bool = True,
        **flat: Unpack[FlatPullerArgs],
    ) -> None:
        settings = puller_settings(
            lease=lease,
            relaying=relaying,
            device=device,
            stream=stream,
            verify_digests=verify_digests,
            digester=digester,
            **flat,
        )
        if patcher is not None and (not callable(patcher) or (device != "cpu" and digester is None)):
            raise InvalidArgumentError(
                f"patcher={patcher!r}: a patcher is a callable, and a patch on {device!r} is checked where it lies: "
                "give digester= too (weightpull.integrations.torch_digests.wsum64_digests)"
            )
        self.transport = transports.for_device(transport, device, staging)
        # Refused now, not at the first pull; a mirror fed through host staging cannot relay.
        settings.check_fit(registry, staged=self.transport is not transport)
        self.settings = settings
        leasing, relays = settings.lease, settings.relaying
        self._registry = registry
        self.clock = clock or MonotonicClock()
        self.leases = LeaseClient(registry, settings.lease, holder=holder, clock=self.clock, publisher=publisher)
        self.holder, self.publisher = self.leases.holder, self.leases.publisher
        self.relays = RelayServer(registry, relays, holder=self.holder, clock=self.clock, ttl=settings.lease.ttl)
        self.checker = DigestChecker(device, digester)
        # The settings as attributes, as a puller has always had them.
        self.ttl, self.renew_every, self.stall_timeout = leasing.ttl, leasing.renew_interval, leasing.stall_timeout
        self.host, self.relay, self.relay_cap = relays.host, relays.relay, relays.relay_cap
        self.spare_mirror = relays.spare_mirror
        self.device = device
        self.digester = digester
        self.patcher = patcher
        # Other pullers of one replica (a `MirrorPair`'s), whose mirrors a delta's base may be
        # copied from: never written here, and what is patched from them is checked.
        self.siblings: list[Puller] = []
        self._outgrown: tuple[Region, int | None] | None = None  # a device mirror that grew: the base, until patched
        self._hinted = False  # that a device mirror could patch with a patcher: said once
        self.verify_digests = (device == "cpu" or digester is not None) if verify_digests is None else verify_digests
        self._insist = bool(verify_digests)  # digests that cannot be checked here refuse the version
        self.stream = stream
        self.mirror: Region | None = None
        self.mirror_version: int | None = None  # what the mirror holds, verified
        self.deltas = deltas
        self._held: dict[int, Manifest] = {}  # the manifests of what the mirrors hold, verified: a delta's base
        self.layout_signature: str | None = None
        self.layout_changes = 0
        self._manifests: OrderedDict[int, Manifest] = OrderedDict()
        self._remotes = Connections(self.transport, _MAX_REMOTES)
        self._lock: anyio.Lock | None = None  # made lazily: needs a running event loop
        self._last: Pulled | None = None
        self._pulled_from = ""  # the source of the last copy _pull made ("": the slot)
        self._behind: int | None = None  # versions the mirror lagged when the last pull began
        self._counts = {
            "pulls": 0,
            "failed": 0,
            "torn_reads": 0,
            "stalls": 0,
            "borrows": 0,
            "patched": 0,
            "unpatched": 0,
        }

    @property
    def registry(self) -> Registry:
        """The registry versions are leased from; set, its leases and offers go there too."""
        return self._registry

    @registry.setter
    def registry(self, registry: Registry) -> None:
        self._registry = self.leases.registry = registry
        self.relays.registry = cast(RelayingRegistry, registry)

    @property
    def offered(self) -> int | None:
        """The version this mirror is offered for, as a relay; None: not offered."""
        return self.relays.offered

    async def pull(self, version: int | None = None) -> Pulled:
        """Copy the newest READY version (or `version`, if READY) into the mirror; with
        `stream`, the newest READY or STREAMING one (or `version`, if either).

        The lease is released on every path. Pulls run one at a time (a prefetch and a
        forced load may overlap): two at once would write the one mirror together and
        hand on a mix.

        Args:
            version: The version to pull; None: the newest.

        Returns:
            The verified copy, valid until the next pull into this mirror starts.

        Raises:
            NoReadyVersionError: nothing is READY yet (`version` None).
            VersionStateError: `version` is not READY (nor STREAMING, with `stream`).
            TornReadError: the lease lapsed during the read (the copy may mix versions).
            DigestMismatchError: the publisher recorded digests and a bucket disagrees.
            NoProgressError: no read landed for `stall_timeout`.
            TransportError: the transport's error, after cancelling the other reads.
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            before = self._last.version if self._last else None
            try:
                pulled = await self._pull_from_sources(version)
            except Exception as exc:
                self._counts["failed"] += 1
                self._counts["torn_reads"] += isinstance(exc, TornReadError)
                self._counts["stalls"] += isinstance(exc, NoProgressError)
                raise
            self._counts["pulls"] += 1
            # Known only for a pull of the newest: then the version pulled was the newest.
            self._behind = pulled.version - before if version is None and before is not None else None
            self._last = pulled
            return pulled

    @asynccontextmanager
    async def borrow(
        self, version: int | None = None, *, wait: float = 0.0, whole: bool = True
    ) -> AsyncIterator[Borrowed]:
        """Lend the newest READY version (or `version`, if READY) in place, for the block:
        the publisher's slot itself, mapped into this process, under a lease renewed
        until the block ends and then released. No mirror and no copy: an apply reads
        straight from the slot into the model, one copy where `pull` then apply make two
        (a GPU slot on this GPU or an NVLink peer over `cuda_ipc`; a host slot for a
        host `device`, over `cuda_ipc` or the in-process `fake`).

        The block only reads. If it ends normally but the lease lapsed meanwhile (a stall
        past the TTL), leaving it raises `TornReadError`: what it read may mix versions,
        so whatever it applied must be undone. Digests are checked, before the block, as
        a pull checks them (a host slot with `verify_digests`). Raises
        `InvalidArgumentError` where the driver cannot lend the slot to `device` (it only
        copies: `pull` instead) or the version is sharded over several slots.

        With `wait` (seconds), it first waits for `version` (without one, any version) to
        turn READY, as the trainer finishes writing it: notified, not polled, and
        `VersionWaitTimeoutError` after `wait`.

        A puller made with `stream=True` leases a version still being written (streamed by
        its publisher), maps its slot and fetches its manifest meanwhile, and lends it the
        moment it turns READY: the READY notice is then all that stands between the
        trainer's last copy and the apply. With `wait` and a `version`, it waits for that
        version to begin streaming (or be READY), even before the trainer begins it. A
        stream that ends otherwise raises `TornReadError` before the block.

        With `whole=False` too, the block is entered at once, while the trainer still
        writes: `lent.landed()` names the tensors as their buckets are committed, so an
        apply runs behind the trainer's copy. Leaving the block then waits for the version
        to turn READY and checks the lease (and a host slot's digests): a stream that ends
        otherwise raises `TornReadError` (from `landed()`, or on leaving), and whatever the
        block applied must be undone, as for a lapsed lease.

        Args:
            version: The version to lend; None: the newest.
            wait: Seconds to wait for it first (0: not at all).
            whole: Lend it only once whole (READY); False (with `stream`) lends it while
                still written.

        Yields:
            The slot lent (`Borrowed`), valid inside the block only.

        Raises:
            TornReadError: the lease lapsed while borrowed, or a stream ended otherwise.
            VersionWaitTimeoutError: nothing turned READY within `wait`.
            DigestMismatchError: a host slot's bucket disagrees with its digest.
            InvalidArgumentError: the driver cannot lend the slot to `device`, the
                version is sharded, `wait` is not a finite number >= 0, or `whole=False`
                without `stream`.
        """
        if not (isinstance(wait, (int, float)) and 0 <= wait < math.inf):
            raise InvalidArgumentError(f"wait must be a finite number of seconds >= 0, got {wait!r}")
        if not whole and not self.stream:
            raise InvalidArgumentError(
                "borrow(whole=False) lends a version still being written: make the Puller with stream=True"
            )
        streaming = as_streaming(self.registry) if self.stream else None
        if wait and streaming is not None and version is not None:  # leasable once its first bucket is marked
            await streaming.wait_for_buckets(version, 1, timeout=wait, **self._line)
        elif wait:  # the manifest comes with the answer: no second fetch
            self._keep_manifest(await self.registry.wait_for_version(version or 0, timeout=wait, **self._line))
        lease, pacer = await self.leases.acquire(version, streaming=streaming is not None)
        renewal, released = None, False
        try:
            manifest = await self._manifest(lease.version)
            check_transport(manifest, self.transport)
            if manifest.shards:
                raise InvalidArgumentError(
                    f"v{manifest.version} is sharded over {len(manifest.shards)} slots; pull() it into a mirror"
                )
            try:
                region = await self._view(manifest)
            except (RegionNotRegisteredError, PeerGoneError):
                self._forget(manifest)  # connect afresh next time
                raise
            if region is None:
                raise InvalidArgumentError(
                    f"the {self.transport.name} driver cannot lend v{manifest.version}'s slot to {self.device} in "
                    "place (it copies): pull() it into a mirror instead"
                )
            renewal = self.leases.renewal(lease, pacer)
            try:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(renewal.run, lambda: None)  # a lapse is told when the block ends
                    if whole:
                        manifest = await self._whole(manifest, region, streamed=streaming is not None)
                        lent = Borrowed(manifest.version, manifest, region)
                    else:
                        wait_for = functools.partial(self._wait_for_buckets, manifest, source="")
                        lent = Borrowed(manifest.version, manifest, region, wait=wait_for)
                    try:
                        yield lent
                        if not whole:  # read while written: what it read is good once whole
                            seen = lent._seen[-1].state if lent._seen else None
                            ready = seen in (VersionState.READY, VersionState.RETIRED)
                            await self._whole(manifest, region, streamed=not ready)
                    finally:
                        tg.cancel_scope.cancel()
            except BaseExceptionGroup as group:
                raise first_error(group) from None
            released = True  # finish() releases it, whatever it says
            await renewal.finish("while it was borrowed; what was read of it may mix versions")
            self._counts["borrows"] += 1
        finally:
            self._manifests.pop(lease.version, None)  # a manifest is trusted for one lease's span
            if not released:
                await self.leases.release(renewal.lease if renewal else lease)

    @property
    def _line(self) -> LineArgs:
        """`publisher=` of the registry calls that pick a version: only when one is named
        (a registry of an earlier release takes none)."""
        return self.leases.line

    async def _whole(self, manifest: Manifest, region: Region, *, streamed: bool) -> Manifest:
        """A borrowed version once READY (`streamed`: waited for, torn if it ends
        otherwise), its host slot checked against its digests; its manifest, with them."""
        if streamed:  # else seen READY already
            await self._until_ready(manifest, source="")
        if manifest.digests is None and self.stream and self.verify_digests and region.view is not None:
            manifest = await self._manifest(manifest.version)  # the READY one's digests, if any
        if manifest.digests is not None and self.verify_digests and region.view is not None:
            await self.checker.verify(manifest, region)
        return manifest

    async def prepare(self, *, mirror: bool = True) -> int:
        """Do now what the first pull would do first, from the slots publishers registered
        ahead (`Publisher.reserve`): register the mirror at the size their versions take
        (unless `mirror=False`: a replica that only `borrow`s keeps none), connect to each
        slot and map it (page-locking a host slot takes seconds for gigabytes). It runs
        in worker threads, so the event loop keeps renewing leases, and pulls wait for it.
        Returns the slots mapped: 0 while no publisher over this transport has reserved
        any (or the registry takes no reservations). Calling it again maps slots reserved
        since; a slot it cannot map is logged and left to the first pull, which fails on
        it as it would have anyway.

        Args:
            mirror: Register the mirror (and the spare one, with `spare_mirror`) too.

        Returns:
            The slots mapped.
        """
        if not isinstance(self.registry, ReservingRegistry):
            return 0
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:
            found = [r for r in await self.registry.reservations() if r.transport == self.transport.name]
            nbytes = max((r.nbytes for r in found), default=0)
            if mirror and nbytes:
                if self.mirror is None:  # only a first mirror: a later one may be being applied
                    self.mirror = await self._allocate(nbytes)
                if self.spare_mirror and self.relays.spare[0] is None:
                    self.relays.spare = (await self._allocate(nbytes), None, None)
            return await self._remotes.map_ahead([s for r in found for s in r.sources], self.device, self.holder)

    def last_pull(self) -> PullReport | None:
        """How the last good pull went (its seconds, bytes and source: "" for the version's
        own slot, else the relay), as a replica reports it with `report_serving(...,
        pull=...)` for the registry's status; None before the first."""
        last = self._last
        return None if last is None else PullReport(last.seconds, last.nbytes, self._pulled_from)

    def metrics(self) -> dict[str, int | float]:
        """This puller's figures, flat, for a trainer's or a replica's logger: the last
        good pull's version, seconds, bytes, GB/s and lease renewals; how many versions
        the mirror lagged when it began (pulls of the newest after a first one only); and
        counts since this puller was made: good pulls, failed ones, torn reads among
        them, stalls (`NoProgressError`), versions borrowed in place whose lease held
        (`borrow`), versions patched from their delta (`patched`), and patches that did
        not match and were read whole instead (`unpatched`)."""
        out: dict[str, int | float] = {f"pull/{k}": v for k, v in self._counts.items()}
        last = self._last
        if last is not None:
            out.update(
                {
                    "pull/version": last.version,
                    "pull/seconds": last.seconds,
                    "pull/bytes": last.nbytes,
                    "pull/gbps": last.nbytes / last.seconds / 1e9 if last.seconds > 0 else 0.0,
                    "pull/lease_renewals": last.renewals,
                }
            )
        if self._behind is not None:
            out["pull/versions_behind"] = self._behind
        return out

    async def _pull_from_sources(self, version: int | None) -> Pulled:
        """`_pull`, again from another source each time a relay fails it (host= only); a
        failed copy's forwarding is withdrawn before the next source is tried."""
        try:
            pulled = await from_sources(
                self._pull, version, holder=self.holder, on_failure=lambda: self.relays.stop_forwarding(pulled=False)
            )
        except BaseException:
            await self.relays.stop_forwarding(pulled=False)
            raise
        await self.relays.stop_forwarding(pulled=True)
        return pulled

    async def _pull(self, version: int | None, exclude: list[str] | None = None) -> Pulled:
        started = self.clock.now()
        if not self.spare_mirror:
            await self.relays.keep_for_readers()
        lease, pacer = await self.leases.acquire(
            version, streaming=self.stream, host=self.host, exclude=tuple(exclude or ())
        )
        try:
            manifest = await self._manifest(lease.version)
            check_transport(manifest, self.transport)
            self.checker.checkable(manifest, must=self.host is not None or self._insist)  # refused before any read
            if self.spare_mirror and self.offered is not None:
                self.mirror, self.mirror_version = await self.relays.take_spare(self.mirror, self.mirror_version)
            delta = manifest.delta
            # the base, if the mirror grows and a patch can use it (a device's old mirror is held till then)
            keep = delta is not None and self.deltas and delta.base == self.mirror_version and self._patches(manifest)
            mirror = self._mirror_for(manifest.layout, delta.room if delta else 0, keep=keep)
            base = self._base_for(manifest)  # where the delta's base is, if held (the mirror grew keeping it)
            source = lease.source  # as the acquire placed it: "" for the slot, else a relay
            relayed = attrs.evolve(manifest, source=lease.descriptor) if source else manifest
            self.relays.reading_from = source
            self._forwarder(lease.version, manifest, mirror)
            try:
                reads = self._reads(relayed)  # connects to the source
            except TransportError as exc:
                if source:  # a relay gone before the first read: read it elsewhere
                    raise _SourceFailed(source, lease.version) from exc
                raise
            if base is None:
                self.mirror_version = None  # overwritten from here on (a patch: once its section checked)
            patched = False
            try:
                if base is not None:
                    lease, renewals, patched = await self._patched(lease, pacer, manifest, relayed, reads, base)
                else:  # a relay-to-be reads the delta section too: it then serves deltas of what it holds
                    first = self._delta_reads(relayed) if self.host is not None else []
                    lease, renewals = await self._read_all(lease, pacer, manifest, reads, mirror, first)
                if source and not patched:  # bytes no lease vouches for: each bucket against the publisher's digest
                    manifest = await self._verify_relayed(manifest, mirror, source)
            except (TransportError, NoProgressError, DigestMismatchError) as exc:
                if source:  # the relay failed this copy: all of it is dropped, read elsewhere
                    self._forget(relayed)
                    raise _SourceFailed(source, lease.version) from exc
                if isinstance(exc, (RegionNotRegisteredError, PeerGoneError, NoProgressError)):
                    self._forget(
                        manifest
                    )  # the memory or peer behind those connections is gone or stuck: connect afresh
                raise
            if not source and not patched:  # a relayed or patched copy was checked above, every bucket, once
                if self.stream and manifest.digests is None and self.verify_digests:
                    manifest = await self._manifest(manifest.version)  # streamed without: the READY one may have them
                must = self.host is not None or self._insist
                if manifest.digests is not None and self.verify_digests and self.checker.checkable(manifest, must=must):
                    await self.checker.verify(manifest, mirror)
            self.mirror_version = manifest.version
            self._hold(manifest)
            self._pulled_from = source
            base_version = manifest.delta.base if patched and manifest.delta else None
            return Pulled(manifest.version, manifest, mirror, self.clock.now() - started, renewals, base_version)
        finally:
            self._manifests.pop(lease.version, None)  # a manifest is trusted for one lease's span
            self._release_outgrown()
            await self.leases.release(lease)

    def _base_for(self, manifest: Manifest) -> Region | None:
        """The mirror that holds, verified, the base of the version's delta (this one, the
        spare one a relay keeps, the one it outgrew, or a sibling's), if a patch can make
        the version from it here: the same publisher's, of the same layout; else None
        (read it whole)."""
        delta = manifest.delta
        if delta is None or not self.deltas or manifest.shards or not self._patches(manifest):
            return None
        outgrown = self._outgrown or (None, None)
        candidates = [(self._held, self.mirror, self.mirror_version), (self._held, *self.relays.spare[:2])]
        candidates += [(self._held, *outgrown)]
        candidates += [(s._held, s.mirror, s.mirror_version) for s in self.siblings if s is not self]
        for held_by, region, version in candidates:
            held = held_by.get(delta.base)
            if (
                region is not None
                and version == delta.base
                and held is not None
                and held.publisher == manifest.publisher
                and held.layout.signature == manifest.layout.signature
                and region.device == self.device
                and (region.view is not None or self.device != "cpu")
            ):
                return region
        return None

    def _patches(self, manifest: Manifest) -> bool:
        """Whether a delta can be patched where the mirror lies and what it makes checked
        there: on the host, always; on a device, with a patcher and a digester for the
        version's (wsum64) digests."""
        if self.device == "cpu":
            return True
        if self.patcher is not None:
            return manifest.digests is not None and self.checker.checkable(manifest, must=False)
        if not self._hinted:
            self._hinted = True
            log.info(
                "%s: v%s has a delta, read whole into the mirror on %s: give patcher=%s to patch it there",
                self.holder,
                manifest.version,
                self.device,
                patcher_hint(),
            )
        return False

    def _release_outgrown(self) -> None:
        if self._outgrown is not None:
            region, self._outgrown = self._outgrown[0], None
            self.transport.deregister(region)

    def _hold(self, manifest: Manifest) -> None:
        """The mirror now holds `manifest`'s version: forget what no mirror holds any more."""
        self._held[manifest.version] = manifest
        kept = {self.mirror_version, self.relays.spare[1]}
        for version in [v for v in self._held if v not in kept]:
            del self._held[version]

    def _delta_reads(self, manifest: Manifest) -> list[tuple[Remote, int, int, int]]:
        """The reads of the version's delta section (each piece into its place past the
        version in the mirror), from `manifest.source`; none without a delta."""
        if manifest.delta is None or manifest.shards:
            return []
        remote = self._remote(manifest.source)
        return [(remote, offset, offset, n) for offset, n in manifest.delta_pieces()]

    async def _patched(
        self,
        lease: Lease,
        pacer: Pacer,
        manifest: Manifest,
        relayed: Manifest,
        reads: list[tuple[Remote, int, int, int]],
        base: Region,
    ) -> tuple[Lease, int, bool]:
        """Read the version's delta section under the lease, check it, patch the base's
        copy into the mirror and check that against the version's digests: (the lease,
        its renewals, True). A section from a relay that does not match raises
        `DigestMismatchError` (the relay failed: read afresh elsewhere); any other patch
        that fails is read whole under the same lease: (..., False)."""
        delta, mirror, source = manifest.delta, self.mirror, self.relays.reading_from
        assert delta is not None and mirror is not None
        lease, renewals = await self._read_all(lease, pacer, manifest, [], mirror, self._delta_reads(relayed))
        total = manifest.layout.total_bytes
        bad = await self.checker.first_mismatch(mirror, manifest.delta_pieces(), delta.digests)
        if bad is not None and source:
            raise DigestMismatchError(
                f"v{manifest.version}: piece {bad} of its delta read from {source!r} does not match the publisher's digest"
            )
        why = f"piece {bad} of its delta does not match its digest"
        self.mirror_version = None  # overwritten from here on
        if bad is None:
            # a base held apart (the spare mirror relays still read, a sibling's) is patched in a copy
            apart = None if base is mirror else base
            try:
                await anyio.to_thread.run_sync(functools.partial(self._patch, mirror, total, delta, apart))
                await self.checker.verify(manifest, mirror)
            except DigestMismatchError as exc:
                why = f"patched from v{delta.base}, {exc}"
            else:
                self._counts["patched"] += 1
                if self.relays.forwarding is not None:  # the whole copy landed at once
                    self.relays.forwarding.note(0, total)
                    await self.relays.forwarding.send()
                return lease, renewals, True
        self._counts["unpatched"] += 1
        log.warning("%s: v%s %s; reading it whole", self.holder, manifest.version, why)
        lease, more = await self._read_all(lease, pacer, manifest, reads, mirror)
        return lease, renewals + more, False

    def _patch(self, mirror: Region, total: int, delta: Delta, base: Region | None) -> None:
        """Patch the mirror's version from the section past it: on the host by
        `weightpull.delta.patch`, on a device by the patcher, where it lies."""
        if mirror.view is None:
            assert self.patcher is not None
            self.patcher(mirror, total, delta.nbytes, delta.word, base)
            return
        view = mirror.host_view()
        held = None if base is None else base.host_view()[:total]
        patch(view[:total], view[total : total + delta.nbytes], delta.word, base=held, threads=self.checker.threads)

    def _reads(self, manifest: Manifest) -> list[tuple[Remote, int, int, int]]:
        """(remote, its offset, the mirror's offset, bytes) of each read a pull makes:
        each bucket of the slot; or, of a sharded version, each shard's rows of each
        tensor, straight into their place in the full tensor."""
        if not manifest.shards:
            remote = self._remote(manifest.source)
            return [(remote, b.offset, b.offset, b.nbytes) for b in manifest.layout.buckets]
        reads = []
        for shard in manifest.shards:
            remote = self._remote(shard.source, keep=len(manifest.shards))
            reads += [(remote, *read) for read in shard.reads(manifest.layout)]
        return reads

    async def _read_all(
        self,
        lease: Lease,
        pacer: Pacer,
        manifest: Manifest,
        reads: list[tuple[Remote, int, int, int]],
        mirror: Region,
        first: list[tuple[Remote, int, int, int]] | None = None,
    ) -> tuple[Lease, int]:
        """Make every read (concurrently, as the transport sees fit) under the lease; the
        reads `first` (a delta section's) before any of the others."""
        first = first or []

        async def read_all(note: Callable[[int], None]) -> None:
            if first:
                await self._read_many(
                    [(remote, off, mirror, local_off, n) for remote, off, local_off, n in first], note
                )
                if not reads:  # a delta alone, of a version READY when leased
                    return
            ended: list[Progress] = []  # how the stream ended, if it did before its last batch
            async with anyio.create_task_group() as readers:
                if self.relays.forwarding is not None:  # a relay: in order, each read as early as it can land
                    send, receive = anyio.create_memory_object_stream[_Read](math.inf)
                    with receive:
                        for _ in range(RELAY_READS_IN_FLIGHT):
                            readers.start_soon(self._read_in_order, receive.clone(), note, readers)
                    async with send:
                        async for batch in self._batches(manifest, reads, note, ended):
                            for remote, off, local_off, n in batch:
                                send.send_nowait((remote, off, mirror, local_off, n))
                else:
                    async for batch in self._batches(manifest, reads, note, ended):
                        todo = [(remote, off, mirror, local_off, n) for remote, off, local_off, n in batch]
                        readers.start_soon(self._read_many, todo, note)
            if self.stream and not (ended and ended[-1].state in (VersionState.READY, VersionState.RETIRED)):
                await self._until_ready(manifest)  # READY already seen needs no second word

        return await self.leases.read(
            lease,
            pacer,
            read_all if reads or first or self.stream else None,  # else nothing to wait for (every tensor is empty)
            what=f"v{manifest.version}",
            total=sum(read[3] for read in reads + first),
            source=f" from {manifest.publisher!r} over {manifest.transport}; is its publisher alive, and serving "
            "its transport's progress (`async with Publisher(...)`, or `publisher.serve()`)?",
        )

    async def _batches(
        self,
        manifest: Manifest,
        reads: list[tuple[Remote, int, int, int]],
        note: Callable[[int], None],
        ended: list[Progress],
    ) -> AsyncIterator[list[tuple[Remote, int, int, int]]]:
        """The reads, in batches as they may be made: all at once, or of a version still
        STREAMING, each bucket's once the publisher marked it (an unsharded version's
        reads are its buckets, in order). A stream seen ended goes into `ended`."""
        if not self.stream or manifest.shards:
            yield reads
            return
        issued = 0
        while issued < len(reads):
            progress = await self._wait_for_buckets(manifest, issued + 1)
            if progress.state is not VersionState.STREAMING:
                ended.append(progress)
            upto = len(reads) if progress.state is not VersionState.STREAMING else min(progress.committed, len(reads))
            note(0)  # the publisher moved: not a stall
            yield reads[issued:upto]
            issued = upto

    async def _wait_for_buckets(self, manifest: Manifest, at_least: int, source: str | None = None) -> Progress:
        """The stream's progress once `at_least` buckets may be read, or it ended; one
        that ended unfinished is a torn copy. Read from a relay (`source`, by default the
        pull's): the relay's progress, and a relay that offers it no longer is a peer gone
        (read afresh elsewhere)."""
        source = self.relays.reading_from if source is None else source
        try:
            if source:
                relaying = cast(RelayingRegistry, self.registry)
                return await relaying.wait_for_buckets(manifest.version, at_least, source=source)
            return await as_streaming(self.registry).wait_for_buckets(manifest.version, at_least)
        except NoSourceError as exc:
            raise PeerGoneError(f"{self.holder}: {exc}") from exc
        except VersionStateError as exc:
            raise TornReadError(f"{self.holder}: {exc}; the copy was rejected") from exc

    async def _until_ready(self, manifest: Manifest, source: str | None = None) -> None:
        """Return once the version is READY; a stream that ends otherwise is torn."""
        progress = await self._wait_for_buckets(
            manifest, len(manifest.layout.buckets) + 1, source
        )  # more: only its end answers
        if progress.state not in (VersionState.READY, VersionState.RETIRED):  # RETIRED only from READY
            why = f" ({progress.reason})" if progress.reason else ""
            raise TornReadError(
                f"{self.holder}: v{manifest.version} ended {progress.state}{why} while streamed; the copy was rejected"
            )

    async def _read_many(self, reads: list[_Read], landed: Callable[[int], None]) -> None:
        """`transport.read_many(reads)`, calling `landed(nbytes)` as each read lands. A
        driver with a `read_many` of its own (one that batches device copies) is left to
        it, and its reads count as landed together."""
        if self._own_read_many():
            await self.transport.read_many(reads)
            landed(sum(read[4] for read in reads))
            return

        async def read(remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
            await self.transport.read(remote, remote_offset, local, local_offset, nbytes)
            landed(nbytes)

        async with anyio.create_task_group() as tg:
            for r in reads:
                tg.start_soon(read, *r)

    async def _read_in_order(
        self,
        reads: anyio.abc.ObjectReceiveStream[_Read],
        landed: Callable[[int], None],
        tg: anyio.abc.TaskGroup,
    ) -> None:
        """A relay's reads, as they come (bucket order), one at a time: each lands as early
        as it can, and its readers are told at once (`Forwarder`), in a task of `tg` so
        that the next read need not wait for the registry's answer."""
        forwarding = self.relays.forwarding
        assert forwarding is not None
        async with reads:
            async for read in reads:
                if self._own_read_many():
                    await self.transport.read_many([read])
                else:
                    await self.transport.read(*read)
                landed(read[4])
                forwarding.note(read[3], read[4])
                if not forwarding.busy:  # else the send under way sends the newest count next
                    tg.start_soon(forwarding.send)

    def _own_read_many(self) -> bool:
        """The driver has a `read_many` of its own (one that batches device copies)."""
        return type(self.transport).read_many is not Transport.read_many

    def _forwarder(self, version: int, manifest: Manifest, mirror: Region) -> None:
        """With `relay`, the offer of the pull under way (`RelayServer.forward`)."""
        if self.relay and not manifest.shards:
            self.relays.forward(version, manifest.layout, self.transport.export(mirror), sharded=False)
        else:
            self.relays.forwarding = None

    async def _verify_relayed(self, manifest: Manifest, mirror: Region, source: str) -> Manifest:
        """Check every bucket of a copy read from relay `source` against the publisher's
        digests (`DigestMismatchError` naming the first that differs); the manifest they
        came in (a stream's, once committed)."""
        if manifest.digests is None and self.stream:  # streamed: the digests came with its commit
            manifest = await self._manifest(manifest.version)
        self.checker.relayed(manifest, source)
        await self.checker.verify(manifest, mirror, source)
        return manifest

    async def offer(self, *, cap: int | None = None) -> int:
        """Offer the version this mirror holds (the last pull's) to other replicas, as a
        relay. Needs `host`. Until the next pull, the mirror is theirs to read too: that
        pull first withdraws the offer and waits until no lease reads from it (the same
        rule as a trainer's slot), so a replica that relays and keeps pulling should give
        its relay a buffer of its own (docs/guides/fanout.md).

        Args:
            cap: The most leases the offer takes at once; None: no cap.

        Returns:
            The version offered.

        Raises:
            InvalidArgumentError: the puller has no `host`, or no pull has completed.
        """
        if self.host is None:
            raise InvalidArgumentError("only a puller made with host= offers its mirror as a relay")
        if self.mirror is None or self.mirror_version is None:
            raise InvalidArgumentError("nothing to offer: no pull has completed into this mirror")
        return await self.relays.offer(self.mirror_version, self.transport.export(self.mirror), cap=cap)

    async def _manifest(self, version: int) -> Manifest:
        """A version's manifest, fetched once for the lease read under it (a stream's,
        whose digests come at its commit, each time). Kept no longer than that lease: a
        number reclaimed may, much later, be another publisher's (each line numbers its own)."""
        if version in self._manifests:
            return self._manifests[version]
        manifest = await self.registry.get(version)
        if self.stream and manifest.digests is None:  # maybe a stream's, whose digests may come yet
            return manifest
        self._keep_manifest(manifest)
        return manifest

    def _keep_manifest(self, manifest: Manifest) -> None:
        self._manifests[manifest.version] = manifest
        while len(self._manifests) > 4:
            self._manifests.popitem(last=False)

    def _mirror_for(self, layout: Layout, room: int = 0, *, keep: bool = False) -> Region:
        """The registered mirror, with `room` past the version for its delta section. A
        new layout signature means the model changed shape; the mirror is re-registered
        only if the new layout needs more room, keeping what it holds if asked (`keep`: a
        delta's base; the old mirror is then released only once copied)."""
        if layout.signature != self.layout_signature:
            if self.layout_signature is not None:
                self.layout_changes += 1
                log.info("%s: layout changed to %s", self.holder, layout.signature[:8])
            self.layout_signature = layout.signature
        if self.mirror is not None and self.mirror.nbytes >= layout.total_bytes + room:
            return self.mirror
        old, self.mirror = self.mirror, None
        keep = keep and old is not None
        if old is not None and not keep:  # released first: the two need not be held at once
            self.transport.deregister(old)
        self.mirror = self.transport.allocate(layout.total_bytes + room, self.device)
        if old is not None and keep:
            if old.view is None or self.mirror.view is None:  # on a device: the base for the patch, released after
                self._release_outgrown()
                self._outgrown, self.mirror_version = (old, self.mirror_version), None
            else:
                self.mirror.host_view()[: old.nbytes] = old.host_view()
                self.transport.deregister(old)
        return self.mirror

    async def _view(self, manifest: Manifest) -> Region | None:
        """The slot lent in place; in a worker thread where the driver's mapping may take
        seconds (page-locking a host slot), as `_allocate` does."""
        view = functools.partial(self.transport.view, self._remote(manifest.source), self.device)
        return await anyio.to_thread.run_sync(view) if self.transport.slow_allocate else view()

    async def _allocate(self, nbytes: int) -> Region:
        """A mirror made ahead, its pages touched: the first pull then runs as the rest."""

        def allocate() -> Region:
            region = self.transport.allocate(nbytes, self.device)
            fault_in(region)
            return region

        return await anyio.to_thread.run_sync(allocate) if self.transport.slow_allocate else allocate()

    def _remote(self, descriptor: bytes, keep: int = 1) -> Remote:
        return self._remotes.get(descriptor, keep)

    def _forget(self, manifest: Manifest) -> None:
        self._remotes.forget([manifest.source] + [shard.source for shard in manifest.shards or ()])

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        with anyio.CancelScope(shield=True):  # the block's cancellation must not leave the mirror registered
            await self.aclose()

    async def aclose(self) -> None:
        """Disconnect from every slot and deregister the mirror. The registry and the
        transport are the caller's: they stay open. Closing twice is harmless; a later
        `pull` registers a mirror afresh."""
        self._remotes.close()
        if self.mirror is not None:
            self.transport.deregister(self.mirror)
            self.mirror = None
            self.mirror_version = None
        self._held.clear()
        self._release_outgrown()
        spare = self.relays.drop_spare()
        if spare is not None:
            self.transport.deregister(spare)
