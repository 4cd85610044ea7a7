"""The publisher: the trainer's side. Copies a version into a free slot, then announces it.

Slots are registered once (re-registered only when the model outgrows them). A slot is
written only after the registry agrees to reclaim the version it held, which it refuses
while any lease on that version is alive, so a reader never sees its slot change.

Used as `async with Publisher(...) as publisher:`, it serves its transport's progress
for as long as the block runs (some transports complete a reader's read only while the
owner makes progress) and deregisters its slots on the way out.
"""

from __future__ import annotations

import collections
import logging
import queue
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping, Sequence
from typing import Any, TypedDict, Unpack

import anyio
import anyio.lowlevel
import attrs

from .clock import Clock, MonotonicClock
from .delta import Delta, Encoder, check_publishing, encode, pieces, room_for, word_of
from .digests import WSUM64, digest, kind_of
from .errors import (
    InvalidArgumentError,
    NoFreeSlotError,
    PublishError,
    SlotWaitTimeoutError,
    VersionInUseError,
    VersionNotFoundError,
    VersionOrderError,
    WeightpullError,
    first_error,
)
from .layout import DEFAULT_ALIGN, DEFAULT_BUCKET_BYTES, DTYPE_SIZES, Layout, Placement, TensorSpec, plan_layout
from .manifest import Manifest, bucket_digest
from .principals import Principal, Role
from .records import Reservation
from .registry import Registry, ReservingRegistry, as_streaming
from .settings import Digester, PublisherSettings, SlotSettings, WhenFull, merge, refuse
from .sharding import Rows, Shard, Sharding
from .states import SLOT, SlotEvent, SlotState
from .tasks import close_owned
from .tensors import TensorAdapter, adapter_for, landed_now, landing, normalize_dtype
from .transport import Region, Transport, fault_in

log = logging.getLogger(__name__)


_MARK_POLL = 1e-3  # seconds between a streaming publisher's looks at the buckets landed
# The least time between two marks: each costs the event loop that queues the copies as
# much as several buckets' copies do, so marks batch buckets rather than follow each one.
_MARK_EVERY = 2e-3
# While copies are queued, the loop looks which landed (without blocking) and the marker
# (the stream's announce, marks) gets the event loop once per this many buckets: a turn
# per bucket costs more than the copies themselves.
_YIELD_EVERY = 32
# A streaming publish queues a version's copies in about this many writes, each of several
# buckets when there are more: a write costs the loop ~25 us beyond its copies (an event,
# the adapter's checks) on an H200's host, as much as queueing a bucket's copies itself.
_WRITES_PER_VERSION = 48
# The thread that counts queued copies landed starts once all are queued, or this long
# after the first (copies that cannot be asked without blocking must not all land
# unmarked): started earlier, it contends for the GIL with the loop queueing the copies.
_QUEUE_ALONE = 0.02

__all__ = [
    "Digester",
    "FlatPublisherArgs",
    "PublishResult",
    "Publisher",
    "PublisherSettings",
    "SlotSettings",
    "WhenFull",
    "choose_slot",
    "default_name",
]


class FlatPublisherArgs(TypedDict, total=False):
    """The `SlotSettings` a `Publisher` also takes one by one, as keyword arguments (the
    form it has always had): each is the field of the same name."""

    num_slots: int
    when_full: WhenFull | str
    wait_timeout: float | None
    poll_interval: float


@attrs.frozen
class PublishResult:
    version: int
    skipped: bool
    slot: int | None
    manifest: Manifest | None
    blocked_s: float  # how long publish() held the caller


@attrs.define
class _Slot:
    index: int
    state: SlotState = SlotState.FREE
    region: Region | None = None
    descriptor: bytes = b""
    version: int | None = None  # committed version it holds, or aborted one to reclaim
    layout: Layout | None = None  # the layout of the committed version it holds (a delta's base)

    def move(self, event: SlotEvent) -> None:
        self.state = SLOT.fire(self.state, event, f"{self.index}")


def _oldest_first(slot: tuple[SlotState, int | None]) -> tuple[bool, int]:
    return slot[1] is not None, slot[1] or 0


def choose_slot(slots: Sequence[tuple[SlotState, int | None]], kept: Collection[int] = ()) -> int | None:
    """Which slot to write next, given each slot's (state, version): an empty one first,
    else the one holding the oldest version the registry does not keep (`kept`: those
    with a live lease, and the newest READY), which reclaiming it frees. None when every
    slot is being written or holds a kept version.

    The registry alone judges leases, on its own clock, and its reclaim both judges and
    frees: so the publisher learns which versions are kept from the refusals of
    reclaims, and asks again for the next slot after each."""
    free = [i for i, (state, version) in enumerate(slots) if state is not SlotState.WRITING and version not in kept]
    return min(free, key=lambda i: _oldest_first(slots[i]), default=None)


def default_name(registry: Registry) -> str:
    """The name of a publisher that gives none: its registry's publisher principal's own
    (so a restarted trainer finds its earlier versions under it), else a fresh one."""
    principal = getattr(registry, "principal", None)
    if isinstance(principal, Principal) and principal.role is Role.PUBLISHER:
        return principal.name
    return f"publisher-{uuid.uuid4().hex[:8]}"


class Publisher:
    """The trainer's side: publishes versions into its slots on `device` (see `publish`).

    The slot settings come grouped (`slot_settings=SlotSettings(...)`) or flat, as
    keyword arguments of the same names (`num_slots=`, `when_full=`, `wait_timeout=`,
    `poll_interval=`): both forms are kept, neither warns; a flat argument beside
    `slot_settings` must agree with it. Every rule the settings keep is checked at once,
    as the publisher is made (`PublisherSettings`), and every one broken is named in one
    error.

    `digests` records a digest per bucket in each manifest, which readers from relays
    check (weightpull.digests): False records none; True BLAKE2b-128 of a host slot, as
    bare hex (what manifests have always held); ``"blake2b128"`` or ``"wsum64"`` that kind,
    as ``kind:hex``. Each is computed where the slot lies, once the version's copies
    landed: a host slot's on the CPU in a worker thread (wsum64 with numpy, at memory
    speed); a slot on a device records only wsum64 (BLAKE2b would first copy the slot to
    the host), computed there by `digester` (`Digester`), which the framework's
    integration supplies: `SnapshotPublisher` passes the torch one, and so must whoever
    makes a Publisher with a GPU slot and digests. A sharded version records none.

    With `deltas`, each version also records its changes from its base (the version
    `publish` names, by default the one this publisher published last, while a slot of
    it still holds it), past the whole version in its slot, for readers whose mirror
    holds the base (`weightpull.delta`, docs/guides/bytes.md). A delta larger than
    `delta_room` of the version is left out: readers read the whole version, as they do
    any version without one. Deltas need digests (a patched copy is checked by them)
    and `stream=False`; slots on a device need `encoder`, which compares them with the
    base where they lie (`weightpull.integrations.torch_delta.encode_region`).

    Args:
        registry: The registry versions are announced to (a `StreamingRegistry` with
            `stream`).
        transport: The driver whose memory the slots are.
        rollout_dtype: The dtype tensors are cast to in the slot; None keeps each
            tensor's own.
        bucket_bytes: The bucket size versions are laid out by.
        align: The alignment of each tensor in a slot.
        digests: What digests each manifest records (see above).
        digester: Computes wsum64 digests where a device slot lies (`Digester`).
        stream: Announce each version as its first buckets land and mark them as they
            do, so that streaming readers read behind the copy.
        device: Where the slots lie: "cpu", or a GPU ("cuda:0").
        name: The publisher's name; None: its registry principal's (`default_name`).
        clock: The local clock; `MonotonicClock` if None.
        adapter: The tensors' adapter; None: found from the first tensor published.
        deltas: Record each version's changes from its base too (see above).
        delta_room: The share of a version's bytes kept in each slot for its delta; a
            larger delta is not recorded.
        encoder: Writes a delta where a device slot lies (`weightpull.delta.Encoder`);
            host slots need none.
        slot_settings: The slots and the policy when none is free (`SlotSettings`:
            `num_slots`, `when_full`, `wait_timeout`, `poll_interval`).
        **flat: The same slot settings one by one (`FlatPublisherArgs`).

    Raises:
        InvalidArgumentError: a setting is out of range or breaks a rule with another
            (all named at once), a flat argument contradicts `slot_settings`, the
            registry cannot stream (`stream`), or `deltas` without digests, on a device
            slot without `encoder`, or with `stream`.
    """

    def __init__(
        self,
        registry: Registry,
        transport: Transport,
        *,
        rollout_dtype: Any = "bfloat16",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        align: int = DEFAULT_ALIGN,
        digests: bool | str = False,
        digester: Digester | None = None,
        stream: bool = False,
        device: str = "cpu",
        name: str | None = None,
        clock: Clock | None = None,
        adapter: TensorAdapter | None = None,
        deltas: bool = False,
        delta_room: float = 0.25,
        encoder: Encoder | None = None,
        slot_settings: SlotSettings | None = None,
        **flat: Unpack[FlatPublisherArgs],
    ) -> None:
        unknown = sorted(set(flat) - {"num_slots", "when_full", "wait_timeout", "poll_interval"})
        if unknown:
            raise TypeError(f"Publisher() got an unexpected keyword argument {unknown[0]!r}")
        self.settings = settings = PublisherSettings(
            slots=merge(slot_settings, SlotSettings, dict(flat), "slot_settings"),
            digests=digests,
            digester=digester,
            device=device,
        )
        self.registry = registry
        self.transport = transport
        self.rollout_dtype = None if rollout_dtype is None else normalize_dtype(rollout_dtype, "rollout_dtype")
        self.when_full = settings.slots.when_full
        self.wait_timeout = settings.slots.wait_bound()  # of an unsharded publish, under `when_full`
        self._sharded_wait = settings.slots.wait_bound(sharded=True)
        self.poll_interval = settings.slots.poll_interval
        self.bucket_bytes = bucket_bytes
        self.align = align
        self.digests = digests
        self.digest_kind: str | None = settings.digest_kind  # None: no digests
        self.digester = digester
        self.stream = stream
        settings.check_fit(registry, stream=stream)  # refused now, not at the first publish
        if deltas:
            problems = check_publishing(room=delta_room, digests=digests, device=device, stream=stream, encoder=encoder)
            refuse(problems, "Publisher")
        self.deltas, self.delta_room, self.encoder = bool(deltas), delta_room, encoder
        self.device = device
        self.name = name or default_name(registry)
        self.clock = clock or MonotonicClock()
        self.adapter = adapter
        self.slots = [_Slot(i) for i in range(settings.slots.num_slots)]
        self.last_version: int | None = None  # the number the registry gave the last publish
        self._published: int | None = None  # the last version this publisher committed: the next delta's base
        self.reservation: Reservation | None = None  # the slots `reserve` registered, last
        self._last_asked: int | None = None
        self._adopted = False  # whether the registry's record of our slots was read
        self._plans: tuple[Any, tuple[Layout, tuple[Rows, ...], Layout]] | None = None  # (what, plan)
        self._lock: anyio.Lock | None = None  # made lazily: needs a running event loop
        self._serving: anyio.abc.TaskGroup | None = None  # while used as a context manager
        self._last: PublishResult | None = None
        self._counts = {"published": 0, "skipped": 0, "failed": 0}

    async def __aenter__(self) -> Publisher:
        if self._serving is not None:
            raise InvalidArgumentError(f"publisher {self.name!r} is already in use as a context manager")
        self._serving = anyio.create_task_group()
        await self._serving.__aenter__()
        self._serving.start_soon(self.serve)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool | None:
        """Stop serving, then deregister the slots. The block's own exception propagates
        as it is; if serving failed (which cancels the block), its error does; if both
        did, a group of the two."""
        serving, self._serving = self._serving, None
        assert serving is not None
        try:
            return await close_owned(serving, exc_info)
        finally:
            with anyio.CancelScope(shield=True):
                await self.aclose()

    @property
    def slot_layout(self) -> Layout | None:
        """Where the tensors last planned (by `reserve` or a publish) lie in a slot; None
        before any plan."""
        return None if self._plans is None else self._plans[1][2]

    def metrics(self) -> dict[str, int | float]:
        """This publisher's figures, flat, for a trainer's logger: the last publish's
        version, the seconds it held the caller and, unless it skipped, the bytes in its
        slot (and its delta's, if it recorded one); and counts since this publisher was made: versions published, skipped for
        want of a free slot, and failed."""
        out: dict[str, int | float] = {f"publish/{k}": v for k, v in self._counts.items()}
        last = self._last
        if last is not None:
            out["publish/version"] = last.version
            out["publish/block_s"] = last.blocked_s
            if last.manifest is not None:
                out["publish/bytes"] = last.manifest.nbytes
                if last.manifest.delta is not None:
                    out["publish/delta_bytes"] = last.manifest.delta.nbytes
        return out

    async def publish(
        self,
        version: int | None,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        *,
        shard: Sharding | None = None,
        base: int | None = None,
    ) -> PublishResult:
        """Copy `tensors` into a free slot and announce them. `version` is the number asked
        for (the training step, say; None: the next): the registry gives it while it is
        free, else the next free number, and the result says which (the manifest records
        the number asked as `step`). Returns once the version is READY, or skipped (policy
        SKIP, or the default WAIT_THEN_SKIP once `wait_timeout` passed without a free slot:
        a warning is logged and `publish/skipped` counts it).

        A failure once the version was begun (the copy, the tensors' own iterator or
        adapter raising midway, the commit) ends it ABORTED in the registry, with the
        reason, and raises `PublishError` chained to the cause; the slot policy's
        `NoFreeSlotError` and `SlotWaitTimeoutError` come before any version is begun and
        keep their types. The previous READY version stays as it was.

        With `shard`, `tensors` are this publisher's rows of a version that `shard.count`
        publishers write together, each asking for the same number: it returns once its
        shard is committed, and the version turns READY when every shard is. Its failure,
        or its skip, aborts the version for every shard.

        With `deltas`, the version also records its changes from `base` (None: the
        version this publisher published last), if a slot still holds that one with the
        same layout and the changes fit `delta_room`; else it is published whole alone.
        The base's slot is kept while another slot can be had.

        Args:
            version: The number asked for; None: the next.
            tensors: The tensors, by name (a mapping, or pairs read once).
            shard: This publisher's part of a sharded version (`Sharding`).
            base: The version a delta is taken against (`deltas` only); None: the last
                published.

        Returns:
            What was published (`PublishResult`): the version given, or a skip.

        Raises:
            PublishError: the publish failed once begun (chained to the cause); the
                version is ABORTED.
            NoFreeSlotError: every slot is kept (`when_full` FAIL).
            SlotWaitTimeoutError: no slot freed within `wait_timeout` (`when_full` WAIT,
                or a sharded publish under the default).
            VersionOrderError: `version` does not exceed the last one asked for.
            InvalidArgumentError: no tensors, a malformed `version`, `shard` with
                digests or without a `version`, or `base` without `deltas`.
        """
        if self._lock is None:
            self._lock = anyio.Lock()
        async with self._lock:  # one publish at a time: slots are taken and filled in turn
            try:
                result = await self._publish(version, tensors, shard, base)
            except Exception:
                self._counts["failed"] += 1
                raise
            self._counts["skipped" if result.skipped else "published"] += 1
            self._last = result
            return result

    async def _publish(
        self,
        asked: int | None,
        tensors: Mapping[str, Any] | Iterable[tuple[str, Any]],
        shard: Sharding | None,
        base: int | None = None,
    ) -> PublishResult:
        started = self.clock.now()
        if asked is not None and (not isinstance(asked, int) or isinstance(asked, bool) or asked < 0):
            raise InvalidArgumentError(f"version must be a non-negative int or None, got {asked!r}")
        if asked is not None and self._last_asked is not None and asked <= self._last_asked:
            raise VersionOrderError(f"version {asked} must exceed the last asked for, {self._last_asked}")
        if shard is not None and self.digests:
            raise InvalidArgumentError("digests cover whole slots; a sharded version records none (digests=False)")
        if shard is not None and asked is None:
            raise InvalidArgumentError("the shards of one version find each other by the number they ask for: pass it")
        if base is not None and not self.deltas:
            raise InvalidArgumentError(f"base=v{base} names a delta's base: make the Publisher with deltas=True")
        base = (base if base is not None else self._published) if self.deltas else None
        # A shard that gives up before it begins still aborts the version, so that its
        # siblings neither wait on it nor hold their slots for it.
        tag = {} if shard is None else {"shard": (shard.index, shard.count)}
        # A mapping is checked whole before anything is asked of the registry (bad input:
        # InvalidArgumentError, nothing recorded); an iterator is read once begun.
        prepared = self._prepare(tensors, shard) if isinstance(tensors, Mapping) else None
        if not self._adopted:
            await self._adopt()
        try:
            slot = await self._take_slot(asked, sharded=shard is not None, keep=base)
        except BaseException as exc:
            if shard is not None and asked is not None:
                await self._abort(asked, repr(exc), tag)
            raise
        if slot is None:
            if shard is not None and asked is not None:
                await self._abort(asked, f"shard {shard.index} found no free slot", tag)
            return PublishResult(-1 if asked is None else asked, True, None, None, self.clock.now() - started)
        slot.move(SlotEvent.FILL)
        try:
            given = await self.registry.begin(asked, publisher=self.name, slot=slot.index, **tag)
        except BaseException as exc:
            slot.move(SlotEvent.ABORT)
            if shard is not None and asked is not None:
                await self._abort(asked, repr(exc), tag)
            raise
        version = asked if given is None else given  # None: a registry of the older protocol
        assert version is not None
        self._last_asked = version if asked is None else asked
        self.last_version = version
        try:
            items, adapter, (layout, rows, packed) = prepared or self._prepare(tensors, shard)
            region = await self._fit(slot, packed.total_bytes + self._room(packed, shard))
            parts = (
                ()
                if shard is None
                else (Shard(shard.index, shard.count, self.name, slot.index, slot.descriptor, rows),)
            )
            manifest = Manifest(
                version, layout, self.transport.name, slot.descriptor, slot.index, self.name, None, parts, asked
            )
            streamed = self.stream and shard is None
            if streamed:
                await self._stream(manifest, adapter, [(v, packed[n]) for n, v in items], region)
            else:
                await adapter.write([(v, packed[n]) for n, v in items], region)
                await adapter.fence()
            # A stream's manifest went out before its bytes landed: it takes no delta.
            delta = None if base is None or streamed else await self._delta(base, slot, region, layout)
            if self.digests:  # the version's buckets, then its delta's pieces
                spans = [(b.offset, b.nbytes) for b in layout.buckets]
                extra = [] if delta is None else pieces(layout.total_bytes, delta.nbytes, layout.bucket_bytes)
                found = await self._digests(region, spans + extra)
                if delta is not None:
                    delta = attrs.evolve(delta, digests=found[len(spans) :])
                manifest = attrs.evolve(manifest, digests=found[: len(spans)], delta=delta)
            if streamed:  # the registry holds the manifest already: only the digests go
                await as_streaming(self.registry).commit_stream(version, manifest.digests)
            else:
                await self.registry.commit(manifest)
        except BaseException as exc:
            slot.move(SlotEvent.ABORT)
            slot.version, slot.layout = version, None  # the ABORTED record must be reclaimed before reuse
            await self._abort(version, repr(exc), tag)
            if isinstance(exc, Exception):
                raise PublishError(f"publish of v{version} failed: {exc!r}") from exc
            raise
        slot.move(SlotEvent.COMMIT)
        slot.version, slot.layout = version, (layout if shard is None else None)
        self._published = version
        return PublishResult(version, False, slot.index, manifest, self.clock.now() - started)

    def _room(self, layout: Layout, shard: Sharding | None) -> int:
        """The bytes kept past a version in its slot for its delta (none unless `deltas`)."""
        if not self.deltas or shard is not None:
            return 0
        return room_for(layout.total_bytes, self.delta_room, self.align)

    async def _delta(self, base: int, slot: _Slot, region: Region, layout: Layout) -> Delta | None:
        """The version's changes from `base`, written past it in `region`; None when no other
        slot holds the base with this layout, or the changes do not fit the room (logged).
        Its digests are added with the version's."""
        held = next((s for s in self.slots if s is not slot and s.version == base and s.layout is not None), None)
        if held is None or held.region is None or held.state is not SlotState.HOLDING or held.layout != layout:
            log.info("%s: no slot holds v%s with this layout: v%s goes out whole", self.name, base, self.last_version)
            return None
        total, room = layout.total_bytes, self._room(layout, None)
        word = word_of(DTYPE_SIZES[spec.dtype] for spec in layout.specs)
        if region.view is None:  # on a device: where the slots lie
            encoder, base_region = self.encoder, held.region
            assert encoder is not None
            found = await anyio.to_thread.run_sync(lambda: encoder(base_region, region, total, word, room))
        else:
            old, new = held.region.host_view(), region.host_view()
            found = await anyio.to_thread.run_sync(
                lambda: encode(old[:total], new[:total], word, new[total : total + room])
            )
        if found is None:
            log.info(
                "%s: v%s changed more than delta_room=%g of it from v%s: no delta",
                self.name,
                self.last_version,
                self.delta_room,
                base,
            )
            return None
        nbytes, changed = found
        return Delta(base, nbytes, room, changed, (), word=word)

    async def _stream(
        self, manifest: Manifest, adapter: TensorAdapter, writes: list[tuple[Any, Placement]], region: Region
    ) -> None:
        """Copy bucket by bucket (a few buckets a write when there are many) while a
        marker announces the stream, then tells the registry how many buckets have
        landed: one mark in flight at a time, carrying the newest count, so marks batch
        themselves to the pace the registry answers at."""
        registry = as_streaming(self.registry)
        by_bucket: dict[int, list[tuple[Any, Placement]]] = {}
        for value, placement in writes:
            by_bucket.setdefault(placement.bucket, []).append((value, placement))
        landed = 0
        moved = anyio.Event()

        def wake(count: int) -> None:
            nonlocal landed
            landed = count
            moved.set()

        announced = False
        # A message cancelled in flight costs its connection, and the commit then waits for
        # a new one (13 ms on an H200's host): once every copy landed, the marker ends as
        # soon as the message it has in flight is answered, not mid-way.
        talking = finished = False

        async def say(message: Awaitable[None]) -> None:
            nonlocal talking
            talking = True
            try:
                await message
            finally:
                talking = False

        async def marker() -> None:
            nonlocal moved, announced
            await say(registry.stream(manifest))  # while the first copies run: they need no word from the registry
            announced = True
            sent = 0
            while not finished:
                if landed > sent:
                    sent = landed
                    await say(registry.mark(manifest.version, sent))
                    if finished:
                        return
                    await anyio.sleep(_MARK_EVERY)
                    continue
                # Woken by a bucket fenced here, or, for the worker thread's, at the next look
                # (always a timed look: the thread may start only after this wait began).
                with anyio.move_on_after(_MARK_POLL):
                    await moved.wait()
                moved = anyio.Event()

        # Every bucket's copy is queued as fast as the adapter takes it. While they are
        # queued, the loop itself asks, at each turn it gives the marker, which landed
        # (a CUDA event answers at once), so marks go out while the copies still run;
        # then one worker thread waits for the rest in order and counts them landed,
        # never calling into the event loop (a call per bucket would cost more than the
        # copies).
        waits: queue.SimpleQueue[tuple[int, Callable[[], None]] | None] = queue.SimpleQueue()
        unseen: collections.deque[tuple[int, Callable[[], None]]] = collections.deque()  # queued, nobody waits

        def look() -> None:
            while unseen and landed_now(unseen[0][1]):
                wake(unseen.popleft()[0] + 1)

        def wait_in_order() -> None:
            nonlocal landed
            while (item := waits.get()) is not None:
                bucket, wait = item
                wait()
                landed = bucket + 1

        waiting = False  # whether the worker thread counts the buckets landed
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(marker)
                async with anyio.create_task_group() as copies:
                    try:
                        buckets = sorted(by_bucket)
                        per_write = max(1, len(buckets) // _WRITES_PER_VERSION)
                        first, yielded = self.clock.now(), 0
                        for start in range(0, len(buckets), per_write):
                            group = buckets[start : start + per_write]
                            await adapter.write([w for b in group for w in by_bucket[b]], region)
                            bucket, queued = group[-1], start + len(group)
                            wait = landing(adapter)
                            if wait is None:  # no way to wait for one write alone: fence it here
                                await adapter.fence()
                                wake(bucket + 1)
                                continue
                            if waiting:
                                waits.put((bucket, wait))
                            else:
                                unseen.append((bucket, wait))
                            # A turn for the marker after the first copies (the GPU works meanwhile), then
                            # one per write until the stream is announced: no mark can go before it.
                            if queued - yielded >= _YIELD_EVERY or (queued > _YIELD_EVERY and not announced):
                                yielded = queued
                                look()
                                await anyio.lowlevel.checkpoint()  # the marker's stream and marks go out
                            if not waiting and (queued == len(buckets) or self.clock.now() - first >= _QUEUE_ALONE):
                                look()
                                while unseen:
                                    waits.put(unseen.popleft())
                                copies.start_soon(anyio.to_thread.run_sync, wait_in_order)
                                waiting = True
                    finally:
                        waits.put(None)
                finished = True  # every bucket landed; the commit tells readers the rest
                if talking:
                    moved.set()
                else:
                    tg.cancel_scope.cancel()
        except BaseExceptionGroup as group:  # the failure itself, not the task groups around it
            raise first_error(group) from None

    def _prepare(
        self, tensors: Mapping[str, Any] | Iterable[tuple[str, Any]], shard: Sharding | None
    ) -> tuple[list[tuple[str, Any]], TensorAdapter, tuple[Layout, tuple[Rows, ...], Layout]]:
        """The tensors, their adapter and the plan of where each goes."""
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        if not items:
            raise InvalidArgumentError("publish needs at least one tensor")
        adapter = self.adapter or adapter_for(items[0][1])
        return items, adapter, self._plan([adapter.describe(n, v, self.rollout_dtype) for n, v in items], shard)

    async def _adopt(self) -> None:
        """Before the first publish, take over what the registry still records in this
        publisher's slots: a process restarted under the same name (before its liveness
        lapsed, or after, while leases kept its versions) finds its earlier versions
        there, a sharded one in a slot of each shard's publisher (`VersionInfo.slots`),
        and must reclaim each before it writes that slot again. Their memory died with the
        process that wrote them, so one it left being written can never be finished: it
        is aborted now, which frees its slots here and its siblings' everywhere."""
        self._adopted = True
        try:
            status = await self.registry.status()
        except WeightpullError as exc:  # the publish itself will meet the registry's state
            log.warning("%s: could not read the registry's status: %s", self.name, exc)
            return
        for info in status.versions:
            held = [s for p, s in info.slots or ((info.publisher, info.slot),) if p == self.name]
            if not held:
                continue
            if info.state.being_written:
                await self._abort(info.version, f"{self.name} restarted while writing it", {})
            for index in held:
                if not 0 <= index < len(self.slots):
                    continue
                slot = self.slots[index]
                if slot.state is not SlotState.FREE or slot.version is not None:
                    continue
                slot.version = info.version
                log.info("%s: slot %d still holds v%d (%s) from before", self.name, index, info.version, info.state)

    async def _abort(self, version: int, reason: str, tag: dict[str, Any]) -> None:
        with anyio.CancelScope(shield=True):
            try:
                await self.registry.abort(version, reason=reason, **tag)
            except WeightpullError as abort_exc:
                log.warning("could not record v%s as ABORTED: %s", version, abort_exc)

    def _plan(self, specs: list[TensorSpec], shard: Sharding | None) -> tuple[Layout, tuple[Rows, ...], Layout]:
        """(the version's layout, the rows a shard holds, the slot's layout). Planned
        once; again only when a tensor's name, dtype or shape, or the sharding, changed."""
        what = (tuple(specs), shard)
        if self._plans is None or self._plans[0] != what:
            if shard is None:
                layout = plan_layout(specs, bucket_bytes=self.bucket_bytes, align=self.align)
                plan: tuple[Layout, tuple[Rows, ...], Layout] = (layout, (), layout)
            else:
                plan = shard.plan(specs, bucket_bytes=self.bucket_bytes, align=self.align)
            self._plans = (what, plan)
        return self._plans[1]

    async def reserve(self, tensors: Iterable[TensorSpec] | int, *, shard: Sharding | None = None) -> None:
        """Allocate, pin and register every slot now, for versions of these tensors (or of
        this many bytes), so that the first publish is as quick as the rest. It runs in a
        worker thread: page-locking and registering gigabytes takes seconds, and the event
        loop meanwhile keeps the registry's heartbeat going. Publishing reserves what it
        must by itself, the same way; a model that outgrows the slots re-registers them.

        The slots are then registered with the registry (a `Reservation`), so that
        replicas map them and size their mirrors before the first version
        (`Puller.prepare`). With `deltas`, each slot and mirror has a delta's room too
        (given bytes are the version's alone)."""
        if not self._adopted:  # the registry's status read now, not in the first publish
            await self._adopt()
        if isinstance(tensors, int):
            room = 0 if not self.deltas or shard is not None else room_for(tensors, self.delta_room, self.align)
            nbytes = version_bytes = tensors + room
            if shard is not None:
                version_bytes = 0  # a shard's slot: the whole version's size is not known
        else:
            layout, _, slot_layout = self._plan(list(tensors), shard)
            room = self._room(layout, shard)
            nbytes, version_bytes = slot_layout.total_bytes + room, layout.total_bytes + room
        for slot in self.slots:
            if slot.state is not SlotState.WRITING:
                await self._fit(slot, nbytes)
        sources = tuple(s.descriptor for s in self.slots if s.region is not None)
        self.reservation = Reservation(self.name, self.transport.name, sources, version_bytes)
        if isinstance(self.registry, ReservingRegistry):
            await self.registry.reserve(self.reservation)

    async def _fit(self, slot: _Slot, nbytes: int) -> Region:
        """The slot's memory, registered once; again only if the model outgrew it."""
        if slot.region is not None and slot.region.nbytes >= nbytes:
            return slot.region
        if slot.region is not None:
            self.transport.deregister(slot.region)
            slot.region = None

        def allocate() -> tuple[Region, bytes]:
            region = self.transport.allocate(nbytes, self.device)
            fault_in(region)  # not in the first version's copy
            return region, self.transport.export(region)

        region, slot.descriptor = (
            await anyio.to_thread.run_sync(allocate) if self.transport.slow_allocate else allocate()
        )
        slot.region = region
        return region

    async def _take_slot(self, version: int | None, *, sharded: bool = False, keep: int | None = None) -> _Slot | None:
        what = "the next version" if version is None else f"v{version}"
        when_full, bound = self.when_full, self.wait_timeout
        if sharded and when_full is WhenFull.WAIT_THEN_SKIP:  # a shard's skip would abort its siblings' version
            when_full, bound = WhenFull.WAIT, self._sharded_wait
        started = self.clock.now()
        deadline = started + bound
        while True:
            kept: dict[int, str] = {}  # version -> why the registry keeps it (its reclaim's refusal)
            # A delta's base (`keep`) is kept while another slot can be had.
            while (index := self._choose([(s.state, s.version) for s in self.slots], kept, keep)) is not None:
                slot = self.slots[index]
                if slot.version is None:
                    return slot
                try:
                    await self.registry.reclaim(slot.version)
                except VersionInUseError as exc:
                    kept[slot.version] = str(exc)
                    continue
                except VersionNotFoundError:
                    pass  # the registry no longer knows it: no lease on it can be valid
                if slot.state is SlotState.HOLDING:
                    slot.move(SlotEvent.RECLAIM)
                slot.version, slot.layout = None, None
                return slot
            detail = "; ".join(
                f"slot {s.index}: "
                + ("being written" if s.state is SlotState.WRITING or s.version is None else kept[s.version])
                for s in sorted(self.slots, key=lambda s: _oldest_first((s.state, s.version)))
            )
            if when_full is WhenFull.SKIP:
                log.info("skipping %s: no free slot (%s)", what, detail)
                return None
            if when_full is WhenFull.FAIL:
                raise NoFreeSlotError(f"no free slot for {what}: {detail}")
            if self.clock.now() >= deadline and when_full is WhenFull.WAIT_THEN_SKIP:
                # The trainer goes on: a reader that holds its lease longer costs a version, never the trainer's time.
                log.warning(
                    "%s: skipping %s after waiting %.3g s for a slot (%s); the next version supersedes it. "
                    "Readers that hold a version longer than a publish takes need another slot (num_slots=%d), "
                    "or when_full='wait' to wait for them",
                    self.name,
                    what,
                    self.clock.now() - started,
                    detail,
                    len(self.slots) + 1,
                )
                return None
            if self.clock.now() >= deadline:
                raise SlotWaitTimeoutError(f"no slot freed for {what} within {bound} s: {detail}")
            await self.clock.sleep(min(self.poll_interval, max(0.0, deadline - self.clock.now())))

    @staticmethod
    def _choose(slots: Sequence[tuple[SlotState, int | None]], kept: Collection[int], keep: int | None) -> int | None:
        if keep is not None and (index := choose_slot(slots, {*kept, keep})) is not None:
            return index
        return choose_slot(slots, kept)

    async def _digests(self, region: Region, spans: Sequence[tuple[int, int]]) -> tuple[str, ...]:
        """The digest of each span (offset, bytes) of the slot, computed where it lies (the
        class's docstring)."""
        kind, bare = self.digest_kind, self.digests is True
        assert kind is not None
        if self.device != "cpu":
            assert self.digester is not None
            digester = self.digester
            got = tuple(await anyio.to_thread.run_sync(lambda: digester(region, spans)))
            if len(got) != len(spans) or any(kind_of(d) != WSUM64 for d in got):
                raise InvalidArgumentError(f"the digester gave {got[:3]}... for {len(spans)} buckets, not wsum64 ones")
            return got
        view = region.host_view()

        def digest_all() -> tuple[str, ...]:
            if bare:  # digests=True: BLAKE2b as bare hex, as manifests have always held it
                return tuple(bucket_digest(view[o : o + n]) for o, n in spans)
            return tuple(digest(view[o : o + n], kind) for o, n in spans)

        return await anyio.to_thread.run_sync(digest_all)

    async def serve(self) -> None:
        """Help replicas' reads of the slots along, until cancelled: some transports
        complete a peer's read only while its owner makes progress. `async with
        Publisher(...)` runs it for you; without that, run it beside the trainer
        (`tg.start_soon(publisher.serve)`) for as long as replicas may read. Returns at
        once for transports that need none."""
        await self.transport.serve()

    async def aclose(self) -> None:
        """Deregister every slot. Versions already announced stop being readable."""
        for slot in self.slots:
            if slot.region is not None:
                self.transport.deregister(slot.region)
                slot.region = None
