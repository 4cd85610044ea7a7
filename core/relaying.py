"""Relay serving: a puller's mirror offered to other replicas (`RelayServer`). It offers
the version the mirror holds (`offer`), or the one a pull is still filling, as its
buckets land (`Forwarder`); keeps a spare mirror so that readers never hold up the next
pull; and, before a mirror is overwritten, withdraws its offer and waits until no lease
reads from it (the same rule as a trainer's slot).
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Sequence
from typing import cast

import anyio

from .clock import Clock
from .errors import InvalidArgumentError, WeightpullError
from .layout import Layout
from .registry import Registry, RelayingRegistry
from .settings import RelaySettings
from .transport import Region

__all__ = ["Forwarder", "RelayServer", "RelaySettings"]

log = logging.getLogger(__name__)


class Forwarder:
    """A relay's offer of the version it is still pulling (`Puller(relay=True)`): made
    once its first bucket lands, then advanced as buckets land. Only a prefix of whole
    buckets counts (reads land in any order); one offer or mark is in flight at a time,
    carrying the newest count, so marks batch themselves to the registry's pace."""

    def __init__(self, server: RelayServer, version: int, layout: Layout, descriptor: bytes) -> None:
        self.server, self.registry, self.version, self.descriptor = server, server.registry, version, descriptor
        self.starts = [b.offset for b in layout.buckets]
        self.sizes = [b.nbytes for b in layout.buckets]
        self.filled = [0] * len(self.sizes)
        self.landed = 0  # buckets held, a prefix
        self.sent: int | None = None  # the count the registry has; None: not offered yet
        self.busy = self.failed = False

    def note(self, offset: int, nbytes: int) -> None:
        """Bytes [offset, offset + nbytes) of the mirror landed."""
        i = bisect.bisect_right(self.starts, offset) - 1
        while nbytes > 0 and 0 <= i < len(self.sizes):
            take = min(nbytes, self.starts[i] + self.sizes[i] - offset)
            self.filled[i] += take
            offset, nbytes, i = offset + take, nbytes - take, i + 1
        while self.landed < len(self.sizes) and self.filled[self.landed] >= self.sizes[self.landed]:
            self.landed += 1

    async def send(self) -> None:
        """Tell the registry the newest count, unless a send is under way (it sends the
        newest after its own). A failure stops forwarding; the relay's own pull goes on."""
        if self.busy or self.failed:
            return
        self.busy = True
        s = self.server
        assert s.host is not None
        try:
            while self.landed > (self.sent or 0):
                count = self.landed
                if self.sent is None:
                    await self.registry.offer(
                        self.version,
                        holder=s.holder,
                        host=s.host,
                        descriptor=self.descriptor,
                        cap=s.settings.relay_cap,
                        landed=count,
                    )
                    s.offered = self.version  # from now on, its next pull waits for its readers
                else:
                    await self.registry.mark_offer(self.version, count, holder=s.holder)
                self.sent = count
        except WeightpullError as exc:
            log.warning("%s: forwarding v%s as a relay stopped: %s", s.holder, self.version, exc)
            self.failed = True
        finally:
            self.busy = False


class RelayServer:
    """The relay side of one puller: what its mirror is offered for, its spare mirror,
    and the offer of the pull under way.

    Args:
        registry: The puller's registry (a `RelayingRegistry` wherever `settings.host`
            is given).
        settings: The relay settings (`RelaySettings`).
        holder: The name the puller's leases and offers are held under.
        clock: The local clock (waits for readers poll on it).
        ttl: The puller's lease TTL (readers are looked for at a tenth of it).
    """

    def __init__(self, registry: Registry, settings: RelaySettings, *, holder: str, clock: Clock, ttl: float) -> None:
        self.registry = cast(RelayingRegistry, registry)
        self.settings, self.holder, self.clock, self.ttl = settings, holder, clock, ttl
        self.offered: int | None = None  # the version the mirror is offered for
        self.spare: tuple[Region | None, int | None, int | None] = (None, None, None)  # (mirror, version, offered)
        self.forwarding: Forwarder | None = None  # the pull under way's offer, with relay
        self.reading_from = ""  # the relay the pull under way reads from ("": the slot)

    @property
    def host(self) -> str | None:
        """This replica's host name (`RelaySettings.host`); None: no relays."""
        return self.settings.host

    async def offer(
        self,
        version: int | None,
        descriptor: bytes,
        *,
        cap: int | None,
        part: str | None = None,
        digests: Sequence[str] | None = None,
    ) -> int:
        """Offer `version`, which the mirror of `descriptor` holds, as a relay: of slice
        layout `part` (vouched for by `digests`, from a copy of the version's slot), if named."""
        if self.host is None:
            raise InvalidArgumentError("only a puller made with host= offers its mirror as a relay")
        if version is None:
            raise InvalidArgumentError("nothing to offer: no pull has completed into this mirror")
        if part is None:  # named only for a slice: a registry of an earlier release takes no part
            await self.registry.offer(version, holder=self.holder, host=self.host, descriptor=descriptor, cap=cap)
        else:
            await self.registry.offer(
                version, holder=self.holder, host=self.host, descriptor=descriptor, cap=cap, part=part, digests=digests
            )
        self.offered = version
        return version

    def forward(self, version: int, layout: Layout, descriptor: bytes, *, sharded: bool) -> Forwarder | None:
        """The offer of a pull under way, with `relay` (none for a sharded version)."""
        self.forwarding = Forwarder(self, version, layout, descriptor) if self.settings.relay and not sharded else None
        return self.forwarding

    async def stop_forwarding(self, *, pulled: bool) -> None:
        """The end of a relay's pull: a copy pulled stays offered whole; one that failed
        is withdrawn at once, so its readers choose again (the next pull still waits for
        them to end their leases)."""
        forwarding, self.forwarding, self.reading_from = self.forwarding, None, ""
        if forwarding is None or forwarding.sent is None:
            return
        version = forwarding.version
        with anyio.CancelScope(shield=True):
            try:
                if not pulled:
                    await self.registry.withdraw(version, holder=self.holder)
                elif forwarding.sent < len(forwarding.sizes):  # its marks stopped short: say it is whole
                    assert self.host is not None
                    await self.registry.offer(
                        version,
                        holder=self.holder,
                        host=self.host,
                        descriptor=forwarding.descriptor,
                        cap=self.settings.relay_cap,
                    )
            except WeightpullError as exc:
                log.warning("%s: could not end forwarding v%s: %s", self.holder, version, exc)

    async def take_spare(self, mirror: Region | None, version: int | None) -> tuple[Region | None, int | None]:
        """The mirror (holding `version`) is offered: leave it to its readers and hand
        back the spare one (and what it holds) to pull into, once the spare's own
        (older) offer is withdrawn and its readers are done. The mirrors swap only then:
        a pull cancelled (or failed) meanwhile leaves both as they were, the spare still
        offered, so the next pull waits for its readers too."""
        spare, spare_version, spare_offered = self.spare
        if spare_offered is not None:
            await self.wait_for_readers(spare_offered)
        self.spare = (mirror, version, self.offered)
        self.offered = None
        return spare, spare_version

    async def keep_for_readers(self) -> None:
        """Before the mirror is overwritten: withdraw its offer, then wait while leases
        still read from it (each ends within its TTL). The offer is forgotten only then:
        a pull cancelled mid-wait, or a withdraw that failed, leaves it to the next pull
        to wait for."""
        if self.offered is not None:
            await self.wait_for_readers(self.offered)
            self.offered = None

    async def wait_for_readers(self, version: int) -> None:
        """Withdraw this holder's offer of `version` (idempotent), then wait until no lease
        reads it."""
        await self.registry.withdraw(version, holder=self.holder)
        while await self.registry.readers_at(version, self.holder):
            await self.clock.sleep(min(0.05, self.ttl / 10))

    def drop_spare(self) -> Region | None:
        """Forget the spare mirror; the region, for its owner to deregister."""
        region, self.spare = self.spare[0], (None, None, None)
        return region
