"""The fan-out model (weightpull.simulate): its figures where they can be worked out by
hand, its invariants over random scenarios, and its refusals."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightpull.errors import InvalidArgumentError
from weightpull.simulate import Failure, Scenario, one_read_s, simulate

MiB = 1 << 20
BASE = dict(nbytes=64 * MiB, bucket_bytes=8 * MiB, bandwidth=100e6, latency=0.001, bucket_overhead=0.002)
T_BYTES = 64 * MiB / 100e6  # one host's link carrying the version once
T_BUCKET = 8 * MiB / 100e6


def test_one_replica_takes_one_read():
    s = Scenario(replicas=1, **BASE)
    assert simulate(s).all_serve_s == pytest.approx(one_read_s(s))
    assert one_read_s(s) == pytest.approx(T_BYTES + 8 * 0.003)


def test_without_relays_the_trainers_link_carries_every_copy():
    out = simulate(Scenario(replicas=8, **BASE))
    # all eight move each bucket together at an eighth of the link, pausing alike between buckets
    assert out.all_serve_s == pytest.approx(8 * T_BYTES + 8 * 0.003)
    assert out.max_hops == 1 and out.restarts == 0


def test_a_cap_of_one_makes_a_chain_that_pipelines():
    one = simulate(Scenario(replicas=1, **BASE)).all_serve_s
    out = simulate(Scenario(replicas=8, relays=True, cap=1, **BASE))
    assert out.max_hops == 8
    # each hop adds about one bucket (and its pause), not a whole copy
    assert out.all_serve_s == pytest.approx(one + 7 * (T_BUCKET + 0.003), rel=0.01)


def test_a_cap_of_two_makes_a_tree():
    one = simulate(Scenario(replicas=1, **BASE)).all_serve_s
    out = simulate(Scenario(replicas=14, relays=True, cap=2, **BASE))
    assert out.max_hops == 3
    assert out.all_serve_s < 2.5 * one  # each link shared by two, three hops of pipelining


def test_relays_that_forward_only_whole_copies_do_not_pipeline():
    forwarded = simulate(Scenario(replicas=3, relays=True, cap=1, **BASE)).all_serve_s
    whole = simulate(Scenario(replicas=3, relays=True, cap=1, forward=False, **BASE)).all_serve_s
    # r1 reads the trainer; once it holds all, r2 reads the trainer and r3 reads r1: two rounds
    assert whole == pytest.approx(2 * one_read_s(Scenario(replicas=1, **BASE)), rel=0.01)
    assert forwarded < 0.7 * whole


def test_without_a_cap_everyone_asks_the_trainer_before_any_relay_holds_a_bucket():
    direct = simulate(Scenario(replicas=4, **BASE)).all_serve_s
    assert simulate(Scenario(replicas=4, relays=True, **BASE)).all_serve_s == pytest.approx(direct)


def test_a_streamed_publish_paces_the_first_reader():
    out = simulate(Scenario(replicas=1, publish_s=2.0, **BASE))
    assert out.all_serve_s == pytest.approx(2.0 + 0.003 + T_BUCKET)  # the last bucket, once committed


def test_a_relay_that_dies_makes_its_readers_start_over_elsewhere():
    chain = dict(replicas=4, relays=True, cap=1, detect_s=0.5, **BASE)
    calm = simulate(Scenario(**chain))
    out = simulate(Scenario(**chain, failures=[Failure(2, 0.3)]))
    assert out.serve_s[1] is None  # replica 2 died
    assert all(t is not None for i, t in enumerate(out.serve_s) if i != 1)
    assert out.restarts == 1  # replica 3 read from it; replica 4 reads from 3 and waits
    assert out.all_serve_s > calm.all_serve_s + 0.5


def test_a_replica_that_dies_after_serving_costs_nobody_a_restart():
    out = simulate(Scenario(replicas=3, **BASE, failures=[Failure(1, 100.0)]))
    assert out.restarts == 0 and out.serve_s[0] is None


# Slices: a tensor-parallel replica's ranks each read a slice of their own layout, on one host.


def test_a_hosts_slices_share_its_link():
    # two slices, each half the bytes at half the link (both ends of it split in two), each
    # in four buckets of its own: the pauses of four buckets, not eight
    s = Scenario(replicas=1, parts=2, **BASE)
    assert simulate(s).all_serve_s == pytest.approx(one_read_s(s))
    assert one_read_s(s) == pytest.approx(T_BYTES + 4 * 0.003)
    assert s.slice_bytes == 32 * MiB and len(s.buckets) == 4


def test_without_relays_sliced_replicas_cost_the_trainers_link_what_whole_ones_do():
    whole = simulate(Scenario(replicas=6, **CLEAN)).all_serve_s
    assert simulate(Scenario(replicas=6, parts=2, **CLEAN)).all_serve_s == pytest.approx(whole)
    assert whole == pytest.approx(6 * T)


def test_slices_relayed_once_whole_by_the_same_rank():
    # the trainer takes two readers (of either layout), each relay one. Layout 0 asks first:
    # r1.0 and r2.0 read the trainer at half its link (T). Then r3.0 reads the trainer (it
    # has room, and 0 hops beats a relay's 1) beside r1.1, both at half its link, until 2T;
    # a relay serves only its own layout, so r2.1 and r3.1 wait. Last, r2.1 reads the
    # trainer and r3.1 relay r1.1, each alone on a link: T/2 more
    s = Scenario(replicas=3, relays=True, forward=False, cap=1, origin_cap=2, parts=2, **CLEAN)
    out = simulate(s)
    assert out.all_serve_s == pytest.approx(2.5 * T)
    assert out.serve_s == pytest.approx((2 * T, 2.5 * T, 2.5 * T)) and out.max_hops == 2
    assert simulate(Scenario(replicas=3, parts=2, **CLEAN)).all_serve_s == pytest.approx(3 * T)  # direct


def test_the_trainers_cap_defaults_to_every_sources():
    assert Scenario(replicas=2, cap=3, **BASE).origin_cap == 3
    assert Scenario(replicas=2, cap=3, origin_cap=None, **BASE).origin_cap is None


# CPUs: hand-checked cases with round figures. A link of 100 MB/s carrying the version takes
# T; each busy link costs its source and reader LINK_CPU together, in cores.
CLEAN = dict(nbytes=64 * MiB, bucket_bytes=8 * MiB, bandwidth=100e6)
T = 64 * MiB / 100e6


def per_byte(cores: float) -> float:
    return cores / 100e6 / 2  # split evenly between sender and reader


def test_two_busy_links_on_one_core_each_move_at_half_speed():
    # forward only whole copies, cap 1: r1 reads the trainer alone (T), then r2 reads the
    # trainer and r3 reads r1 at once: two links, each wanting a whole core
    chain = dict(replicas=3, relays=True, cap=1, forward=False, send_cpu=per_byte(1.0), recv_cpu=per_byte(1.0), **CLEAN)
    assert simulate(Scenario(**chain, cpus=1)).all_serve_s == pytest.approx(T + 2 * T)
    assert simulate(Scenario(**chain, cpus=2)).all_serve_s == pytest.approx(2 * T)
    assert simulate(Scenario(**chain)).all_serve_s == pytest.approx(2 * T)  # no cpus: hosts have their own


def test_a_link_that_wants_two_cores_on_one_moves_at_half_speed():
    s = Scenario(replicas=1, cpus=1, send_cpu=per_byte(2.0), recv_cpu=per_byte(2.0), **CLEAN)
    assert simulate(s).all_serve_s == pytest.approx(2 * T)
    assert one_read_s(s) == pytest.approx(2 * T)


def test_checks_take_a_core_each_and_share_the_cores():
    # two readers of the trainer end their reads together (2T), then both check their copy
    direct = dict(replicas=2, verify_cpu=0.25 / (64 * MiB), **CLEAN)
    assert simulate(Scenario(**direct)).all_serve_s == pytest.approx(2 * T + 0.25)
    assert simulate(Scenario(**direct, cpus=2)).all_serve_s == pytest.approx(2 * T + 0.25)
    assert simulate(Scenario(**direct, cpus=1)).all_serve_s == pytest.approx(2 * T + 0.5)
    assert one_read_s(Scenario(**{**direct, "replicas": 1})) == pytest.approx(T + 0.25)


def test_a_check_and_a_link_share_one_core_in_proportion():
    # r1 reads (T), then checks (0.2 core-s) while r2 reads from it (half a core): 1.5
    # cores wanted of 1, both at 2/3 speed until r1's check ends at T + 0.3; r2 then has
    # T - 0.2 to read at full speed and checks its copy alone
    s = dict(
        replicas=2, relays=True, cap=1, forward=False, verify_cpu=0.2 / (64 * MiB),
        send_cpu=per_byte(0.5), recv_cpu=per_byte(0.5), **CLEAN,
    )  # fmt: skip
    assert simulate(Scenario(**s, cpus=1)).all_serve_s == pytest.approx(2 * T + 0.3)
    assert simulate(Scenario(**s)).all_serve_s == pytest.approx(2 * T + 0.2)


def test_without_cpus_the_cost_per_byte_changes_nothing():
    costly = dict(send_cpu=1e-6, recv_cpu=1e-6, replicas=12, relays=True, cap=2)
    assert simulate(Scenario(**BASE, **costly)) == simulate(Scenario(**BASE, replicas=12, relays=True, cap=2))


def test_the_same_scenario_gives_the_same_outcome():
    s = Scenario(replicas=20, relays=True, cap=3, failures=[Failure(5, 0.2), Failure(9, 0.4)], **BASE)
    assert simulate(s) == simulate(s)


@pytest.mark.parametrize(
    "bad",
    [
        dict(replicas=0),
        dict(nbytes=1.5),
        dict(bucket_bytes=0),
        dict(bandwidth=0),
        dict(latency=-1),
        dict(cap=0),
        dict(failures=[Failure(9, 1.0)]),
        dict(cpus=0),
        dict(cpus=1.5),
        dict(send_cpu=-1e-9),
        dict(verify_cpu=-1),
        dict(apply_s=-0.1),
        dict(apply_s=float("nan")),
        dict(parts=0),
        dict(origin_cap=0),
    ],
)
def test_bad_scenarios_are_refused(bad):
    with pytest.raises(InvalidArgumentError):
        Scenario(**{**dict(replicas=2, **BASE), **bad})
    with pytest.raises(InvalidArgumentError):
        simulate("a scenario")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 12),
    buckets=st.integers(1, 6),
    relays=st.booleans(),
    cap=st.none() | st.integers(1, 3),
    forward=st.booleans(),
    deaths=st.lists(st.tuples(st.integers(1, 12), st.floats(0, 3)), max_size=3),
    cpus=st.none() | st.integers(1, 3),
    cores_per_link=st.sampled_from([0.0, 0.3, 1.5]),
    check_s=st.sampled_from([0.0, 0.05]),
    parts=st.integers(1, 3),
    origin_cap=st.none() | st.integers(1, 4),
    apply_s=st.sampled_from([0.0, 0.07]),
)
def test_every_live_replica_ends_up_serving_and_no_link_beats_its_bandwidth(
    n, buckets, relays, cap, forward, deaths, cpus, cores_per_link, check_s, parts, origin_cap, apply_s
):
    failures = [Failure(r, at) for r, at in deaths if r <= n]
    s = Scenario(
        replicas=n,
        nbytes=buckets * MiB,
        bucket_bytes=MiB,
        bandwidth=10e6,
        latency=0.001,
        relays=relays,
        cap=cap,
        forward=forward,
        failures=failures,
        detect_s=0.2,
        cpus=cpus,
        send_cpu=cores_per_link / 10e6,
        verify_cpu=check_s / (buckets * MiB),
        parts=parts,
        origin_cap=origin_cap,
        apply_s=apply_s,
    )
    out = simulate(s)
    dead = {f.replica for f in failures}
    assert [i + 1 for i, t in enumerate(out.serve_s) if t is None] == sorted(dead)
    live = [t for t in out.serve_s if t is not None]
    alone = buckets * MiB / 10e6
    assert all(t >= alone + apply_s - 1e-9 for t in live)  # nobody receives faster than its own link, then applies
    if not relays and not failures and live:
        assert out.all_serve_s >= n * alone + apply_s - 1e-9  # the trainer's link carried every copy
    assert out.max_hops <= n


def test_a_delta_section_costs_its_bytes_when_large_and_its_reads_when_tiny():
    # a delta is read as a section in pieces of the bucket size: the same bucket costs, fewer bytes
    full = Scenario(replicas=1, **BASE)
    quarter = Scenario(replicas=1, **{**BASE, "nbytes": 16 * MiB})  # 2 pieces
    assert one_read_s(quarter) == pytest.approx(T_BYTES / 4 + 2 * 0.003)
    assert simulate(quarter).all_serve_s / simulate(full).all_serve_s == pytest.approx(0.25, abs=0.03)
    tiny = Scenario(replicas=1, **{**BASE, "nbytes": 1024})  # one piece: its read and bucket costs dominate
    assert simulate(tiny).all_serve_s == pytest.approx(0.003, rel=0.01)
    # relayed once whole (a patched relay offers its copy at once): each round costs a whole read
    relayed = simulate(Scenario(replicas=3, relays=True, cap=1, forward=False, **{**BASE, "nbytes": 1024}))
    assert relayed.all_serve_s == pytest.approx(2 * 0.003, rel=0.01) and relayed.max_hops == 2


def test_a_copy_applied_before_it_serves_is_offered_once_applied():
    # a delta's patch and check (apply_s) follow the last byte; a relay not forwarding offers
    # its copy only then, so each round of the tree pays a read and an apply
    one = one_read_s(Scenario(replicas=1, **BASE))
    applied = Scenario(replicas=1, apply_s=0.5, **BASE)
    assert one_read_s(applied) == pytest.approx(one + 0.5)
    assert simulate(applied).all_serve_s == pytest.approx(one + 0.5)
    three = Scenario(replicas=3, relays=True, cap=1, forward=False, apply_s=0.5, **BASE)
    out = simulate(three)  # r1 from the trainer; once r1 applied, r2 from the trainer and r3 from r1
    assert out.all_serve_s == pytest.approx(2 * (one + 0.5), rel=0.01) and out.max_hops == 2
    # on emulated hosts it takes a core as a check does: two at once on one core take twice as long
    shared = Scenario(replicas=2, cpus=1, apply_s=0.5, **{**BASE, "bucket_bytes": 64 * MiB})
    assert simulate(shared).all_serve_s == pytest.approx(2 * T_BYTES + 0.003 + 2 * 0.5, rel=0.01)


def test_a_forwarding_relay_offers_as_it_receives_whatever_it_applies_after():
    # apply_s leaves forwarding alone: readers of a relay read its buckets as they arrive
    forwarded = simulate(Scenario(replicas=8, relays=True, cap=1, apply_s=0.5, **BASE))
    assert forwarded.max_hops == 8
    plain = simulate(Scenario(replicas=8, relays=True, cap=1, **BASE)).all_serve_s
    assert forwarded.all_serve_s == pytest.approx(plain + 0.5, rel=0.01)
