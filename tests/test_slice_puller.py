"""The slice puller: each rank of a replica leases a sharded version, reads only its slice
from the trainer's shards, and keeps it only if the lease held throughout."""

from __future__ import annotations

import numpy as np
import pytest

from weightpull import HostTensor, InvalidArgumentError, Sharding, TornReadError, TransportError
from weightpull.drivers.faulty import Faults, FaultyTransport
from weightpull.sharding import chunk_rows
from weightpull.slice_puller import SlicePuller
from weightpull.transport import WrappedTransport

from .test_slices import _model, _slice, _want

pytestmark = pytest.mark.anyio

SPECS = _model(vocab_size=22, hidden=8, heads=4, kv=2, inter=12, experts=2)
REPLICATED = ("norm", "o_bias")


def _full(version: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(version)
    return {s.name: rng.integers(-(2**31), 2**31 - 1, size=s.shape, dtype=np.int32) for s in SPECS}


async def _publish(world, pubs, version: int) -> dict[str, np.ndarray]:
    """`version` published by len(pubs) FSDP-style shards (dim-0 chunks)."""
    full = _full(version)
    count = len(pubs)
    for i, pub in enumerate(pubs):
        tensors, starts = {}, {}
        for s in SPECS:
            a, b = chunk_rows(s.shape[0], i, count)
            tensors[s.name] = HostTensor("int32", (b - a, *s.shape[1:]), full[s.name][a:b].tobytes())
            starts[s.name] = a
        await pub.publish(version, tensors, shard=Sharding(i, count, {s.name: s.shape for s in SPECS}, starts))
    return full


def _check(pulled, full, rank: int, ranks: int) -> None:
    for name, want in _want(full, rank, ranks, experts=2).items():
        got = np.frombuffer(bytes(pulled.view(name)), dtype=np.int32).reshape(want.shape)
        np.testing.assert_array_equal(got, want, err_msg=f"rank {rank}: {name}")


@pytest.mark.parametrize(("shards", "ranks"), [(3, 2), (2, 4), (1, 2)])
async def test_each_rank_pulls_exactly_its_slice_and_only_its_bytes(world, shards, ranks):
    pubs = [world.publisher(name=f"trainer{i}") for i in range(shards)]
    pullers = [
        SlicePuller(world.registry, world.transport(), _slice(SPECS, r, ranks, 2), ttl=5.0, clock=world.clock)
        for r in range(ranks)
    ]
    for version in (1, 2):  # the second pull reuses each rank's plan and mirror
        full = await _publish(world, pubs, version)
        got = [await p.pull() for p in pullers]
        for rank, pulled in enumerate(got):
            assert pulled.version == version and pullers[rank].mirror_version == version
            _check(pulled, full, rank, ranks)
        whole = sum(a.nbytes for a in full.values())
        replicated = sum(full[n].nbytes for n in REPLICATED)
        assert sum(p.nbytes for p in got) == whole + (ranks - 1) * replicated
    status = await world.registry.status()
    assert not any(v.live_leases for v in status.versions)  # every lease released


async def test_two_d_reads_fall_back_to_one_read_per_row_with_the_same_bytes(world):
    pubs = [world.publisher(name=f"trainer{i}") for i in range(2)]
    full = await _publish(world, pubs, 1)

    class PerRow(WrappedTransport):  # no 2-D reads of its own: the Transport default
        pass

    transport = PerRow(world.transport())
    assert not transport.native_2d
    async with SlicePuller(world.registry, transport, _slice(SPECS, 1, 2, 2), clock=world.clock) as puller:
        pulled = await puller.pull()
        assert any(r.height > 1 for r in pulled.plan.reads)  # row-parallel shares: 2-D reads
        _check(pulled, full, 1, 2)
    assert puller.mirror is None


async def test_a_torn_slice_is_rejected_and_a_failed_read_names_itself(world):
    pubs = [world.publisher(name=f"trainer{i}") for i in range(2)]
    await _publish(world, pubs, 1)
    faults = Faults(tear_reads=1, freeze=60.0)  # frozen past the lease mid-read
    transport = FaultyTransport(world.transport(), faults, clock=world.clock)
    puller = SlicePuller(world.registry, transport, _slice(SPECS, 0, 2, 2), ttl=5.0, clock=world.clock)
    with pytest.raises(TornReadError, match="lapsed during the read"):
        await puller.pull()
    assert puller.mirror_version is None
    faults.fail_reads = 1
    with pytest.raises(TransportError, match="injected failure"):
        await puller.pull()
    full = _full(1)
    _check(await puller.pull(), full, 0, 2)  # and then it reads whole again
    assert not any(v.live_leases for v in (await world.registry.status()).versions)


async def test_a_slice_naming_a_tensor_the_version_lacks_is_refused(world):
    pubs = [world.publisher(name="trainer0")]
    await _publish(world, pubs, 1)
    other = _model(vocab_size=22, hidden=8, heads=4, kv=2, inter=12, experts=3)  # one expert more
    puller = SlicePuller(world.registry, world.transport(), _slice(other, 0, 2, 3), clock=world.clock)
    with pytest.raises(InvalidArgumentError, match="has no tensor 'e2.gate'"):
        await puller.pull()
    with pytest.raises(InvalidArgumentError, match="ttl must be positive"):
        SlicePuller(world.registry, world.transport(), _slice(SPECS, 0, 2, 2), ttl=0)


async def test_a_rank_reads_a_few_batches_at_a_time_so_that_each_lands_before_the_last(world, monkeypatch):
    """Reads asked together share the link and land together: asked all at once, no batch
    landed before the last did, and a slow shared link looked stalled. At most
    `_BATCHES_IN_FLIGHT` batches are asked at once, and the slice is still exact."""
    import anyio

    from weightpull import slice_puller

    monkeypatch.setattr(slice_puller, "_BATCH_BYTES", 256)  # many batches of this small model
    pubs = [world.publisher(name=f"trainer{i}") for i in range(2)]
    full = await _publish(world, pubs, 1)

    class Counting(WrappedTransport):
        def __init__(self, inner) -> None:
            super().__init__(inner)
            self.now = self.most = self.calls = 0

        async def _counted(self, read) -> None:
            self.now += 1
            self.calls += 1
            self.most = max(self.most, self.now)
            try:
                await anyio.sleep(0.001)  # the others may start meanwhile
                await read
            finally:
                self.now -= 1

        async def read_many(self, reads) -> None:
            await self._counted(self.inner.read_many(reads))

        async def read_2d_many(self, reads) -> None:
            await self._counted(self.inner.read_2d_many(reads))

    transport = Counting(world.transport())
    async with SlicePuller(world.registry, transport, _slice(SPECS, 0, 2, 2), clock=world.clock) as puller:
        pulled = await puller.pull()
    _check(pulled, full, 0, 2)
    assert slice_puller._BATCHES_IN_FLIGHT == 2
    assert transport.calls > 8  # many batches...
    assert 1 <= transport.most <= 2  # ...two at a time
