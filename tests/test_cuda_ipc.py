"""The cuda_ipc driver where there is no GPU: it says why it cannot run, and the parts that
need no GPU work for real: descriptors, and the owner's liveness file that tells a reader
its owner deregistered a region, closed, or died (CUDA keeps a mapping either way).
tests/gpu/ and the conformance suite (WEIGHTPULL_DRIVERS=cuda_ipc) run it on a GPU."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from types import SimpleNamespace

import anyio
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from weightpull import InvalidArgumentError, create_transport, list_transports
from weightpull.drivers.cuda_ipc import (
    CudaIpcTransport,
    driver_api,
    lanes,
    mappings,
    owners,
    sweep_dead_owners,
    transport,
)
from weightpull.drivers.cuda_ipc.owners import boot_id
from weightpull.errors import DriverUnavailableError, PeerGoneError, RegionNotRegisteredError

OWNER = textwrap.dedent("""
    import sys
    from weightpull.drivers.cuda_ipc.owners import CLOSED, DEREGISTERED, OwnerFile
    files = [OwnerFile(4096), OwnerFile(8192), OwnerFile(16)]
    print(" ".join(f.path for f in files), flush=True)
    for line in sys.stdin:
        index, state = line.split()
        files[int(index)].release({"D": DEREGISTERED, "C": CLOSED}[state])
        print("done", flush=True)
""")


def test_without_a_gpu_it_says_why():
    (info,) = [i for i in list_transports() if i.name == "cuda_ipc"]
    assert info.extra == "torch"
    if torch.cuda.is_available():  # a GPU machine: tests/gpu covers it
        assert info.available and CudaIpcTransport.unavailable_reason() is None
        return
    assert not info.available and "no CUDA device here" in info.reason and torch.__version__ in info.reason
    with pytest.raises(DriverUnavailableError, match="cuda_ipc.*no CUDA device"):
        create_transport("cuda_ipc")


def _descriptor(path: str, nbytes: int = 4096, boot: str | None = None, **extra) -> bytes:
    d = {
        "cuda_ipc": 1,
        "memory": "device",
        "handle": "ab" * 64,
        "offset": 0,
        "nbytes": nbytes,
        "device": 0,
        "pid": 1,
        "boot": boot or boot_id(),
        "file": path,
        **extra,
    }
    return json.dumps(d).encode()


def test_the_owners_file_says_deregistered_closed_or_dead():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    t = CudaIpcTransport()  # connecting needs no GPU
    try:
        paths = owner.stdout.readline().split()
        remotes = [t.connect(_descriptor(p)) for p in paths]
        assert [r.handle.exported for r in remotes] == [4096, 8192, 16]  # the owner's record
        for r in remotes:
            r.handle.check_owner("reading")  # locked by a live owner: nothing to say

        def tell(index: int, state: str) -> None:
            owner.stdin.write(f"{index} {state}\n")
            owner.stdin.flush()
            assert owner.stdout.readline().strip() == "done"

        tell(0, "D")
        with pytest.raises(RegionNotRegisteredError, match="reading: its owner deregistered it"):
            remotes[0].handle.check_owner("reading")
        tell(1, "C")
        with pytest.raises(PeerGoneError, match="closed its transport or exited"):
            remotes[1].handle.check_owner("reading")
        remotes[2].handle.check_owner("reading")
        os.kill(owner.pid, signal.SIGKILL)  # no word from it: only its lock goes
        owner.wait(30)
        with pytest.raises(PeerGoneError):
            remotes[2].handle.check_owner("reading")
        with pytest.raises(RegionNotRegisteredError, match="no longer exported"):
            t.connect(_descriptor(paths[0]))  # released files are removed
        for r in remotes:
            t.disconnect(r)
    finally:
        owner.kill()
        for path in paths[2:]:  # the killed owner's, left behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


HOST_SLOTS = textwrap.dedent("""
    import random, sys
    from weightpull.drivers.cuda_ipc.owners import OwnerFile
    files = [OwnerFile(1 << 20, data=True), OwnerFile(4096)]
    files[0].data[:] = random.Random(5).randbytes(1 << 20)
    print(" ".join(f.path for f in files), flush=True)
    sys.stdin.readline()
""")


def test_a_host_slot_lives_in_its_owners_file_and_a_dead_owners_files_are_swept():
    """A host slot's bytes follow the liveness record in one shared-memory file, which a
    reader maps read-only; once the owner is SIGKILLed, the next transport removes its
    files (gigabytes of /dev/shm for a real slot), and a live owner's stay."""
    dead = subprocess.Popen(
        [sys.executable, "-c", HOST_SLOTS], text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    live = subprocess.Popen(
        [sys.executable, "-c", HOST_SLOTS], text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        dead_paths, live_paths = dead.stdout.readline().split(), live.stdout.readline().split()
        t = CudaIpcTransport()
        remote = t.connect(_descriptor(dead_paths[0], 1 << 20, memory="host", handle="", offset=owners.DATA_OFFSET))
        imp = remote.handle
        assert imp.host and imp.exported == 1 << 20 and os.path.getsize(dead_paths[0]) == owners.DATA_OFFSET + (1 << 20)
        address = driver_api.libc.map_read_only(imp.fd, imp.exported, imp.offset)
        try:
            assert ctypes.string_at(address, 1 << 20) == random.Random(5).randbytes(1 << 20)
        finally:
            driver_api.libc.munmap(address, 1 << 20)
        assert sweep_dead_owners() == []  # both owners alive
        os.kill(dead.pid, signal.SIGKILL)
        dead.wait(30)
        CudaIpcTransport()  # any new transport sweeps
        assert not any(os.path.exists(p) for p in dead_paths) and all(os.path.exists(p) for p in live_paths)
        with pytest.raises(PeerGoneError):
            imp.check_owner("reading")  # its open file still answers
        t.disconnect(remote)
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(30)
        sweep_dead_owners()
    assert not any(os.path.exists(p) for p in live_paths)


def test_bad_descriptors_are_refused(tmp_path):
    t = CudaIpcTransport()
    with pytest.raises(InvalidArgumentError, match="not a cuda_ipc descriptor"):
        t.connect(b"garbage")
    with pytest.raises(InvalidArgumentError, match="not a cuda_ipc descriptor"):
        t.connect(_descriptor("/etc/passwd"))  # not an owner's file
    for bad in ({"memory": "host"}, {"memory": "host", "handle": "", "offset": 100}, {"memory": "disk"}):
        with pytest.raises(InvalidArgumentError, match="not a cuda_ipc descriptor"):
            t.connect(_descriptor(str(tmp_path / "weightpull-cuda-ipc-x"), **bad))
    with pytest.raises(InvalidArgumentError, match="another host"):
        t.connect(_descriptor(str(tmp_path / "weightpull-cuda-ipc-x"), boot="another-boot"))


class _FakeCuda:
    """CUDA's stream semantics on a clock: copies land in order, each `nbytes` ns after the
    one before. Enough of the driver API for a `_Lane`."""

    def __init__(self):
        self._contexts = {0: ctypes.c_void_p(1)}
        self.events, self.landing, self.tail, self.copies = 0, {}, 0.0, []

    @contextlib.contextmanager
    def on(self, device):
        yield

    def check(self, result, what):
        assert result == 0, what

    def cuStreamCreate(self, stream, flags):
        return 0

    def cuCtxPushCurrent_v2(self, ctx):
        return 0

    def cuCtxPopCurrent_v2(self, ctx):
        return 0

    def cuEventCreate(self, event, flags):
        self.events += 1
        event._obj.value = self.events
        return 0

    def cuMemcpyAsync(self, dst, src, nbytes, stream):
        self.copies.append((dst, src, nbytes))
        self.tail = max(self.tail, time.monotonic()) + nbytes * 1e-9
        return 0

    def cuEventRecord(self, event, stream):
        self.landing[event.value] = self.tail
        return 0

    def cuEventQuery(self, event):
        return 0 if time.monotonic() >= self.landing[event.value] else 600


@pytest.mark.anyio
async def test_a_lane_wakes_every_fence_in_order_through_batches_and_cancellations(monkeypatch):
    monkeypatch.setattr(driver_api, "_cuda", _FakeCuda())
    lane = lanes.Lane(0)
    rng = random.Random(7)
    finished = []

    async def reads(k, count, cancel_after=None):
        sizes = [rng.choice([1 << 10, 1 << 16, 1 << 20]) for _ in range(count)]
        waits = [lane.copy(0, 0, n) for n in sizes]
        with anyio.CancelScope() as scope:
            if cancel_after is not None:
                scope.deadline = anyio.current_time() + cancel_after
            await lane.fence(waits[-1])  # a batch waits for its last copy only
            assert all(w.result == 0 for w in waits)
            finished.append(k)

    uncancelled = []
    with anyio.fail_after(30):  # a lost poller would hang here
        for round_ in range(10):
            async with anyio.create_task_group() as tg:
                for k in range(100 * round_, 100 * round_ + 12):
                    cancel_after = rng.random() * 0.002 if rng.random() < 0.3 else None
                    if cancel_after is None:
                        uncancelled.append(k)
                    tg.start_soon(reads, k, rng.randint(1, 8), cancel_after)
    assert set(uncancelled) <= set(finished) and not lane._polling and not lane._waiting
    async with anyio.create_task_group() as tg:  # single reads land oldest first
        for k in range(50):
            tg.start_soon(reads, k, 1)
    assert finished[-50:] == list(range(50))


@pytest.mark.anyio
async def test_reads_adjacent_on_both_sides_go_as_one_copy(monkeypatch):
    """A pull's buckets lie back to back in the slot and in the mirror: one copy of up to
    `_MERGE_UP_TO` costs the stream less than one per bucket. Reads of another remote, into
    another region, or not adjacent on both sides stay apart."""
    fake = _FakeCuda()
    monkeypatch.setattr(driver_api, "_cuda", fake)
    monkeypatch.setattr(transport, "_MERGE_UP_TO", 1000)
    t = CudaIpcTransport()
    lane = t._lanes[0] = lanes.Lane(0)
    a, b = object(), object()
    remote_a, remote_b = SimpleNamespace(handle=a), SimpleNamespace(handle=b)
    mirror, other = object(), object()
    monkeypatch.setattr(
        t,
        "_route",
        lambda remote, ro, local, lo, n, checked: (
            lane,
            {mirror: 10_000, other: 20_000}[local] + lo,
            {a: 0, b: 5_000}[remote.handle] + ro,
        ),
    )
    reads = [
        (remote_a, 0, mirror, 0, 100),
        (remote_a, 100, mirror, 100, 200),
        (remote_a, 300, mirror, 300, 0),
        (remote_a, 300, mirror, 300, 300),  # adjacent: one copy of 600
        (remote_a, 700, mirror, 600, 100),  # a gap in the remote
        (remote_b, 0, mirror, 700, 100),  # adjacent in the mirror, another remote
        (remote_b, 100, other, 0, 50),  # another region
        (remote_b, 150, other, 50, 900),
        (remote_b, 1050, other, 950, 100),
    ]  # past the cap: two
    await t.read_many(reads)
    assert fake.copies == [
        (10_000, 0, 600),
        (10_600, 700, 100),
        (10_700, 5_000, 100),
        (20_000, 5_100, 950),
        (20_950, 6_050, 100),
    ]
    assert not lane._queue and len(fake.landing) == 5  # an event after each copy, all landed


@settings(max_examples=200, deadline=None, derandomize=True)
@given(
    st.lists(
        st.tuples(st.integers(0, 1), st.integers(0, 1), st.integers(0, 3), st.integers(0, 3), st.integers(0, 40)),
        max_size=12,
    ),
    st.integers(1, 100),
)
def test_merged_copies_move_exactly_the_bytes_the_reads_ask_for(spans, cap):
    """Whatever the reads (adjacent or not, two remotes, two regions, empty ones), the copies
    queued give each destination byte the source byte its read names, copy no byte twice,
    and merge no further than `_MERGE_UP_TO` (a single larger read stays one copy)."""
    fake = _FakeCuda()
    t = CudaIpcTransport.__new__(CudaIpcTransport)  # no sweep, no GPU: only read_many's planning
    t._closed = False
    remotes = [SimpleNamespace(handle=object()) for _ in range(2)]
    regions = [object(), object()]
    base = {id(remotes[0].handle): 0, id(remotes[1].handle): 10_000, id(regions[0]): 100_000, id(regions[1]): 200_000}
    reads, cursor = [], [[0, 0], [0, 0]]  # per remote and region: where the next adjacent read would start
    for remote, region, gap_r, gap_l, n in spans:
        cursor[remote][0] += gap_r
        cursor[region][1] += gap_l
        reads.append((remotes[remote], cursor[remote][0], regions[region], cursor[region][1], n))
        cursor[remote][0] += n
        cursor[region][1] += n

    async def run() -> None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(driver_api, "_cuda", fake)
            mp.setattr(transport, "_MERGE_UP_TO", cap)
            lane = lanes.Lane(0)
            mp.setattr(t, "_lanes", {0: lane}, raising=False)
            mp.setattr(
                t, "_route", lambda r, ro, local, lo, n, checked: (lane, base[id(local)] + lo, base[id(r.handle)] + ro)
            )
            await t.read_many(reads)

    anyio.run(run)
    want = {base[id(local)] + lo + i: base[id(r.handle)] + ro + i for r, ro, local, lo, n in reads for i in range(n)}
    got: dict[int, int] = {}
    for dst, src, n in fake.copies:
        assert 0 < n <= max(cap, max((r[4] for r in reads), default=0))
        for i in range(n):
            got[dst + i] = src + i
    assert got == want and sum(n for *_, n in fake.copies) == sum(r[4] for r in reads)


def test_a_host_slot_this_process_exported_is_read_in_place_and_a_peers_is_mapped(monkeypatch):
    """Reading its own export, a process uses the owner's pointer (no second mapping, no
    second page-lock); a peer's host slot needs mapping, once."""
    fake = _FakeCuda()
    fake.cuMemHostRegister_v2 = fake.cuMemHostUnregister = lambda *args: 0
    monkeypatch.setattr(driver_api, "_cuda", fake)
    t = CudaIpcTransport()
    t._index = 0  # the device, without asking torch for one
    region = t.allocate(4096, "cpu")
    own = t.connect(t.export(region)).handle
    assert own.in_place and not own.needs_host_map
    assert mappings.map_device(own, 0) == region.handle.pointer
    peers = owners.OwnerFile(4096, data=True)
    try:
        peer = t.connect(_descriptor(peers.path, 4096, memory="host", handle="", offset=owners.DATA_OFFSET)).handle
        assert not peer.in_place and peer.needs_host_map
        peer.mapped_host = True
        assert not peer.needs_host_map  # mapped once
    finally:
        peers.release(owners.CLOSED)
    t.deregister(region)
    assert not own.in_place  # no longer this process's export


def test_a_host_slot_is_lent_read_only_to_the_host_and_nothing_is_lent_across_pcie(monkeypatch):
    """`view` lends a host slot to "cpu" as a read-only view of its bytes, made once; a
    host slot to a GPU, or a GPU slot to the host, it does not (those a copy crosses once)."""
    fake = _FakeCuda()
    fake.cuMemHostRegister_v2 = fake.cuMemHostUnregister = lambda *args: 0
    monkeypatch.setattr(driver_api, "_cuda", fake)
    t = CudaIpcTransport()
    t._index = 0
    region = t.allocate(4096, "cpu")
    region.view[:5] = b"slot!"
    remote = t.connect(t.export(region))
    lent = t.view(remote, "cpu")
    assert lent is not None and lent.device == "cpu" and lent.nbytes == 4096
    assert bytes(lent.view[:5]) == b"slot!" and lent.view.readonly
    region.view[0] = ord("S")
    assert bytes(lent.view[:5]) == b"Slot!"  # the slot itself, not a copy
    assert t.view(remote, "cpu") is lent and t.view(remote, "cuda:0") is None
    owner = owners.OwnerFile(4096)
    try:
        gpu_slot = t.connect(_descriptor(owner.path, 4096))
        assert t.view(gpu_slot, "cpu") is None
    finally:
        owner.release(owners.CLOSED)
    t.disconnect(remote)
    with pytest.raises(InvalidArgumentError, match="disconnected"):
        t.view(remote, "cpu")
    t.deregister(region)
