"""Delta versions (weightpull.delta): the sparse16 section against its pure-Python oracle,
the manifest's record of it, the publisher that writes it past the whole version, and the
puller that patches the copy it holds (and reads the version whole when it cannot)."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weightpull import HostTensor, InvalidArgumentError, Manifest, TornReadError
from weightpull import delta as deltas
from weightpull.delta import Delta
from weightpull.drivers.fake import FakeTransport
from weightpull.errors import DigestMismatchError
from weightpull.layout import TensorSpec, plan_layout

from .conftest import autojump

pytestmark = pytest.mark.anyio

N = 6000  # bf16 elements of the test model's big tensor


def model(version: int, changed: int = 40, seed: int = 0) -> dict[str, HostTensor]:
    """A model whose versions differ in `changed` elements of "w" per step (and "norm"
    never): the bytes of version v are version v-1's with another `changed` flipped."""
    rng = random.Random(seed)
    w = bytearray(rng.randbytes(2 * N))
    for step in range(2, version + 1):
        for i in random.Random(step).sample(range(N), changed):
            w[2 * i] ^= 1 + step % 7
    return {"w": HostTensor("bfloat16", (N,), bytes(w)), "norm": HostTensor("bfloat16", (64,), bytes(128))}


def exact(pulled, version: int, **kw) -> bool:
    return all(bytes(pulled.view(n)) == bytes(t.data) for n, t in model(version, **kw).items())


class Counting(FakeTransport):
    """The fake driver, counting the bytes it reads."""

    read_bytes = 0

    async def read(self, remote, remote_offset, local, local_offset, nbytes):
        self.read_bytes += nbytes
        await super().read(remote, remote_offset, local, local_offset, nbytes)


# -- the section ---------------------------------------------------------------------------------


def pair(size: int, word: int, fraction: float, seed: int) -> tuple[bytes, bytes]:
    rng = random.Random(seed)
    old = bytearray(rng.randbytes(size))
    new = bytearray(old)
    words = size // word
    for i in {0, words - 1, *rng.sample(range(words), int(words * fraction))}:
        new[i * word] ^= 0x5A
    return bytes(old), bytes(new)


@pytest.mark.parametrize("word", deltas.WORDS)
def test_encode_and_patch_agree_with_the_reference_across_chunks(word):
    old, new = pair(3 * deltas.CHUNK * word // 2 + 8 * 7, word, 0.02, word)  # chunks 0, 1 (short)
    into, oracle = bytearray(len(new)), bytearray(len(new))
    got = deltas.encode(memoryview(old), memoryview(new), word, memoryview(into))
    assert got == deltas.encode_reference(memoryview(old), memoryview(new), word, memoryview(oracle))
    size, changed = got
    assert into[:size] == oracle[:size]
    assert size == deltas.section_layout(len(new) // word, changed, word)[2]
    for apply in (deltas.patch, deltas.patch_reference):
        target = bytearray(old)
        apply(memoryview(target), memoryview(into)[:size], word)
        assert target == new


@settings(max_examples=60, deadline=None)
@given(data=st.binary(max_size=256), flips=st.lists(st.integers(0, 255), max_size=20), word=st.sampled_from([1, 2, 8]))
def test_any_change_round_trips(data, flips, word):
    old = data[: len(data) // word * word]
    new = bytearray(old)
    for i in flips:
        if i < len(new):
            new[i] ^= 0xFF
    into = bytearray(4 + 2 * len(old) + 8 + len(old))
    size, changed = deltas.encode(memoryview(old), memoryview(bytes(new)), word, memoryview(into))
    assert changed == sum(old[i : i + word] != new[i : i + word] for i in range(0, len(old), word))
    target = bytearray(old)
    deltas.patch(memoryview(target), memoryview(into)[:size], word)
    assert target == new


def test_a_section_larger_than_its_room_is_none():
    old, new = pair(4096, 2, 0.5, 1)
    room = memoryview(bytearray(1000))  # half of 2048 words changed: 4 bytes each
    assert deltas.encode(memoryview(old), memoryview(new), 2, room) is None
    assert deltas.encode_reference(memoryview(old), memoryview(new), 2, room) is None


@pytest.mark.parametrize("apply", [deltas.patch, deltas.patch_reference])
def test_a_malformed_section_is_a_mismatch_not_a_crash(apply):
    old, new = pair(1000, 2, 0.05, 2)  # 500 words: one short chunk
    into = bytearray(1000)
    size, _ = deltas.encode(memoryview(old), memoryview(new), 2, memoryview(into))
    section = bytes(into[:size])
    target = memoryview(bytearray(old))
    with pytest.raises(DigestMismatchError, match="too short"):
        apply(target, memoryview(b"\0\0"), 2)
    with pytest.raises(DigestMismatchError, match="does not add up"):
        apply(target, memoryview(section[:-2]), 2)
    past = bytearray(section)
    offsets_at = 4
    past[offsets_at : offsets_at + 2] = (600).to_bytes(2, "little")  # a word past the copy's 500
    with pytest.raises(DigestMismatchError, match="names word 600"):
        apply(target, memoryview(bytes(past)), 2)


class Pools:
    """`ThreadPoolExecutor` for `weightpull.delta`, noting each pool's workers and jobs."""

    def __init__(self, monkeypatch):
        from concurrent.futures import ThreadPoolExecutor

        self.made: list[tuple[int, int]] = []
        made = self.made

        class Noted(ThreadPoolExecutor):
            def map(self, fn, jobs):
                jobs = list(jobs)
                made.append((self._max_workers, len(jobs)))
                return super().map(fn, jobs)

        monkeypatch.setattr(deltas, "ThreadPoolExecutor", Noted)


@pytest.mark.parametrize("word", [1, 2, 8])
def test_encoded_and_patched_on_threads_group_by_group_is_the_reference(monkeypatch, word):
    """Encoded on 2 threads and patched on 3, in groups of one chunk (threaded at any size
    here), with the base given apart or already in the target: the reference's section,
    and the version's bytes."""
    from weightpull import digests

    monkeypatch.setattr(deltas, "GROUP", 1)
    monkeypatch.setattr(digests, "_THREADED", 0)
    pools = Pools(monkeypatch)
    old, new = pair(11 * deltas.CHUNK * word // 2 + 8 * 3, word, 0.03, 7)  # 6 chunks, the last short
    into, oracle = bytearray(len(new)), bytearray(len(new))
    size, changed = deltas.encode(memoryview(old), memoryview(new), word, memoryview(into), threads=2)
    assert (size, changed) == deltas.encode_reference(memoryview(old), memoryview(new), word, memoryview(oracle))
    assert into[:size] == oracle[:size]
    assert deltas.encode(memoryview(old), memoryview(new), word, memoryview(into)[: size - 1], threads=2) is None
    assert pools.made == [(2, 6), (2, 6)]
    pools.made.clear()
    section = memoryview(into)[:size]
    target = bytearray(old)
    deltas.patch(memoryview(target), section, word, threads=3)
    assert target == new
    target = bytearray(random.Random(1).randbytes(len(old)))  # the base given apart: none of it held
    deltas.patch(memoryview(target), section, word, base=memoryview(old), threads=3)
    assert target == new
    assert pools.made == [(3, 6), (3, 3), (3, 6)]  # the groups; the base copied a part a thread, then the groups
    deltas.patch(memoryview(bytearray(old)), section, word, threads=1)  # one thread: in turn, no pool
    assert len(pools.made) == 3


def test_a_malformed_section_on_threads_is_still_a_mismatch(monkeypatch):
    from weightpull import digests

    monkeypatch.setattr(deltas, "GROUP", 1)
    monkeypatch.setattr(digests, "_THREADED", 0)
    words = 3 * deltas.CHUNK + 500  # the fourth chunk holds 500 words
    old, new = pair(2 * words, 2, 0.01, 3)
    into = bytearray(2 * words)
    size, _ = deltas.encode(memoryview(old), memoryview(new), 2, memoryview(into))
    past = bytearray(into[:size])
    counts = [int.from_bytes(past[4 * c : 4 * c + 4], "little") for c in range(4)]
    first_of_last = 16 + 2 * sum(counts[:3])  # the last chunk's first offset
    past[first_of_last : first_of_last + 2] = (600).to_bytes(2, "little")
    with pytest.raises(DigestMismatchError, match=f"names word {3 * deltas.CHUNK + 600}"):
        deltas.patch(memoryview(bytearray(old)), memoryview(bytes(past)), 2, threads=4)


def test_encode_and_patch_refuse_bad_threads_and_a_base_of_another_size():
    old, new = pair(1000, 2, 0.05, 2)
    into = bytearray(1000)
    size, _ = deltas.encode(memoryview(old), memoryview(new), 2, memoryview(into))
    for bad in (0, -1, 2.5, True):
        with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
            deltas.patch(memoryview(bytearray(old)), memoryview(into)[:size], 2, threads=bad)
        with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
            deltas.encode(memoryview(old), memoryview(new), 2, memoryview(into), threads=bad)
    with pytest.raises(InvalidArgumentError, match="a base of 998 bytes for a target of 1000"):
        deltas.patch(memoryview(bytearray(old)), memoryview(into)[:size], 2, base=memoryview(old[:998]))


def test_the_record_refuses_what_it_cannot_be():
    with pytest.raises(InvalidArgumentError, match="unknown delta encoding 'rle'"):
        Delta(1, 10, 100, 2, (), encoding="rle")
    with pytest.raises(InvalidArgumentError, match="1, 2, 4 or 8 bytes, got 3"):
        Delta(1, 10, 100, 2, (), word=3)
    with pytest.raises(InvalidArgumentError, match="does not fit its room"):
        Delta(1, 200, 100, 2, ())
    layout = plan_layout([TensorSpec("w", "bfloat16", (N,))], bucket_bytes=4096)
    digests = ("00" * 16,) * len(layout.buckets)
    with pytest.raises(InvalidArgumentError, match="needs the version's digests"):
        Manifest(3, layout, "fake", b"s", 0, "p", delta=Delta(2, 10, 100, 1, ("00",)))
    with pytest.raises(InvalidArgumentError, match="not an earlier version"):
        Manifest(3, layout, "fake", b"s", 0, "p", digests, delta=Delta(3, 10, 100, 1, ("00",)))
    with pytest.raises(InvalidArgumentError, match="2 digests for 1 pieces"):
        Manifest(3, layout, "fake", b"s", 0, "p", digests, delta=Delta(2, 10, 100, 1, ("00", "00")))
    ok = Manifest(3, layout, "fake", b"s", 0, "p", digests, delta=Delta(2, 5000, 6000, 1, ("00", "00")))
    assert ok.delta_pieces() == [(layout.total_bytes, 4096), (layout.total_bytes + 4096, 904)]
    assert Manifest.from_dict(ok.to_dict()) == ok  # through the strict schema, as the wire carries it
    assert "delta" not in Manifest(3, layout, "fake", b"s", 0, "p", digests).to_dict()  # an older peer's form
    with pytest.raises(InvalidArgumentError, match="Manifest.delta.word must be an int"):
        Manifest.from_dict({**ok.to_dict(), "delta": {**ok.to_dict()["delta"], "word": "2"}})


# -- publishing ----------------------------------------------------------------------------------


def test_deltas_need_digests_an_encoder_on_a_device_and_whole_publishes(world):
    with pytest.raises(InvalidArgumentError, match="3 problems") as caught:
        world.publisher(deltas=True, stream=True, delta_room=0.0)
    for why in ("delta_room must be a share", "checked by the version's digests", "stream=False"):
        assert why in str(caught.value)
    with pytest.raises(
        InvalidArgumentError, match="on 'cuda:0' is encoded where they lie: give encoder=weightpull.inte"
    ):
        world.publisher(deltas=True, digests="wsum64", device="cuda:0", digester=lambda region, spans: [])
    with pytest.raises(InvalidArgumentError, match="encoder must be a callable"):
        world.publisher(deltas=True, digests="wsum64", device="cuda:0", digester=lambda region, spans: [], encoder=3)


async def test_a_base_needs_deltas(world):
    with pytest.raises(InvalidArgumentError, match="deltas=True"):
        await world.publisher(digests=True).publish(2, model(2), base=1)


async def test_each_version_records_its_changes_from_the_last(world):
    publisher = world.publisher(deltas=True, digests="wsum64", bucket_bytes=4096)
    first = await publisher.publish(1, model(1))
    assert first.manifest.delta is None  # nothing before it
    second = await publisher.publish(2, model(2))
    delta = second.manifest.delta
    assert (delta.base, delta.changed, delta.word) == (1, 40, 2)
    assert delta.nbytes == 4 + 2 * 40 + 8 * 0 + 80 + (-(4 + 80) % 8)  # counts, offsets, padding, values
    assert delta.room == deltas.room_for(second.manifest.layout.total_bytes, 0.25, 256)
    assert publisher.metrics()["publish/delta_bytes"] == delta.nbytes
    grown = await publisher.publish(3, {**model(3), "extra": HostTensor("bfloat16", (8,), bytes(16))})
    assert grown.manifest.delta is None  # another layout: no base for it
    # the status says which versions have a delta, of what and how large: the CLI's table too
    from weightpull.integrations.cli import _status_sections

    status = await world.registry.status()
    assert {v.version: v.delta for v in status.versions} == {2: (1, delta.nbytes), 3: None}  # v1 retired
    sizes = [row[5] for title, _, rows in _status_sections(status) if title == "versions" for row in rows]
    assert sizes == [f"12.0 KiB (delta of v1: {delta.nbytes} B)", "12.2 KiB"]  # a version's slot bytes


async def test_a_delta_over_its_room_is_left_out(world):
    publisher = world.publisher(deltas=True, digests=True, delta_room=0.01)
    await publisher.publish(1, model(1))
    assert (await publisher.publish(2, model(2, changed=200))).manifest.delta is None  # 200 x 4 bytes > 1%
    assert (await publisher.publish(3, model(3, changed=200), base=2)).manifest.delta is None


async def test_a_named_base_keeps_its_slot_while_another_is_free(world):
    publisher = world.publisher(deltas=True, digests=True, num_slots=3)
    for v in (1, 2):
        await publisher.publish(v, model(v))
    third = await publisher.publish(3, model(3), base=1)
    assert third.manifest.delta.base == 1 and third.slot == 2
    fourth = await publisher.publish(4, model(4), base=1)  # v1 kept, v3 the newest: v2's slot is written
    assert fourth.manifest.delta.base == 1 and fourth.slot == 1
    two = world.publisher(deltas=True, digests=True, num_slots=2, name="two")
    for v in (11, 12):
        await two.publish(v, model(v))
    kept_none = await two.publish(13, model(13), base=11)  # keeping v11 would leave no slot: it goes
    assert not kept_none.skipped and kept_none.slot == 0 and kept_none.manifest.delta is None


# -- pulling -------------------------------------------------------------------------------------


async def test_a_reader_holding_the_base_reads_the_delta_alone(world):
    publisher = world.publisher(deltas=True, digests="wsum64", bucket_bytes=4096)
    transport = Counting(clock=world.clock, fabric=world.fabric)
    reader = world.puller(transport)
    await publisher.publish(1, model(1))
    first = await reader.pull()
    assert exact(first, 1) and first.base is None
    assert transport.read_bytes == sum(b.nbytes for b in first.layout.buckets)
    for v in (2, 3):
        result = await publisher.publish(v, model(v))
        before = transport.read_bytes
        pulled = await reader.pull()
        assert exact(pulled, v) and pulled.base == v - 1
        assert transport.read_bytes - before == result.manifest.delta.nbytes  # the section, nothing else
    assert reader.metrics()["pull/patched"] == 2
    fresh = world.puller()
    late = await fresh.pull()
    assert exact(late, 3) and late.base is None  # no base here: the whole version


async def test_a_reader_behind_by_two_or_refusing_deltas_reads_whole(world):
    publisher = world.publisher(deltas=True, digests=True)
    behind, refusing = world.puller(), world.puller(deltas=False)
    await publisher.publish(1, model(1))
    await behind.pull()
    await refusing.pull()
    await publisher.publish(2, model(2))
    assert (await refusing.pull()).base is None
    await publisher.publish(3, model(3))
    pulled = await behind.pull()  # it holds v1, v3's delta is against v2
    assert exact(pulled, 3) and pulled.base is None


async def test_a_patch_that_does_not_match_is_read_whole_under_the_same_lease(world, caplog):
    publisher = world.publisher(deltas=True, digests=True)
    reader = world.puller()
    await publisher.publish(1, model(1))
    await reader.pull()
    reader.mirror.host_view()[7] ^= 0xFF  # the base's copy went bad here, after its check
    await publisher.publish(2, model(2))
    pulled = await reader.pull()
    assert exact(pulled, 2) and pulled.base is None
    assert "does not match its digest; reading it whole" in caplog.text
    assert reader.metrics()["pull/unpatched"] == 1 and reader.metrics()["pull/pulls"] == 2


@pytest.mark.parametrize("kind", ["wsum64", True])
async def test_a_patched_copy_is_checked_on_threads_and_a_bad_one_still_read_whole(world, monkeypatch, kind):
    """The whole version's check after a patch sums on the checker's threads, a bucket in
    pieces (here of 64 bytes, threaded at any size): a patched copy that matches is kept, a
    base gone bad is caught by it as by the check in turn."""
    from weightpull import digests

    monkeypatch.setattr(digests, "PIECE", 64)
    monkeypatch.setattr(digests, "_THREADED", 0)
    publisher = world.publisher(deltas=True, digests=kind, bucket_bytes=4096)
    reader = world.puller()
    reader.checker.threads = 3
    await publisher.publish(1, model(1))
    await reader.pull()
    await publisher.publish(2, model(2))
    pulled = await reader.pull()
    assert exact(pulled, 2) and pulled.base == 1
    reader.mirror.host_view()[4096 + 77] ^= 0x01  # v2's copy, its second bucket, goes bad after its check
    await publisher.publish(3, model(3))
    pulled = await reader.pull()
    assert exact(pulled, 3) and pulled.base is None
    assert reader.metrics()["pull/patched"] == 1 and reader.metrics()["pull/unpatched"] == 1


def test_a_checker_refuses_bad_thread_counts():
    from weightpull.checking import DigestChecker

    assert DigestChecker("cpu", None).threads is None  # one per core
    for bad in (0, -2, 1.5, True):
        with pytest.raises(InvalidArgumentError, match="threads must be a positive int"):
            DigestChecker("cpu", None, threads=bad)


async def test_a_delta_torn_mid_read_is_rejected_never_patched(world):
    publisher = world.publisher(deltas=True, digests=True)
    transport = world.transport()
    reader = world.puller(transport, ttl=3.0)
    await publisher.publish(1, model(1))
    await reader.pull()
    await publisher.publish(2, model(2))
    transport.faults.tear_reads, transport.faults.freeze = 1, 10.0  # frozen past the TTL mid-read
    async with autojump(world.clock):
        with pytest.raises(TornReadError):
            await reader.pull()
    assert reader.mirror_version == 1  # the torn read touched the section alone: the base is whole
    assert reader.metrics()["pull/patched"] == 0
    pulled = await reader.pull()
    assert exact(pulled, 2) and pulled.base == 1


async def test_relays_serve_deltas_of_what_they_hold(world, caplog):
    publisher = world.publisher(deltas=True, digests=True, bucket_bytes=4096)
    relay = world.puller(host="h1", holder="relay")
    reader = world.puller(host="h1", holder="reader")
    await publisher.publish(1, model(1))
    await relay.pull()
    await relay.offer()
    assert (await reader.pull()).base is None  # from the relay, whole
    await publisher.publish(2, model(2))
    assert (await relay.pull()).base == 1  # from the slot, patched
    await relay.offer()
    lease_source = []
    real_acquire = world.registry.acquire

    async def acquire(*args, **kw):
        lease = await real_acquire(*args, **kw)
        lease_source.append(lease.source)
        return lease

    world.registry.acquire = acquire
    pulled = await reader.pull()
    assert exact(pulled, 2) and pulled.base == 1 and lease_source == ["relay"]  # the relay's delta
    # A relay whose section differs from the publisher's (a bug, a hostile one, another base):
    await publisher.publish(3, model(3))
    await relay.pull()
    await relay.offer()
    total = relay.mirror.nbytes - (await publisher.registry.get(3)).delta.room
    relay.mirror.host_view()[total + 1] ^= 0xFF  # its first chunk count
    pulled = await reader.pull()
    assert exact(pulled, 3) and pulled.base == 2 and lease_source[-2:] == ["relay", ""]
    assert "piece 0 of its delta read from 'relay' does not match" in caplog.text


async def test_a_relay_that_read_a_version_whole_serves_its_delta_too(world):
    publisher = world.publisher(deltas=True, digests=True)
    reader = world.puller(host="h1", holder="reader")
    await publisher.publish(1, model(1))
    await reader.pull()
    await publisher.publish(2, model(2))
    relay = world.puller(host="h1", holder="relay")
    assert (await relay.pull()).base is None  # it never held v1
    await relay.offer()
    await publisher.transport.aclose()  # the trainer's slot is gone: only the relay serves v2
    pulled = await reader.pull()
    assert exact(pulled, 2) and pulled.base == 1


async def test_a_spare_mirror_patches_a_copy_of_the_offered_base(world):
    publisher = world.publisher(deltas=True, digests=True)
    relay = world.puller(host="h1", holder="relay", spare_mirror=True)
    await publisher.publish(1, model(1))
    await relay.pull()
    await relay.offer()
    offered = relay.mirror
    await publisher.publish(2, model(2))
    pulled = await relay.pull()  # into the spare; v1 stays in the offered mirror, untouched
    assert pulled.region is not offered and exact(pulled, 2) and pulled.base == 1
    held = offered.host_view()
    assert all(bytes(held[p.offset : p.end]) == bytes(model(1)[p.spec.name].data) for p in pulled.layout.placements)


async def test_a_replicas_two_mirrors_patch_each_version_from_the_one_the_other_serves(world):
    from weightpull.integrations.vllm.mirrors import MirrorPair

    publisher = world.publisher(deltas=True, digests=True)
    transport = Counting(clock=world.clock, fabric=world.fabric)
    pair = MirrorPair(world.registry, transport, holder="r0", clock=world.clock)
    assert [p.siblings for p in pair.pullers] == [pair.pullers] * 2
    for v in (1, 2, 3, 4):
        result = await publisher.publish(v, model(v))
        before, serving = transport.read_bytes, pair.current
        pulled = await pair.pull(v)  # into the spare, which holds v-2 (or nothing): the base is the other's
        assert exact(pulled, v) and pulled.base == (None if v == 1 else v - 1)
        if v > 1:
            assert transport.read_bytes - before == result.manifest.delta.nbytes  # the section alone
            assert pulled.region is not serving.region and exact(serving, v - 1)  # copied from, never written
        pair.promote(pulled)
    assert sum(p.metrics()["pull/patched"] for p in pair.pullers) == 3


async def test_a_siblings_base_that_changed_under_it_is_read_whole_and_left_as_it_was(world):
    publisher = world.publisher(deltas=True, digests=True)
    a, b = world.puller(), world.puller()
    a.siblings = [b]
    await publisher.publish(1, model(1))
    await b.pull()
    b.mirror.host_view()[9] ^= 0xFF  # b's copy changed after its check (a pull of its own begun, say)
    before = bytes(b.mirror.host_view())
    await publisher.publish(2, model(2))
    pulled = await a.pull()
    assert exact(pulled, 2) and pulled.base is None and a.metrics()["pull/unpatched"] == 1
    assert bytes(b.mirror.host_view()) == before  # copied from, never written


async def test_a_sibling_holding_another_publishers_version_is_no_base(world):
    ours, theirs = world.publisher(deltas=True, digests=True), world.publisher(deltas=True, digests=True, name="b")
    a, b = world.puller(publisher=ours.name), world.puller(publisher=theirs.name)
    a.siblings = b.siblings = [a, b]
    await theirs.publish(1, model(1, seed=5))
    await b.pull()
    await ours.publish(1, model(1))
    await ours.publish(2, model(2))  # a delta of our v1, which only b's mirror holds a v1 of: not ours
    pulled = await a.pull()
    assert exact(pulled, 2) and pulled.base is None
    assert a.metrics()["pull/unpatched"] == 0  # not even tried


async def test_a_delta_crosses_a_served_registry(tmp_path):
    pytest.importorskip("zmq")
    from tests.served import ServedRegistry, make_keys
    from weightpull import Publisher, Puller
    from weightpull.registry import connect_registry

    keys = make_keys(tmp_path / "keys", ("publisher", "trainer"), ("reader", "reader"))
    served = ServedRegistry(tmp_path, keys=keys)
    served.start()
    try:
        trainer = connect_registry(served.address, **served.key("trainer"))
        reader_registry = connect_registry(served.address, **served.key("reader"))
        async with trainer, reader_registry:
            publisher = Publisher(trainer, FakeTransport(), deltas=True, digests="wsum64", bucket_bytes=4096)
            reader = Puller(reader_registry, FakeTransport())
            await publisher.publish(1, model(1))
            await reader.pull()
            second = await publisher.publish(2, model(2))
            assert (await reader_registry.get(2)).delta == second.manifest.delta  # through the wire's schema
            pulled = await reader.pull()
            assert exact(pulled, 2) and pulled.base == 1
    finally:
        served.stop()


async def test_a_sliced_pull_reads_its_slice_of_a_delta_version_whole(world):
    from weightpull.slice_puller import SlicePuller

    from .test_slice_puller import SPECS, _check, _full, _slice

    publisher = world.publisher(deltas=True, digests=True)
    pullers = [
        SlicePuller(world.registry, world.transport(), _slice(SPECS, r, 2, 2), clock=world.clock) for r in (0, 1)
    ]
    full = _full(1)
    for version in (1, 2):
        if version == 2:
            full = {n: a.copy() for n, a in full.items()}
            full["norm"].reshape(-1)[0] += 1  # one element changed: v2 goes out with a delta
        tensors = {n: HostTensor("int32", a.shape, a.tobytes()) for n, a in full.items()}
        result = await publisher.publish(version, tensors)
        assert (result.manifest.delta is not None) == (version == 2)
        for rank, puller in enumerate(pullers):
            _check(await puller.pull(), full, rank, 2)
