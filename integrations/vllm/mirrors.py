"""A replica's mirrors, and the thread that fills them while the engine generates.

With a spare mirror (the default), the model always has a last good version at hand: one
mirror holds the version the engine serves, the other (the spare) takes the next one. A
new version is pulled into the spare only, so a failed apply can reload the serving
mirror, and a torn read lands in the spare and goes no further. Without one
(`PullSpec(spare_mirror=False)`: half the memory), the next version is pulled over the
served one: a torn read still goes no further, but a failed apply has no copy of the
served version to go back to (the registry leases a version no more once a newer one is
READY, so it cannot be pulled again either), and the replica must not serve.

A relaying replica (`relay=True`) offers each mirror to other replicas as it fills, and
the offer stands after: the serving mirror serves readers while the spare takes the
next version, so the pair is the relay's buffer of its own (no `Puller(spare_mirror=)`,
which would give each of the two mirrors a third and a fourth). Before a mirror is
written, its older offer is withdrawn and the pull waits while leases still read it.

Pulls run on an event loop of their own, in a background thread, because the engine's
thread runs its own loop and must not wait on one: `BackgroundPulls` is the synchronous
face that thread offers the engine. Nothing here imports vLLM.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any, cast

import anyio
import anyio.from_thread
import torch

from weightpull import errors
from weightpull.errors import ApplyError, InvalidArgumentError, PullError, WeightpullError
from weightpull.puller import Pulled, Puller
from weightpull.registry import Registry, RelayingRegistry
from weightpull.slice_puller import SlicePulled, SlicePuller
from weightpull.slices import RankSlice
from weightpull.transport import Transport

from ..torch_tensors import as_tensors

log = logging.getLogger(__name__)


class MirrorPair:
    """Pullers, each with its own registered mirror, sharing a registry and a transport:
    two (`mirrors=2`: the serving one and the spare), or one. `current` is the version
    the engine serves; pulls go to the spare, or over it when there is none."""

    def __init__(
        self,
        registry: Registry,
        transport: Transport,
        *,
        holder: str,
        ttl: float = 10.0,
        rank_slice: RankSlice | None = None,
        mirrors: int = 2,
        **puller: Any,
    ) -> None:
        """With `rank_slice`, each mirror holds that tensor-parallel rank's slice alone
        (`SlicePuller`); else the whole version."""
        if mirrors not in (1, 2):
            raise InvalidArgumentError(f"a replica keeps one mirror or two (a spare), not {mirrors!r}")
        self.pullers: list[Any] = [
            Puller(registry, transport, holder=holder, ttl=ttl, **puller)
            if rank_slice is None
            else SlicePuller(registry, transport, rank_slice, holder=holder, ttl=ttl, **puller)
            for _ in range(mirrors)
        ]
        for p in self.pullers:  # a delta's base is the version the other mirror serves
            if isinstance(p, Puller):
                p.siblings = self.pullers
        self.registry = registry
        # What the engine serves (a Pulled or SlicePulled), from the mirror it was pulled
        # into; without a spare, that mirror may hold another version since (`holds`).
        self.current: Any = None
        self.current_source = ""  # where `current` was read from ("": the trainer's slot, else the relay)
        self._spare = 0
        # Per mirror, the versions it was offered for as a relay that leases may still read
        # from it: each is forgotten only once withdrawn and read by no lease.
        self._offered: list[set[int]] = [set() for _ in self.pullers]

    async def pull(self, version: int) -> Any:
        """Pull `version` into the spare mirror (`TornReadError` etc. if it is unusable).
        A cancelled pull unwinds before the next one writes the spare: the puller
        runs one pull at a time. A relay's spare is first kept for its readers."""
        index = self._spare
        try:
            await self._keep_for_readers(index)
            return await self.pullers[index].pull(version)
        finally:
            self._note_offer(index)

    def _note_offer(self, index: int) -> None:
        offered = getattr(self.pullers[index], "offered", None)  # a relay's (`Puller.offered`)
        if offered is not None:
            self._offered[index].add(offered)

    async def _keep_for_readers(self, index: int) -> None:
        """Before mirror `index` is written: withdraw each of its offers, then wait while
        leases still read it (each ends within its TTL). The puller does the same before
        its pull, but forgets the offer as it starts to wait; a pull cancelled meanwhile
        (a prefetch of another version cancels it) would leave the next one writing
        under its readers. Here the offer is forgotten only once no lease reads it."""
        self._note_offer(index)
        if not self._offered[index]:
            return
        puller = self.pullers[index]
        registry = cast(RelayingRegistry, self.registry)
        for version in sorted(self._offered[index]):
            await registry.withdraw(version, holder=puller.holder)
            while await registry.readers_at(version, puller.holder):
                await puller.clock.sleep(min(0.05, puller.ttl / 10))
            self._offered[index].discard(version)

    @property
    def offered(self) -> list[int]:
        """The versions this pair's mirrors offer, or did and are still kept for readers.
        Read from the engine's thread while pulls run on their own: copies, no writes."""
        kept = {version for offered in self._offered for version in frozenset(offered)}
        now = {v for p in self.pullers if (v := getattr(p, "offered", None)) is not None}
        return sorted(kept | now)

    @property
    def nbytes(self) -> int:
        """The bytes of the mirrors registered now."""
        return sum(p.mirror.nbytes for p in self.pullers if p.mirror is not None)

    async def prepare(self) -> int:
        """Register every mirror at its size and map the slots publishers reserved ahead
        (`Puller.prepare`, `SlicePuller.prepare`); the slots mapped. A whole mirror's size
        comes from the reservations; a sliced one's from its rank's slice."""
        return sum([await p.prepare() for p in self.pullers])

    def holds(self, pulled: Pulled | SlicePulled) -> bool:
        """Whether a mirror still holds `pulled`'s version whole (a pull since may have
        overwritten it, or begun to)."""
        return any(p.mirror is pulled.region and p.mirror_version == pulled.version for p in self.pullers)

    def promote(self, pulled: Pulled | SlicePulled) -> None:
        """`pulled` now serves: its mirror stops being the spare (where there is one)."""
        index = next((i for i, p in enumerate(self.pullers) if p.mirror is pulled.region), None)
        if index is None or not self.holds(pulled):
            raise InvalidArgumentError(f"v{pulled.version} is no longer held by any mirror")
        self.current = pulled
        self.current_source = _source(pulled, self.pullers[index])
        self._spare = (index + 1) % len(self.pullers)

    async def aclose(self, keep_for: float = 0.0) -> None:
        """Deregister the mirrors; a relay's first withdraws its offers and waits while
        leases read them, at most `keep_for` seconds (its readers check every bucket
        against the publisher's digests, so one cut short reads its copy elsewhere)."""
        try:
            registry = cast(RelayingRegistry, self.registry)
            for index, puller in enumerate(self.pullers):  # first every offer, so that no new reader comes
                self._note_offer(index)
                for version in sorted(self._offered[index]):
                    await registry.withdraw(version, holder=puller.holder)
            with anyio.move_on_after(keep_for):
                for index in range(len(self.pullers)):
                    await self._keep_for_readers(index)
        except WeightpullError as exc:
            log.warning("could not withdraw a relay's offers before closing its mirrors: %s", exc)
        for puller in self.pullers:
            await puller.aclose()


def checkpoint_weights(pulled: Pulled) -> Iterator[tuple[str, torch.Tensor]]:
    """The mirror's tensors, by their checkpoint names, as zero-copy views."""
    yield from as_tensors(pulled.layout, pulled.region).items()


def _source(pulled: Pulled | SlicePulled, puller: Any) -> str:
    """Where `pulled`, the last pull of `puller`, was read from: "" for the trainer's slot,
    else the relay's holder name (a slice says so itself; a whole copy's puller does)."""
    if isinstance(pulled, SlicePulled):
        return pulled.source
    report = puller.last_pull()
    return report.source if report is not None else ""


def _log_failure(future: concurrent.futures.Future[int]) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not prepare the mirrors ahead: %r", future.exception())


def error_info(exc: BaseException) -> dict[str, str]:
    """An error as plain data, to cross a process boundary."""
    return {"type": type(exc).__name__, "message": str(exc)}


def error_from_info(info: Mapping[str, str]) -> WeightpullError:
    """Rebuild an error from its plain-data form (`error_info`), as its weightpull type
    where it has one that takes a message alone, else as a `PullError` naming the type."""
    cls = getattr(errors, info["type"], None)
    if isinstance(cls, type) and issubclass(cls, WeightpullError) and cls is not ApplyError:
        try:
            return cls(info["message"])
        except TypeError:
            pass
    return PullError(f"{info['type']}: {info['message']}")


class BackgroundPulls:
    """A `MirrorPair` on an event loop in its own thread, driven from a synchronous one.

    `setup` runs on that loop and returns (registry, transport): a served registry's
    client and a transport endpoint belong to the loop that made them. `device` holds
    the mirrors ("cpu" or a GPU)."""

    def __init__(
        self,
        setup: Callable[[], Awaitable[tuple[Registry, Transport]]],
        *,
        holder: str,
        ttl: float = 10.0,
        device: str = "cpu",
        rank_slice: RankSlice | None = None,
        mirrors: int = 2,
        **relaying: Any,
    ) -> None:
        """`mirrors`: two (a spare) or one (`MirrorPair`). `relaying`: the `Puller`'s
        `host`, `stream`, `relay` and `relay_cap`, for every mirror. A relay's transport
        is served here (`Transport.serve`): its readers' reads of a NIXL mirror need this
        process's progress."""
        self._stack = contextlib.ExitStack()
        self._portal = self._stack.enter_context(anyio.from_thread.start_blocking_portal())
        try:
            registry, self._transport = self._portal.call(setup)
            self.pair = MirrorPair(
                registry,
                self._transport,
                holder=holder,
                ttl=ttl,
                device=device,
                rank_slice=rank_slice,
                mirrors=mirrors,
                **relaying,
            )
        except BaseException:
            self._stack.close()
            raise
        self._ttl = ttl
        self._serving: concurrent.futures.Future[Any] | None = None
        if relaying.get("relay"):
            self._serving = self._portal.start_task_soon(self._transport.serve)
        self._version: int | None = None  # the version of the pull below
        self._future: concurrent.futures.Future[Any] | None = None

    def prepare(self) -> concurrent.futures.Future[int]:
        """Start mapping the reserved slots and sizing the mirrors, and return at once: it
        takes seconds for gigabytes of host slots, and the engine generates meanwhile (a
        pull started later waits for it: each puller runs one thing at a time)."""
        future = self._portal.start_task_soon(self.pair.prepare)
        future.add_done_callback(_log_failure)
        return future

    def prefetch(self, version: int) -> None:
        """Start pulling `version` into the spare mirror and return at once. Asking again
        for the version under way (or already pulled) does nothing."""
        if self._future is not None:
            if self._version == version and not (self._future.done() and self._future.exception()):
                return
            self._future.cancel()  # another version: the spare is rewritten from scratch
            concurrent.futures.wait([self._future])
        self._version = version
        self._future = self._portal.start_task_soon(self.pair.pull, version)

    def status(self) -> dict[str, Any]:
        """What the background pull has come to, as plain data."""
        future, pulled, error, nbytes, seconds, source = self._future, None, None, None, None, ""
        if future is not None and future.done():
            if future.cancelled():
                error = {"type": "PullError", "message": f"the pull of v{self._version} was cancelled"}
            elif future.exception() is not None:
                error = error_info(future.exception())  # type: ignore[arg-type]
            else:
                result = future.result()
                pulled, nbytes, seconds = result.version, result.nbytes, result.seconds
                puller = next((p for p in self.pair.pullers if p.mirror is result.region), None)
                source = _source(result, puller) if puller is not None else ""
        return {
            "pending": self._version if future is not None and not future.done() else None,
            "pulled": pulled,
            "error": error,
            "serving": self.pair.current.version if self.pair.current else None,
            "bytes": nbytes,  # what the pull read: the whole version, or this rank's slice
            "seconds": seconds,  # how long that pull took
            "source": source,  # where it read from ("": the version's own slot, else a relay)
            "serving_bytes": self.pair.current.nbytes if self.pair.current else None,
            "serving_source": self.pair.current_source,  # where the served copy was read from
            "mirror_bytes": self.pair.nbytes,  # the mirrors registered: what they hold in memory
            "offered": self.pair.offered,  # as a relay: versions offered, or kept for their readers
        }

    def take(self, version: int, timeout: float | None = None) -> Any:
        """The verified copy of `version`, once its pull has finished (blocking)."""
        if self._future is None or self._version != version:
            raise PullError(f"v{version} was never prefetched (last prefetch: v{self._version})")
        try:
            pulled = self._future.result(timeout)
        except concurrent.futures.TimeoutError:
            raise PullError(f"the pull of v{version} did not finish within {timeout} s") from None
        except concurrent.futures.CancelledError:
            raise PullError(f"the pull of v{version} was cancelled") from None
        self._future, self._version = None, None
        return pulled

    def call(self, fn: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        """Run `fn(*args)` on the pulls' event loop, where the registry's client lives
        (`pair.registry`), and return its result (blocking)."""
        return self._portal.call(fn, *args)

    def close(self) -> None:
        """Stop the pull under way, then deregister the mirrors: a relay's once its offers
        are withdrawn and no lease reads them, or after a TTL at most."""
        if self._future is not None:
            self._future.cancel()
            concurrent.futures.wait([self._future], timeout=self._ttl)  # it unwinds before its mirror goes
        with contextlib.suppress(WeightpullError):
            self._portal.call(self.pair.aclose, self._ttl)
            if self._serving is not None:
                self._serving.cancel()
            self._portal.call(self._transport.aclose)
        self._stack.close()
