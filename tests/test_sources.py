"""Source choice (weightpull.sources): the pure policy the registry hands readers a source by."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightpull.errors import InvalidArgumentError, NoSourceError
from weightpull.sources import Reader, Source, choose_source, eligible

A = Reader("replica-a", "host-a")


def test_the_only_live_source_is_chosen():
    assert choose_source([Source("trainer", "host-t")], A).name == "trainer"


def test_the_fewest_live_leases_wins():
    sources = [Source("trainer", "host-t", leases=3), Source("r1", "host-1", leases=1, hops=1)]
    assert choose_source(sources, A).name == "r1"


def test_the_same_host_wins_over_fewer_leases():
    sources = [Source("trainer", "host-t", leases=0), Source("r1", "host-a", leases=5, hops=1)]
    assert choose_source(sources, A).name == "r1"


def test_a_full_same_host_source_gives_way():
    sources = [Source("trainer", "host-t", leases=4), Source("r1", "host-a", leases=2, cap=2, hops=1)]
    assert choose_source(sources, A).name == "trainer"


def test_ties_go_to_fewer_hops_then_the_name():
    sources = [Source("r2", "h2", hops=2), Source("r1", "h1", hops=1), Source("r0", "h0", hops=1)]
    assert choose_source(sources, A).name == "r0"


def test_a_gone_source_is_never_chosen_even_when_idle_and_local():
    sources = [Source("r1", "host-a", alive=False, hops=1), Source("trainer", "host-t", leases=9)]
    assert choose_source(sources, A).name == "trainer"


def test_the_reader_is_never_its_own_source():
    sources = [Source("replica-a", "host-a", hops=1), Source("trainer", "host-t", leases=3)]
    assert choose_source(sources, A).name == "trainer"


def test_an_excluded_source_is_skipped():
    sources = [Source("r1", "host-1", hops=1), Source("trainer", "host-t", leases=3)]
    assert choose_source(sources, A, exclude={"r1"}).name == "trainer"


def test_no_source_says_why():
    with pytest.raises(NoSourceError, match="every source is gone"):
        choose_source([Source("trainer", "t", alive=False)], A)
    with pytest.raises(NoSourceError, match=r"every live source is full \(trainer 2/2\)"):
        choose_source([Source("trainer", "t", leases=2, cap=2), Source("r", "h", alive=False, hops=1)], A)
    with pytest.raises(NoSourceError, match="has no source"):
        choose_source([], A)
    with pytest.raises(NoSourceError, match="excluded"):
        choose_source([Source("trainer", "t")], A, exclude=["trainer"])
    assert issubclass(NoSourceError, LookupError)


@pytest.mark.parametrize(
    "make",
    [
        lambda: Source("", "h"),
        lambda: Source("s", ""),
        lambda: Source("s", "h", leases=-1),
        lambda: Source("s", "h", leases=True),
        lambda: Source("s", "h", cap=0),
        lambda: Source("s", "h", cap=1.5),
        lambda: Source("s", "h", hops=-1),
        lambda: Reader("", "h"),
    ],
)
def test_bad_records_are_refused(make):
    with pytest.raises(InvalidArgumentError):
        make()


def test_bad_calls_are_refused():
    with pytest.raises(InvalidArgumentError, match="listed twice"):
        choose_source([Source("s", "h"), Source("s", "g")], A)
    with pytest.raises(InvalidArgumentError, match="Reader"):
        choose_source([Source("s", "h")], "replica-a")  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="Source records"):
        choose_source([("s", "h")], A)  # type: ignore[list-item]
    with pytest.raises(InvalidArgumentError, match="not the string"):
        choose_source([Source("s", "h")], A, exclude="s")


def test_a_cap_of_k_grows_a_k_ary_tree_when_everyone_asks_at_once():
    """All readers ask at once; a relay offers itself once it holds its first bucket (one
    round later). With a cap of 2: the origin serves 2, each relay 2 more, so 14 readers
    are served in 3 rounds, 3 hops deep."""
    sources = {"trainer": Source("trainer", "t", cap=2)}
    waiting = [Reader(f"r{i}", f"h{i}") for i in range(14)]
    rounds = 0
    while waiting:
        offered = list(sources.values())  # what the registry knows at the round's start
        joined = []
        for reader in list(waiting):
            try:
                chosen = choose_source(offered, reader)
            except NoSourceError:
                continue
            waiting.remove(reader)
            offered = [attrs.evolve(s, leases=s.leases + 1) if s is chosen else s for s in offered]
            joined.append(Source(reader.name, reader.host, cap=2, hops=chosen.hops + 1))
        sources = {s.name: s for s in [*offered, *joined]}
        rounds += 1
    assert rounds == 3
    assert max(s.hops for s in sources.values()) == 3
    assert all(s.leases <= 2 for s in sources.values())


def test_readers_one_after_another_make_a_chain():
    """When each reader offers itself as soon as it leases, the newest relay is the idle
    one: fewest leases makes a chain, every link carrying the bytes once."""
    sources = [Source("trainer", "t")]
    for i in range(5):
        chosen = choose_source(sources, Reader(f"r{i}", f"h{i}"))
        sources = [attrs.evolve(s, leases=s.leases + 1) if s is chosen else s for s in sources]
        sources.append(Source(f"r{i}", f"h{i}", hops=chosen.hops + 1))
    assert [s.hops for s in sources] == [0, 1, 2, 3, 4, 5]
    assert [s.leases for s in sources] == [1, 1, 1, 1, 1, 0]


# -- properties -------------------------------------------------------------------------

HOSTS = st.sampled_from(["h0", "h1", "h2"])


@st.composite
def worlds(draw):
    n = draw(st.integers(0, 8))
    sources = [
        Source(
            f"s{i}",
            draw(HOSTS),
            leases=draw(st.integers(0, 5)),
            cap=draw(st.none() | st.integers(1, 5)),
            alive=draw(st.booleans()),
            hops=draw(st.integers(0, 3)),
        )
        for i in range(n)
    ]
    reader = Reader(draw(st.sampled_from(["s0", "s1", "reader"])), draw(HOSTS))
    exclude = draw(st.sets(st.sampled_from([f"s{i}" for i in range(8)]), max_size=3))
    return sources, reader, exclude


@settings(max_examples=300, deadline=None)
@given(worlds(), st.randoms())
def test_choice_follows_every_rule(world, rnd):
    sources, reader, exclude = world
    ok = eligible(sources, reader, exclude)
    if not ok:
        with pytest.raises(NoSourceError):
            choose_source(sources, reader, exclude=exclude)
        return
    chosen = choose_source(sources, reader, exclude=exclude)
    # never gone, full, excluded or itself
    assert chosen.alive and not chosen.full and chosen.name not in exclude and chosen.name != reader.name
    # the same host when any eligible source is there
    local = [s for s in ok if s.host == reader.host]
    if local:
        assert chosen.host == reader.host
    # the fewest leases within its class, then the fewest hops
    peers = local or ok
    assert chosen.leases == min(s.leases for s in peers)
    assert chosen.hops == min(s.hops for s in peers if s.leases == chosen.leases)
    # the order the registry lists them in does not matter
    shuffled = list(sources)
    rnd.shuffle(shuffled)
    assert choose_source(shuffled, reader, exclude=exclude) == chosen


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 60), st.none() | st.integers(1, 20))
def test_readers_one_after_another_spread_evenly(n_sources, n_readers, cap):
    """Remote readers leasing in turn: no source goes past its cap, and loads differ by
    at most one while any source has room."""
    sources = [Source(f"s{i}", f"h{i}", cap=cap) for i in range(n_sources)]
    for j in range(n_readers):
        try:
            chosen = choose_source(sources, Reader(f"reader{j}", "elsewhere"))
        except NoSourceError:
            assert cap is not None and all(s.leases == cap for s in sources)
            continue
        sources = [Source(s.name, s.host, s.leases + (s.name == chosen.name), s.cap) for s in sources]
    loads = [s.leases for s in sources]
    assert max(loads) - min(loads) <= 1
    assert cap is None or max(loads) <= cap
    assert sum(loads) == min(n_readers, n_sources * cap if cap else n_readers)
