"""The registry's book of relays (weightpull.relays): offers, placed leases, lapses."""

from __future__ import annotations

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from weightpull.errors import InvalidArgumentError, NoSourceError
from weightpull.relays import ORIGIN, Offer, RelayBook
from weightpull.sources import Reader


def offer(holder: str, version: int = 1, host: str = "h", **kw) -> Offer:
    return Offer(version, holder, host, f"desc-{holder}".encode(), **kw)


def test_readers_spread_over_the_origin_and_relays_and_keep_them():
    book = RelayBook(origin_cap=1)
    assert book.place("l1", 1, Reader("r1", "h1")) is None  # the origin
    book.offer(offer("r1", host="h1"))
    placed = book.place("l2", 1, Reader("r2", "h2"))
    assert placed is not None and placed.holder == "r1" and placed.descriptor == b"desc-r1"
    assert book.kept(1, "r1") and book.leases_at(1, ORIGIN) == 1
    book.release("l2")
    assert not book.kept(1, "r1")
    book.check()


def test_a_relay_on_the_readers_host_comes_first():
    book = RelayBook()
    book.offer(offer("far", host="h9"))
    book.offer(offer("near", host="h2"))
    assert book.place("l", 1, Reader("r2", "h2")).holder == "near"


def test_a_lapsed_principals_offers_vanish_but_its_readers_leases_stay_placed():
    book = RelayBook()
    book.offer(offer("relay/rank0", host="h1"))
    book.offer(offer("relay/rank1", version=2, host="h1"))
    book.offer(offer("other", host="h3"))
    assert book.place("l", 1, Reader("r", "h1")).holder == "relay/rank0"
    gone = book.lapse("relay")
    assert {o.holder for o in gone} == {"relay/rank0", "relay/rank1"}
    assert [o.holder for o in book.offers(1)] == ["other"] and book.offers(2) == ()
    assert book.source_of("l") == "relay/rank0"  # the reader learns it from its transport and re-chooses
    # then the origin and "other" tie on leases: the origin is fewer hops away
    assert book.place("l2", 1, Reader("r", "h1"), exclude={"relay/rank0"}) is None


def test_full_sources_refuse_and_excluding_all_refuses():
    book = RelayBook(origin_cap=1)
    book.place("a", 1, Reader("r1", "h1"))
    with pytest.raises(NoSourceError, match="full"):
        book.place("b", 1, Reader("r2", "h2"))
    book.offer(offer("r1", cap=1))
    book.place("b", 1, Reader("r2", "h2"))
    with pytest.raises(NoSourceError):
        book.place("c", 1, Reader("r3", "h3"))
    with pytest.raises(InvalidArgumentError, match="placed already"):
        book.place("a", 1, Reader("r1", "h1"))


def test_a_cap_below_the_readers_already_placed_is_refused():
    book = RelayBook()
    book.offer(offer("r1"))
    for i in range(4):  # alternately the origin (fewer hops on a tie) and r1
        book.place(f"l{i}", 1, Reader(f"reader{i}", f"h{i}"))
    assert book.leases_at(1, "r1") == 2 and book.leases_at(1, ORIGIN) == 2
    with pytest.raises(InvalidArgumentError, match="below the 2 leases"):
        book.offer(offer("r1", cap=1))
    book.offer(offer("r1", cap=2))


def test_forgetting_a_version_drops_its_offers_and_placements():
    book = RelayBook()
    book.offer(offer("r1"))
    book.place("l", 1, Reader("r2", "h2"))
    book.forget(1)
    assert book.offers(1) == () and book.source_of("l") is None


@pytest.mark.parametrize(
    "make",
    [
        lambda: Offer(-1, "r", "h", b"d"),
        lambda: Offer(1, ORIGIN, "h", b"d"),
        lambda: Offer(1, "r", "h", b""),
        lambda: Offer(1, "r", "h", b"d", hops=0),
        lambda: Offer(1, "r", "", b"d"),
        lambda: Offer(1, "r", "h", b"d", cap=0),
        lambda: RelayBook(origin_cap=0),
    ],
)
def test_bad_offers_are_refused(make):
    with pytest.raises(InvalidArgumentError):
        make()


NAMES = ["a", "a/x", "b", "c"]


class Book(RuleBasedStateMachine):
    """Offers, leases, lapses and reclaims in any order: the book's invariants hold, and a
    lease is only ever placed at a source that was offered then."""

    def __init__(self) -> None:
        super().__init__()
        self.book = RelayBook(origin_cap=2)
        self.ids = iter(range(10**9))
        self.live: dict[str, tuple[int, str]] = {}

    @rule(version=st.integers(1, 2), holder=st.sampled_from(NAMES), cap=st.none() | st.integers(1, 2))
    def offer(self, version, holder, cap):
        try:
            self.book.offer(offer(holder, version, host=f"h-{holder}", cap=cap))
        except InvalidArgumentError:
            assert cap is not None and self.book.leases_at(version, holder) > cap

    @rule(version=st.integers(1, 2), holder=st.sampled_from(NAMES))
    def withdraw(self, version, holder):
        self.book.withdraw(version, holder)

    @rule(principal=st.sampled_from(["a", "b", "c"]))
    def lapse(self, principal):
        self.book.lapse(principal)
        assert all(not o.holder.startswith(principal) for v in (1, 2) for o in self.book.offers(v))

    @rule(version=st.integers(1, 2), reader=st.sampled_from(NAMES + ["z"]))
    def place(self, version, reader):
        lease_id = f"l{next(self.ids)}"
        offered = {o.holder for o in self.book.offers(version)} | {ORIGIN}
        try:
            where = self.book.place(lease_id, version, Reader(reader, f"h-{reader}"))
        except NoSourceError:
            return
        source = ORIGIN if where is None else where.holder
        assert source in offered and source != reader
        self.live[lease_id] = (version, source)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def release(self, data):
        lease_id = data.draw(st.sampled_from(sorted(self.live)))
        self.book.release(lease_id)
        del self.live[lease_id]

    @rule(version=st.integers(1, 2))
    def forget(self, version):
        self.book.forget(version)
        self.live = {i: p for i, p in self.live.items() if p[0] != version}

    @invariant()
    def holds(self):
        self.book.check()
        for lease_id, (_, source) in self.live.items():
            assert self.book.source_of(lease_id) == source


TestBook = Book.TestCase
TestBook.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
