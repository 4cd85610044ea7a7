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
than its cap; a lease is never placed at its own holder's offer; a lease of a slice
layout (`part`) is only ever placed at the origin or at an offer of that very layout.

An offer of a *slice* (`Offer.part`: a tensor-parallel rank's layout key,
`weightpull.slices.slice_key`) serves only readers of the same layout, and is checked by
its readers against the slice's digests (`attest`): recorded once per version and layout,
by the first relay of that layout whose copy came from the origin.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import attrs

from .digests import kind_of
from .errors import DigestMismatchError, InvalidArgumentError
from .principals import root
from .sources import Reader, Source, choose_source

ORIGIN = "origin"  # the name of a version's own slot among its sources
MAX_PART = 128  # a slice layout's key, at most (slice_key's are 38 characters)
MAX_PART_DIGESTS = 1 << 16  # a slice's digests, one a bucket of its mirror, at most


def check_part(part: object) -> str | None:
    """A slice layout's key (None: the whole version), checked."""
    if part is not None and (not isinstance(part, str) or not 0 < len(part) <= MAX_PART):
        raise InvalidArgumentError(f"a slice layout's key is a string of 1 to {MAX_PART} characters, got {part!r}")
    return part


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
    # The slice layout it holds (`weightpull.slices.slice_key`); None: the whole version.
    part: str | None = None

    def __attrs_post_init__(self) -> None:
        check_part(self.part)
        if self.part is not None and self.landed is not None:
            raise InvalidArgumentError("a slice is offered once whole: an offer of a part takes no landed count")
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
    part: str | None = None  # the reader's slice layout; None: the whole version


class RelayBook:
    def __init__(self, *, origin_cap: int | None = None, origin_host: str = "trainer") -> None:
        Source(ORIGIN, origin_host, cap=origin_cap)  # checks both
        self.origin_cap, self.origin_host = origin_cap, origin_host
        self._offers: dict[int, dict[str, Offer]] = {}  # version -> holder -> offer
        self._placed: dict[str, _Placed] = {}  # lease id -> where it reads
        self._reached: dict[tuple[int, str], int] = {}  # (version, reader) -> hops of its copy
        self._attested: dict[tuple[int, str], tuple[str, ...]] = {}  # (version, part) -> the slice's digests

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
        for part_key in [k for k in self._attested if k[0] == version]:
            del self._attested[part_key]

    def offers(self, version: int, part: str | None = None, *, every: bool = True) -> tuple[Offer, ...]:
        """The version's offers: all of them (`every`), or those of layout `part` alone
        (None: of the whole version)."""
        found = self._offers.get(version, {}).values()
        return tuple(found if every else (o for o in found if o.part == part))

    # -- slices' digests -------------------------------------------------------------------

    def attest(self, version: int, part: str, digests: Sequence[str], holder: str) -> tuple[str, ...]:
        """Record the digests of layout `part`'s slice of `version`, one a bucket of its
        mirror, as `holder` computed them over a copy it read from the origin: the first
        such record stands. One that disagrees with it means two copies from the trainer's
        slot differ: `DigestMismatchError`, and the layout's offers end (neither can be
        told right). The digests recorded."""
        check_part(part)
        if isinstance(digests, str) or not isinstance(digests, Sequence) or not 0 < len(digests) <= MAX_PART_DIGESTS:
            raise InvalidArgumentError(
                f"a slice's digests are 1 to {MAX_PART_DIGESTS} strings, one a bucket of its mirror"
            )
        for d in digests:
            kind_of(d)
        if self.hops_of_placed(version, holder) != 1:
            raise InvalidArgumentError(
                f"{holder!r}: only a copy read from v{version}'s own slot may vouch for its slice's digests "
                "(this one came from a relay, or from no lease placed by host=): offer it with no digests"
            )
        given = tuple(digests)
        known = self._attested.setdefault((version, part), given)
        if known != given:
            for o in self.offers(version, part, every=False):
                self.withdraw(version, o.holder)
            raise DigestMismatchError(
                f"v{version}: {holder!r}'s copy of slice layout {part} from the trainer's slot has digests other "
                "than the copy recorded before: two reads of one READY version differ (a faulty link or driver); "
                "the layout's offers ended"
            )
        return known

    def attested(self, version: int, part: str) -> tuple[str, ...] | None:
        """The digests of layout `part`'s slice of `version` (`attest`); None: none yet."""
        return self._attested.get((version, part))

    # -- leases --------------------------------------------------------------------------

    def leases_at(self, version: int, source: str) -> int:
        return sum(1 for p in self._placed.values() if p.version == version and p.source == source)

    def kept(self, version: int, holder: str) -> bool:
        """Whether a relay must keep its mirror of `version`: leases read from it."""
        return self.leases_at(version, holder) > 0

    def sources(self, version: int, part: str | None = None) -> list[Source]:
        """The version's sources as the policy sees them for a reader of layout `part`
        (None: of the whole version): the origin, then every offer of that layout."""
        origin = Source(ORIGIN, self.origin_host, self.leases_at(version, ORIGIN), self.origin_cap, True, 0)
        relays = [
            Source(o.holder, o.host, self.leases_at(version, o.holder), o.cap, True, o.hops)
            for o in self.offers(version, part, every=False)
        ]
        return [origin, *relays]

    def place(
        self,
        lease_id: str,
        version: int,
        reader: Reader,
        *,
        exclude: Iterable[str] = (),
        part: str | None = None,
    ) -> Offer | None:
        """Place a new lease of `reader` on `version` at the source the policy picks: the
        offer it reads from, or None for the origin's slot. A reader of slice layout
        `part` is placed at the origin or an offer of that layout only; a whole reader
        never at an offer of a slice. `NoSourceError` when none may take it now (every
        one full or excluded): the reader asks again later."""
        if lease_id in self._placed:
            raise InvalidArgumentError(f"lease {lease_id} is placed already")
        check_part(part)
        chosen = choose_source(self.sources(version, part), reader, exclude=exclude)  # never the reader itself
        self._placed[lease_id] = _Placed(version, chosen.name, reader.name, part)
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

    def hops_of_placed(self, version: int, holder: str) -> int | None:
        """`hops_of`, but None where no lease of `holder` on `version` was ever placed."""
        return self._reached.get((version, holder))

    def source_of(self, lease_id: str) -> str | None:
        placed = self._placed.get(lease_id)
        return None if placed is None else placed.source

    def check(self) -> None:
        """The book's invariants; raises AssertionError naming the one broken."""
        for lease_id, p in self._placed.items():
            assert p.source != p.holder, f"lease {lease_id} reads from its own holder's mirror"
            offer = self.offer_of(p.version, p.source)
            assert p.source == ORIGIN or offer is None or offer.part == p.part, (
                f"lease {lease_id} of layout {p.part} reads from an offer of layout {offer.part if offer else None}"
            )
        for version in {p.version for p in self._placed.values()} | set(self._offers):
            for part in {None, *(o.part for o in self.offers(version))}:
                for s in self.sources(version, part):
                    assert s.cap is None or s.leases <= s.cap, f"v{version}: {s.name} holds {s.leases} > cap {s.cap}"
