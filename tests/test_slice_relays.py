"""Sliced pulls that stream and relay, in one process over the fake transport: a rank reads
its slice behind the trainer's copy; a rank offers its slice, once whole, to the same
layout's ranks of other replicas, who check it against the digests the layout's first
copy of the trainer's slots gave; a rank of another layout reads the trainer."""

from __future__ import annotations

import anyio
import numpy as np
import pytest

from weightpull import HostTensor, InvalidArgumentError, Puller, Sharding, TornReadError
from weightpull.drivers.fake import FakeFaults
from weightpull.errors import DigestMismatchError, NoReadyVersionError, PublishError
from weightpull.settings import RelaySettings
from weightpull.sharding import chunk_rows
from weightpull.slice_puller import SlicePuller
from weightpull.slices import bucket_needs, plan_slice, slice_key

from .conftest import SlowCopy, autojump
from .test_slice_puller import _check
from .test_slices import _model, _slice

SPECS = _model(vocab_size=22, hidden=16, heads=4, kv=2, inter=40, experts=2)  # 31 KB: 16 buckets of 2 KB


def _full(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {s.name: rng.integers(-(2**31), 2**31 - 1, size=s.shape, dtype=np.int32) for s in SPECS}


async def _publish(world, pubs, version: int) -> dict[str, np.ndarray]:
    """`version` published by len(pubs) FSDP-style shards (dim-0 chunks)."""
    full = _full(version)
    for i, pub in enumerate(pubs):
        tensors, starts = {}, {}
        for s in SPECS:
            a, b = chunk_rows(s.shape[0], i, len(pubs))
            tensors[s.name] = HostTensor("int32", (b - a, *s.shape[1:]), full[s.name][a:b].tobytes())
            starts[s.name] = a
        await pub.publish(version, tensors, shard=Sharding(i, len(pubs), {s.name: s.shape for s in SPECS}, starts))
    return full


pytestmark = pytest.mark.anyio


def _tensors(version: int) -> dict[str, HostTensor]:
    return {n: HostTensor("int32", a.shape, a.tobytes()) for n, a in _full(version).items()}


def _rank(world, rank: int, ranks: int = 2, **kw) -> SlicePuller:
    kw.setdefault("ttl", 30.0)
    transport = kw.pop("transport", None) or world.transport()
    return SlicePuller(world.registry, transport, _slice(SPECS, rank, ranks, 2), clock=world.clock, **kw)


# -- the layout's key and a stream's reads ------------------------------------------------


def test_a_layouts_key_names_the_bytes_held_not_the_rank():
    a, b = _slice(SPECS, 0, 2, 2), _slice(SPECS, 0, 2, 2)
    assert slice_key(a) == slice_key(b) and slice_key(a).startswith("slice-") and len(slice_key(a)) == 38
    keys = {slice_key(_slice(SPECS, r, n, 2)) for n in (2, 4) for r in range(n)}
    assert len(keys) == 6  # every rank of every size holds other bytes
    assert slice_key(a, bucket_bytes=4096) != slice_key(a)  # packed otherwise: other bytes where


async def test_each_streamed_read_waits_for_the_bucket_its_last_byte_lies_in(world):
    pub = world.publisher()
    manifest = (await pub.publish(1, _tensors(1))).manifest
    plan = plan_slice(manifest, _slice(SPECS, 1, 2, 2), bucket_bytes=world.publisher().bucket_bytes)
    needs = bucket_needs(plan, manifest.layout)
    buckets = manifest.layout.buckets
    assert len(buckets) > 3 and len(set(needs)) > 2  # reads wait for several marks
    for read, need in zip(plan.reads, needs, strict=True):
        last = read.src + (read.height - 1) * read.src_pitch + read.width - 1
        assert buckets[need - 1].offset <= last < buckets[need - 1].offset + buckets[need - 1].nbytes


# -- streaming ----------------------------------------------------------------------------

RATE = 4096.0  # bytes a second: the trainer's copy and each rank's read, a bucket in half a second


async def _race(world, ranks, *, fail_at=None):
    """v1 published slowly (streamed) while ranks, each (rank, stream), pull it; what ended when."""
    adapter = SlowCopy(RATE, world.clock.sleep, fail_at, "the trainer's device fell off the bus")
    publisher = world.publisher(stream=True, adapter=adapter)
    pullers = [
        _rank(world, r, stream=stream, holder=f"r{i}", transport=world.transport(faults=FakeFaults(bandwidth=RATE)))
        for i, (r, stream) in enumerate(ranks)
    ]
    ended: dict = {}

    async def publish():
        try:
            await publisher.publish(1, _tensors(1))
        except PublishError as exc:
            ended["publish_error"] = exc
        ended["published"] = world.clock.now()

    async def pull(i, puller):
        while True:
            try:
                ended[i] = await puller.pull()
                break
            except NoReadyVersionError:
                await world.clock.sleep(0.5)
            except Exception as exc:
                ended[i] = exc
                break
        ended[f"end{i}"] = world.clock.now()

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(publish)
        for i, p in enumerate(pullers):
            tg.start_soon(pull, i, p)
    return ended, pullers


async def test_a_streaming_rank_reads_its_slice_behind_the_trainers_copy(world):
    ended, pullers = await _race(world, [(0, True), (1, True), (1, False)])
    full = _full(1)
    copy = ended["published"]
    assert copy > 5  # the copy took seconds
    for i, rank in enumerate((0, 1, 1)):
        _check(ended[i], full, rank, 2)
        assert pullers[i].mirror_version == 1
    for i in (0, 1):  # read as the buckets were marked: done just after the trainer, not a slice later
        assert ended[f"end{i}"] - copy <= 1.0 < ended[i].nbytes / RATE
    assert ended["end2"] - copy >= ended[2].nbytes / RATE - 0.1  # a plain rank reads once READY


async def test_a_stream_that_ends_aborted_leaves_the_rank_a_rejected_slice(world):
    ended, pullers = await _race(world, [(0, True)], fail_at=3)
    assert isinstance(ended["publish_error"], PublishError)
    assert isinstance(ended[0], TornReadError) and "ABORTED" in str(ended[0]) and "slice" in str(ended[0])
    assert pullers[0].mirror_version is None
    assert not any(v.live_leases for v in (await world.registry.status()).versions)


async def test_a_streaming_rank_reads_a_sharded_version_once_ready(world):
    pubs = [world.publisher(name=f"trainer{i}") for i in range(2)]
    full = await _publish(world, pubs, 1)
    async with _rank(world, 1, stream=True) as puller:  # a sharded version never streams: read whole
        _check(await puller.pull(), full, 1, 2)


# -- relays -------------------------------------------------------------------------------


async def _two_replicas(world, **kw):
    """The trainer's two shards publish v1; replica a's ranks relay, replica b's read."""
    pubs = [world.publisher(name=f"trainer{i}") for i in range(2)]
    full = await _publish(world, pubs, 1)
    a = [_rank(world, r, host="node", relay=True, holder=f"a-{r}", **kw) for r in (0, 1)]
    b = [_rank(world, r, host="node", holder=f"b-{r}") for r in (0, 1)]
    return pubs, full, a, b


async def test_a_rank_reads_the_same_rank_of_a_relay_and_the_slice_is_exact(world):
    pubs, full, a, b = await _two_replicas(world)
    machine = world.registry.machine
    for r in (0, 1):
        got = await a[r].pull()
        assert got.source == "" and a[r].offered == 1
        _check(got, full, r, 2)
        (offer,) = machine.relays.offers(1, a[r].layout_key, every=False)
        assert offer.holder == f"a-{r}" and offer.part == a[r].layout_key
        assert len(machine.relays.attested(1, a[r].layout_key)) == len(got.plan.mirror.buckets)
    for pub in pubs:
        await pub.transport.aclose()  # the trainer's slots are gone: only the relays can serve now
    for r in (0, 1):
        pulled = await b[r].pull()
        assert pulled.source == f"a-{r}"  # each rank at the same rank of the relay
        _check(pulled, full, r, 2)
    assert [await world.registry.readers_at(1, f"a-{r}") for r in (0, 1)] == [0, 0]  # the leases ended


async def test_a_rank_of_another_layout_and_a_whole_reader_read_the_trainer(world):
    pubs, full, a, _ = await _two_replicas(world)
    for r in (0, 1):
        await a[r].pull()
    other = _rank(world, 1, ranks=4, host="node", holder="c-1")  # TP=4: no relay holds its bytes
    pulled = await other.pull()
    assert pulled.source == ""
    _check(pulled, full, 1, 4)
    whole = Puller(world.registry, world.transport(), host="node", holder="w", clock=world.clock)
    lease = await whole.leases.acquire(1, host="node")
    assert lease[0].source == ""  # never placed at a slice's relay
    await whole.leases.release(lease[0])
    copy = await whole.pull()
    assert all(bytes(copy.view(n)) == a.tobytes() for n, a in full.items())


async def test_a_relays_changed_bytes_are_caught_and_the_slice_read_from_the_trainer(world, caplog):
    _, full, a, b = await _two_replicas(world)
    await a[0].pull()
    a[0].mirror.host_view()[100] ^= 0xFF  # a bug, or a hostile relay, after it offered
    pulled = await b[0].pull()
    assert pulled.source == ""
    _check(pulled, full, 0, 2)
    assert "does not match its digest from the layout's first copy of the trainer's slot" in caplog.text


async def test_a_relays_bad_padding_is_not_left_in_the_slice_read_again_from_the_trainer(world):
    """A read of the trainer's slots never writes a vocab's padding rows (they stay zero, as
    allocated): after a relay's copy failed, the slice is read into a fresh mirror."""
    _, full, a, b = await _two_replicas(world)
    got = await a[1].pull()
    embed = got.plan.mirror["embed"]
    padding = embed.offset + 10 * 16 * 4  # rank 1 of 2 holds rows 12-23 of the 24 padded: 22 and 23 are padding
    a[1].mirror.host_view()[padding + 5] ^= 0xFF
    pulled = await b[1].pull()
    assert pulled.source == ""
    _check(pulled, full, 1, 2)  # the padding rows zero


async def test_a_relay_gone_mid_serve_sends_its_reader_to_the_trainer(world, caplog):
    _, full, a, b = await _two_replicas(world)
    await a[1].pull()
    a[1].transport.deregister(a[1].mirror)  # its process died; its offer has not lapsed yet
    pulled = await b[1].pull()
    assert pulled.source == "" and "relay 'a-1' failed v1's slice" in caplog.text
    _check(pulled, full, 1, 2)


async def test_a_relay_read_from_a_relay_offers_on_the_first_ones_digests(world):
    pubs, full, a, _ = await _two_replicas(world)
    await a[0].pull()
    for pub in pubs:
        await pub.transport.aclose()
    second = _rank(world, 0, host="node", relay=True, holder="b-0")
    pulled = await second.pull()
    assert pulled.source == "a-0" and second.offered == 1
    offers = {o.holder: o for o in world.registry.machine.relays.offers(1)}
    assert offers["b-0"].hops == 2 and offers["b-0"].part == second.layout_key
    third = _rank(world, 0, host="node", holder="c-0")
    await a[0].aclose()  # withdrawn: only the second relay serves
    pulled = await third.pull()
    assert pulled.source == "b-0"
    _check(pulled, full, 0, 2)


async def test_a_relays_next_pull_waits_for_its_readers(world):
    pubs, full, a, b = await _two_replicas(world)
    await a[0].pull()
    lease, _ = await b[0].leases.acquire(1, host="node", part=b[0].layout_key)
    assert lease.source == "a-0"  # a reader mid-read of the relay's mirror
    v2 = await _publish(world, pubs, 2)
    ended = {}

    async def next_pull():
        ended["pulled"] = await a[0].pull()
        ended["at"] = world.clock.now()

    async with autojump(world.clock), anyio.create_task_group() as tg:
        tg.start_soon(next_pull)
        await world.clock.sleep(3.0)
        assert "pulled" not in ended  # withdrawn at once, but its mirror kept while read
        assert world.registry.machine.relays.offers(1) == ()
        await b[0].leases.release(lease)
    assert ended["at"] >= 3.0 and ended["pulled"].version == 2
    _check(ended["pulled"], v2, 0, 2)


async def test_slice_puller_settings_are_checked_together(world):
    with pytest.raises(InvalidArgumentError, match="spare mirror"):
        _rank(world, 0, relaying=RelaySettings(host="h", spare_mirror=True))
    with pytest.raises(InvalidArgumentError, match="digester="):
        _rank(world, 0, host="h", device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="host="):
        _rank(world, 0, relay=True)


# -- the registry's rules for slices' offers ----------------------------------------------


async def test_the_registry_places_a_slice_only_at_its_layout_and_takes_digests_from_the_trainers_readers(world):
    pubs = [world.publisher(name=f"trainer{i}") for i in range(2)]
    await _publish(world, pubs, 1)
    reg = world.registry
    ok = ["blake2b128:" + "0" * 32]
    await reg.acquire(1, ttl=5, holder="r1", host="h")  # placed at the trainer's slots
    with pytest.raises(InvalidArgumentError, match="no digests of v1's slice layout slice-a are recorded"):
        await reg.offer(1, holder="r1", host="h", descriptor=b"d1", part="slice-a")
    with pytest.raises(InvalidArgumentError, match="pass part="):
        await reg.offer(1, holder="r1", host="h", descriptor=b"d1", digests=ok)
    await reg.offer(1, holder="r1", host="h", descriptor=b"d1", part="slice-a", digests=ok)
    assert await reg.part_digests(1, "slice-a") == tuple(ok) and await reg.part_digests(1, "slice-b") is None
    # Placed by layout: a reader of slice-a at r1's mirror; one of slice-b, and a whole one, at the slots.
    at_a = await reg.acquire(1, ttl=5, holder="r2", host="h", part="slice-a")
    assert at_a.source == "r1" and at_a.descriptor == b"d1"
    assert (await reg.acquire(1, ttl=5, holder="r3", host="h", part="slice-b")).source == ""
    assert (await reg.acquire(1, ttl=5, holder="r4", host="h")).source == ""
    # r2's copy came from a relay: it vouches for no digests, but offers on the recorded ones.
    with pytest.raises(InvalidArgumentError, match="only a copy read from v1's own slot"):
        await reg.offer(1, holder="r2", host="h", descriptor=b"d2", part="slice-a", digests=ok)
    await reg.offer(1, holder="r2", host="h", descriptor=b"d2", part="slice-a")
    # Two copies of the trainer's slots that disagree: neither can be told right.
    with pytest.raises(DigestMismatchError, match="two reads of one READY version differ"):
        await reg.offer(1, holder="r4", host="h", descriptor=b"d4", part="slice-a", digests=["blake2b128:" + "1" * 32])
    assert world.registry.machine.relays.offers(1, "slice-a", every=False) == ()
    world.registry.machine.relays.check()
    with pytest.raises(InvalidArgumentError, match="string of 1 to 128"):
        await reg.acquire(1, ttl=5, holder="r5", host="h", part="")


async def test_a_slices_digests_go_with_its_version(world):
    pubs = [world.publisher(name=f"trainer{i}", num_slots=2) for i in range(2)]
    await _publish(world, pubs, 1)
    relay = _rank(world, 0, host="h", relay=True, holder="a-0")
    await relay.pull()
    assert await world.registry.part_digests(1, relay.layout_key) is not None
    await relay.aclose()  # withdrawn: nothing holds v1 now
    await _publish(world, pubs, 2)
    await _publish(world, pubs, 3)  # into v1's slots: v1 is reclaimed first
    assert await world.registry.part_digests(1, relay.layout_key) is None
