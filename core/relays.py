"""The registry's book of relays: who offers which version, and which lease reads where.

Sans-IO and synchronous, like the registry machine that is to hold it: a replica that
holds version v in a mirror *offers* it (`offer`); a reader's lease is placed at a source
(`place`, by `weightpull.sources.choose_source`: the version's origin, its publisher's
slot, or an offer) and counted there until `release`; a relay keeps its mirror while
`leases_at` it is above zero (`kept`); a principal whose liveness lapsed loses every
offer it made (`lapse`), and a version reclaimed loses its offers (`forget`).

The book keeps no time: leases end when the registry ends them (release, expiry), and
offers when their owner withdraws them or lapses. Invariants (checked by `check`): every
placed lease is at a source that was offered or the origin; no source holds more leases
than its cap; a lease is never placed at its own holder's offer.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from .errors import InvalidArgumentError
from .principals import root
from .sources import Reader, Source, choose_source

ORIGIN = "origin"  # the name of a version's own slot among its sources


@attrs.frozen
class Offer:
    """A replica's offer to serve `version` from its mirror, `descriptor` as its transport
    exported it; `holder` is the name it holds leases under (its principal's or below)."""

    version: int
    holder: str
    host: str
    descriptor: bytes
    cap: int | None = None
    hops: int = 1  # how far from the origin its own copy came (its source's hops + 1)
    # Of a version the relay still receives: how many of its first buckets the mirror
    # holds (it forwards them as they land); None: it holds the version whole.
    landed: int | None = None

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.version, int) or isinstance(self.version, bool) or self.version < 0:
            raise InvalidArgumentError(f"an offer's version must be a non-negative int, got {self.version!r}")
        if self.holder == ORIGIN or not self.holder:
            raise InvalidArgumentError(f"an offer's holder must be a name other than {ORIGIN!r}, got {self.holder!r}")
        if not isinstance(self.descriptor, bytes) or not self.descriptor:
            raise InvalidArgumentError("an offer needs its mirror's descriptor (non-empty bytes)")
        if not isinstance(self.hops, int) or self.hops < 1:
            raise InvalidArgumentError(f"a relay is at least one hop from the origin, got {self.hops!r}")
        if self.landed is not None and (
            not isinstance(self.landed, int) or isinstance(self.landed, bool) or self.landed < 0
        ):
            raise InvalidArgumentError(f"an offer's landed buckets must be a non-negative int, got {self.landed!r}")
        Source(self.holder, self.host, cap=self.cap, hops=self.hops)  # the same checks as a source's


@attrs.define
class _Placed:
    version: int
    source: str  # ORIGIN or an offer's holder
    holder: str


class RelayBook:
    def __init__(self, *, origin_cap: int | None = None, origin_host: str = "trainer") -> None:
        Source(ORIGIN, origin_host, cap=origin_cap)  # checks both
        self.origin_cap, self.origin_host = origin_cap, origin_host
        self._offers: dict[int, dict[str, Offer]] = {}  # version -> holder -> offer
        self._placed: dict[str, _Placed] = {}  # lease id -> where it reads
        self._reached: dict[tuple[int, str], int] = {}  # (version, reader) -> hops of its copy

    # -- offers --------------------------------------------------------------------------

    def offer(self, offer: Offer) -> None:
        """Record (or renew, with a new descriptor or cap) `offer`. A cap below the leases
        already reading from it is refused: it would shed readers mid-read."""
        if not isinstance(offer, Offer):
            raise InvalidArgumentError(f"offer takes an Offer, got {offer!r}")
        placed = self.leases_at(offer.version, offer.holder)
        if offer.cap is not None and placed > offer.cap:  # a new cap sheds no reader
            raise InvalidArgumentError(
                f"{offer.holder}: a cap of {offer.cap} on v{offer.version} is below the {placed} leases reading from it"
            )
        self._offers.setdefault(offer.version, {})[offer.holder] = offer

    def withdraw(self, version: int, holder: str) -> Offer | None:
        """End one offer; leases placed at it keep reading until they end (its owner keeps
        the mirror while `kept` says so). Idempotent."""
        offers = self._offers.get(version, {})
        gone = offers.pop(holder, None)
        if not offers:
            self._offers.pop(version, None)
        return gone

    def mark(self, version: int, holder: str, landed: int) -> Offer:
        """The relay's mirror now holds the first `landed` buckets of `version` (the
        registry checks the count against the version's)."""
        offer = self.offer_of(version, holder)
        if offer is None:
            raise InvalidArgumentError(f"{holder!r} offers no v{version}: offer it first")
        marked = self._offers[version][holder] = attrs.evolve(offer, landed=landed)
        return marked

    def offer_of(self, version: int, holder: str) -> Offer | None:
        return self._offers.get(version, {}).get(holder)

    def drop_offers(self, version: int) -> list[Offer]:
        """End every offer of `version` (its stream ended unfinished, or it cannot be
        verified); leases placed at them read on until they end, as after a withdraw."""
        return list(self._offers.pop(version, {}).values())

    def lapse(self, principal: str) -> list[Offer]:
        """Every offer of a principal whose liveness lapsed, ended: its mirror is gone with
        it, so readers placed there will find their source dead and choose again."""
        gone = [o for offers in self._offers.values() for o in offers.values() if root(o.holder) == principal]
        for o in gone:
            self.withdraw(o.version, o.holder)
        return gone

    def forget(self, version: int) -> None:
        """The version was reclaimed: its offers and placements go with it."""
        self._offers.pop(version, None)
        for lease_id in [i for i, p in self._placed.items() if p.version == version]:
            del self._placed[lease_id]
        for key in [k for k in self._reached if k[0] == version]:
            del self._reached[key]

    def offers(self, version: int) -> tuple[Offer, ...]:
        return tuple(self._offers.get(version, {}).values())

    # -- leases --------------------------------------------------------------------------

    def leases_at(self, version: int, source: str) -> int:
        return sum(1 for p in self._placed.values() if p.version == version and p.source == source)

    def kept(self, version: int, holder: str) -> bool:
        """Whether a relay must keep its mirror of `version`: leases read from it."""
        return self.leases_at(version, holder) > 0

    def sources(self, version: int) -> list[Source]:
        """The version's sources as the policy sees them: the origin, then every offer."""
        origin = Source(ORIGIN, self.origin_host, self.leases_at(version, ORIGIN), self.origin_cap, True, 0)
        relays = [
            Source(o.holder, o.host, self.leases_at(version, o.holder), o.cap, True, o.hops)
            for o in self.offers(version)
        ]
        return [origin, *relays]

    def place(self, lease_id: str, version: int, reader: Reader, *, exclude: Iterable[str] = ()) -> Offer | None:
        """Place a new lease of `reader` on `version` at the source the policy picks: the
        offer it reads from, or None for the origin's slot. `NoSourceError` when none may
        take it now (every one full or excluded): the reader asks again later."""
        if lease_id in self._placed:
            raise InvalidArgumentError(f"lease {lease_id} is placed already")
        chosen = choose_source(self.sources(version), reader, exclude=exclude)  # never the reader itself
        self._placed[lease_id] = _Placed(version, chosen.name, reader.name)
        self._reached[(version, reader.name)] = chosen.hops + 1
        return None if chosen.name == ORIGIN else self._offers[version][chosen.name]

    def release(self, lease_id: str) -> None:
        """The lease ended (released, expired, or its holder lapsed). Idempotent."""
        self._placed.pop(lease_id, None)

    def placed(self) -> list[str]:
        """The lease ids placed, for the registry to release those that ended."""
        return list(self._placed)

    def hops_of(self, version: int, holder: str) -> int:
        """How far from the origin `holder`'s copy of `version` came: one more than the
        source of the last lease it held placed (1 when it read the origin)."""
        return self._reached.get((version, holder), 1)

    def source_of(self, lease_id: str) -> str | None:
        placed = self._placed.get(lease_id)
        return None if placed is None else placed.source

    def check(self) -> None:
        """The book's invariants; raises AssertionError naming the one broken."""
        for lease_id, p in self._placed.items():
            assert p.source != p.holder, f"lease {lease_id} reads from its own holder's mirror"
        for version in {p.version for p in self._placed.values()} | set(self._offers):
            for s in self.sources(version):
                assert s.cap is None or s.leases <= s.cap, f"v{version}: {s.name} holds {s.leases} > cap {s.cap}"
