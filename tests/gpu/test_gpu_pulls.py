"""The cuda_ipc driver and GPU mirrors, on a GPU: pulls between processes into GPU and
host mirrors, handles opened once per process, a crashed or deregistering owner, memory
CUDA IPC cannot export, GPU mirrors of a host-landing driver, and peer-to-peer reads."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import pytest
import torch

from weightpull import InProcessRegistry, InvalidArgumentError, Publisher, Puller, create_transport
from weightpull.drivers.cuda_ipc import cuda, mappings
from weightpull.drivers.testing.conformance import ProcessPeer
from weightpull.errors import PeerGoneError, RegionNotRegisteredError
from weightpull.integrations.bench.gpu import PublisherProcess, checksums, make_tensors, mirror_checksums
from weightpull.integrations.torch_staging import HostStaged
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.records import Reservation

pytestmark = pytest.mark.anyio
SHAPES = [("embed", (1000, 512)), *[(f"layer{i}.w", (512, 384 + i)) for i in range(12)], ("norm", (512,))]


async def _registry_with(manifest):
    registry = InProcessRegistry()
    await registry.begin(manifest.version, publisher=manifest.publisher, slot=manifest.slot)
    await registry.commit(manifest)
    return registry


async def test_a_publisher_process_gpu_slot_pulled_into_gpu_and_host_mirrors_opened_once():
    proc = PublisherProcess([1 << 20], shapes=SHAPES)
    try:
        (manifest,), want = await anyio.to_thread.run_sync(proc.ready)
        assert want == checksums(make_tensors(SHAPES, "cuda:0"))  # the same seed here
        a, b = create_transport("cuda_ipc"), create_transport("cuda_ipc")
        gpu = Puller(await _registry_with(manifest), a, device="cuda:0")
        host = Puller(await _registry_with(manifest), b, device="cpu")
        assert gpu.transport is a  # cuda_ipc lands on the GPU itself: no staging
        for _ in range(2):
            pulled = await gpu.pull()
            assert pulled.region.device == "cuda:0" and mirror_checksums(pulled.layout, pulled.region) == want
            pulled = await host.pull()
            assert pulled.region.device == "cpu" and mirror_checksums(pulled.layout, pulled.region) == want
        assert len(manifest.layout.buckets) > 3
        handle = __import__("json").loads(manifest.source)["handle"]
        assert [key for key in mappings.mapped if key[0] == handle] == [(handle, 0)]  # one for both
        for puller, transport in ((gpu, a), (host, b)):
            await puller.aclose()
            await transport.aclose()
        assert not mappings.mapped
    finally:
        await anyio.to_thread.run_sync(proc.stop)


async def test_a_publisher_process_host_slot_pulled_by_dma_into_gpu_and_host_mirrors_mapped_once():
    proc = PublisherProcess([1 << 20], shapes=SHAPES, slot_device="cpu")
    try:
        (manifest,), want = await anyio.to_thread.run_sync(proc.ready)
        source = __import__("json").loads(manifest.source)
        assert source["memory"] == "host" and os.path.getsize(source["file"]) == source["offset"] + manifest.nbytes
        a, b = create_transport("cuda_ipc"), create_transport("cuda_ipc")
        gpu = Puller(await _registry_with(manifest), a, device="cuda:0")
        host = Puller(await _registry_with(manifest), b, device="cpu")
        assert gpu.transport is a  # the GPU's own DMA reads the shared slot: no staging
        for _ in range(2):
            pulled = await gpu.pull()
            assert pulled.region.device == "cuda:0" and mirror_checksums(pulled.layout, pulled.region) == want
            pulled = await host.pull()
            assert pulled.region.device == "cpu" and mirror_checksums(pulled.layout, pulled.region) == want
        (entry,) = [v for k, v in mappings.mapped.items() if k == (source["file"], -1)]
        pointer, users, pinned_on = entry
        assert users == 2 and pinned_on == 0 and cuda().host_pinned(pointer)  # one read-only map, page-locked
        for puller, transport in ((gpu, a), (host, b)):
            await puller.aclose()
            await transport.aclose()
        assert not [key for key in mappings.mapped if key[0] == source["file"]]
    finally:
        await anyio.to_thread.run_sync(proc.stop)
    assert not os.path.exists(source["file"])  # the owner's close removed its shared memory


async def test_a_host_slot_with_digests_pulls_into_a_gpu_mirror_without_checking_them():
    registry, transport = InProcessRegistry(), create_transport("cuda_ipc")
    tensors = make_tensors(SHAPES, "cuda:0")
    publisher = Publisher(registry, transport, rollout_dtype=None, bucket_bytes=1 << 20, device="cpu", digests=True)
    result = await publisher.publish(1, tensors)
    assert result.manifest.digests
    gpu, host = Puller(registry, transport, device="cuda:0"), Puller(registry, transport, device="cpu")
    assert not gpu.verify_digests and host.verify_digests
    for puller in (gpu, host):
        pulled = await puller.pull()
        assert mirror_checksums(pulled.layout, pulled.region) == checksums(tensors)
        await puller.aclose()
    await publisher.aclose()
    await transport.aclose()


async def test_a_crashed_owner_is_gone():
    peer = ProcessPeer("cuda_ipc", device="cuda")
    reader = create_transport("cuda_ipc")
    try:
        remote = reader.connect(await peer.alloc(1 << 20, seed=3))
        local = reader.allocate(1 << 20, "cuda:0")
        await reader.read(remote, 0, local, 0, 1 << 20)
        os.kill(peer.process.pid, signal.SIGKILL)
        await anyio.to_thread.run_sync(peer.process.join)
        with pytest.raises(PeerGoneError, match="exited"):
            await reader.read(remote, 0, local, 0, 1 << 20)
    finally:
        peer.close()
        await reader.aclose()


async def test_a_region_its_owner_deregistered_is_refused():
    owner, reader = create_transport("cuda_ipc"), create_transport("cuda_ipc")
    slot = owner.allocate(4096, "cuda:0")
    slot.memory.fill_(7)
    remote = reader.connect(owner.export(slot))
    assert owner.export(slot) == remote.descriptor  # exported once
    local = reader.allocate(4096, "cuda:0")
    await reader.read(remote, 0, local, 0, 4096)  # this process's own export: its own pointer
    assert bool((local.memory == 7).all())
    owner.deregister(slot)
    with pytest.raises(RegionNotRegisteredError, match="deregistered"):
        await reader.read(remote, 0, local, 0, 4096)
    with pytest.raises(RegionNotRegisteredError, match="no longer exported"):
        reader.connect(remote.descriptor)
    await reader.aclose()
    await owner.aclose()


def test_expandable_segments_cannot_be_exported():
    script = (
        "import torch, weightpull as w\n"
        "t = w.create_transport('cuda_ipc')\n"
        "r = t.register(torch.empty(1 << 22, dtype=torch.uint8, device='cuda'), 'cuda')\n"
        "try:\n    t.export(r)\nexcept w.InvalidArgumentError as e:\n    print('refused:', e)\n"
        "t.allocate(1 << 22, 'cuda:0').memory.fill_(1); print('own allocation ok')\n"
    )
    env = {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert "refused:" in out.stdout and "expandable segments" in out.stdout, out.stdout + out.stderr
    assert "own allocation ok" in out.stdout


async def test_a_gpu_mirror_of_a_host_landing_driver_is_fed_through_pinned_memory():
    registry = InProcessRegistry()
    publisher = Publisher(registry, create_transport("fake"), rollout_dtype=None, bucket_bytes=1 << 20)
    tensors = make_tensors(SHAPES, "cuda:0", seed=5)
    await publisher.publish(1, tensors)
    puller = Puller(registry, create_transport("fake"), device="cuda:0")
    assert isinstance(puller.transport, HostStaged)
    pulled = await puller.pull()
    assert pulled.region.device == "cuda:0"
    assert mirror_checksums(pulled.layout, pulled.region) == checksums(tensors)
    await puller.aclose()
    await publisher.aclose()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs of one host")
async def test_a_reader_on_another_gpu_reads_peer_to_peer():
    proc = PublisherProcess([1 << 20], device="cuda:0", shapes=SHAPES)
    try:
        (manifest,), want = await anyio.to_thread.run_sync(proc.ready)
        transport = create_transport("cuda_ipc", device="cuda:1")
        puller = Puller(await _registry_with(manifest), transport, device="cuda:1")
        pulled = await puller.pull()
        assert pulled.region.device == "cuda:1" and mirror_checksums(pulled.layout, pulled.region) == want
        assert any(key[1] == 1 for key in mappings.mapped)  # mapped into cuda:1, peer access on
        await puller.aclose()
        await transport.aclose()
    finally:
        await anyio.to_thread.run_sync(proc.stop)


@pytest.mark.parametrize("slot_device", ["cuda:0", "cpu"])
async def test_prepare_maps_a_publisher_process_slot_before_the_first_pull(slot_device):
    proc = PublisherProcess([1 << 20], shapes=SHAPES, slot_device=slot_device)
    try:
        (manifest,), want = await anyio.to_thread.run_sync(proc.ready)
        registry = await _registry_with(manifest)
        await registry.reserve(Reservation(manifest.publisher, "cuda_ipc", (manifest.source,), manifest.nbytes))
        transport = create_transport("cuda_ipc")
        puller = Puller(registry, transport, device="cuda:0")
        assert await puller.prepare() == 1
        source = __import__("json").loads(manifest.source)
        key = (source["file"], -1) if slot_device == "cpu" else (source["handle"], 0)
        assert key in mappings.mapped  # mapped (a host slot: page-locked) before any read
        if slot_device == "cpu":
            assert cuda().host_pinned(mappings.mapped[key][0])
        mirror = puller.mirror
        assert mirror is not None and mirror.device == "cuda:0" and mirror.nbytes == manifest.nbytes
        pulled = await puller.pull()
        assert puller.mirror is mirror and mirror_checksums(pulled.layout, pulled.region) == want
        await puller.aclose()
        await transport.aclose()
        assert key not in mappings.mapped
    finally:
        await anyio.to_thread.run_sync(proc.stop)


@pytest.mark.parametrize("slot_device", ["cuda:0", "cpu"])
async def test_a_publisher_process_slot_is_borrowed_in_place_and_applied_straight_from_it(slot_device):
    """A GPU slot is lent to this process's GPU, a host slot to its host: the same mapping
    each time (no mirror, no copy), and an apply copies straight from it."""
    proc = PublisherProcess([1 << 20], shapes=SHAPES, slot_device=slot_device)
    try:
        (manifest,), want = await anyio.to_thread.run_sync(proc.ready)
        transport = create_transport("cuda_ipc")
        registry = await _registry_with(manifest)
        puller = Puller(registry, transport, device=slot_device)
        regions = []
        for _ in range(2):
            async with puller.borrow() as lent:
                assert lent.version == manifest.version and lent.region.device == slot_device
                assert mirror_checksums(lent.layout, lent.region) == want
                weights = {
                    n: torch.zeros_like(t, device="cuda:0") for n, t in as_tensors(lent.layout, lent.region).items()
                }
                for name, w in weights.items():  # an apply: one copy per tensor, from the slot
                    w.copy_(as_tensors(lent.layout, lent.region)[name])
                assert checksums(weights) == want
                assert len((await registry.status()).leases) == 1
                regions.append(lent.region)
        assert regions[0] is regions[1] and puller.mirror is None and puller.metrics()["pull/borrows"] == 2
        assert (await registry.status()).leases == ()
        other = "cpu" if slot_device != "cpu" else "cuda:0"  # across PCIe: a pull's job
        with pytest.raises(InvalidArgumentError, match="cannot lend v.* in place"):
            async with Puller(registry, transport, device=other).borrow():
                pass
        await puller.aclose()
        await transport.aclose()
    finally:
        await anyio.to_thread.run_sync(proc.stop)
