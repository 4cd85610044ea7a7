"""The driver conformance suite: what every transport driver must do, with the peer in
another process wherever the driver crosses processes. The built-in drivers pass it in
weightpull's own test run (tests/conformance); a third-party driver runs the same suite:

    WEIGHTPULL_DRIVERS=mydriver pytest --pyargs weightpull.drivers.testing.conformance_suite

($WEIGHTPULL_DRIVERS: comma-separated driver names, "fake,nixl" by default; see
`conformance.kit_for` for how a driver gets its kit.)
"""

import os

import anyio
import pytest

from weightpull import InvalidArgumentError, TransportError
from weightpull.errors import PeerGoneError, RegionNotRegisteredError
from weightpull.transport import Remote

from .conformance import DEFAULT_DRIVERS, kit_for, pattern

pytestmark = pytest.mark.anyio

DRIVERS = os.environ.get("WEIGHTPULL_DRIVERS", ",".join(DEFAULT_DRIVERS)).split(",")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=sorted(DRIVERS))
def kit(request):
    kit = kit_for(request.param)
    yield kit
    kit.close()


@pytest.fixture
async def transport(kit):
    t = kit.new_transport()
    yield t
    await t.aclose()


@pytest.fixture
def peer(kit):
    return kit.shared_peer()


def _needs(kit, what: str):
    if getattr(kit, what) is None:  # only a third party's generic kit lacks them
        pytest.skip(f"the {kit.name} kit has no `{what}`: register a Kit under weightpull.conformance_kits")


SIZE = (1 << 20) + 12345  # not a multiple of any page or chunk


async def test_register_export_connect_read_all(transport, peer):
    descriptor = await peer.alloc(SIZE, seed=1)
    assert isinstance(descriptor, bytes)
    remote = transport.connect(descriptor)
    assert isinstance(remote, Remote) and remote.nbytes == SIZE
    local = transport.allocate(SIZE)
    assert local.nbytes == SIZE and local.device == "cpu"
    await transport.read(remote, 0, local, 0, SIZE)
    assert bytes(local.host_view()) == pattern(SIZE, 1)


async def test_read_part_into_an_offset_leaves_the_rest(transport, peer):
    remote = transport.connect(await peer.alloc(SIZE, seed=2))
    mine = bytearray(b"\xaa" * 4096)
    local = transport.register(mine)
    await transport.read(remote, 100_001, local, 1000, 2000)
    assert bytes(mine[1000:3000]) == pattern(SIZE, 2)[100_001:102_001]
    assert mine[:1000] == b"\xaa" * 1000 and mine[3000:] == b"\xaa" * 1096
    await transport.read(remote, SIZE - 1, local, 0, 1)  # the last byte
    assert mine[0] == pattern(SIZE, 2)[-1]
    await transport.read(remote, 0, local, 0, 0)  # nothing, and no error


async def test_rereading_a_span_sees_the_peers_new_bytes(transport, peer):
    descriptor = await peer.alloc(SIZE, seed=3)
    remote = transport.connect(descriptor)
    local = transport.allocate(SIZE)
    for seed in (3, 4, 5):  # the same span each time: drivers may reuse a prepared transfer
        if seed != 3:
            await peer.fill(descriptor, seed)
        await transport.read(remote, 0, local, 0, SIZE)
        assert bytes(local.host_view()) == pattern(SIZE, seed)


async def test_a_descriptor_connects_any_number_of_times(transport, peer):
    descriptor = await peer.alloc(4096, seed=6)
    first, second = transport.connect(descriptor), transport.connect(descriptor)
    local = transport.allocate(8192)
    await transport.read(first, 0, local, 0, 4096)
    transport.disconnect(first)
    await transport.read(second, 0, local, 4096, 4096)
    assert bytes(local.host_view()) == pattern(4096, 6) * 2


async def test_concurrent_reads(transport, peer):
    remote = transport.connect(await peer.alloc(SIZE, seed=7))
    local = transport.allocate(SIZE + 2 * 65536)
    chunk = 65536
    spans = [(off, min(chunk, SIZE - off)) for off in range(0, SIZE, chunk)]
    async with anyio.create_task_group() as tg:
        for off, n in spans:
            tg.start_soon(transport.read, remote, off, local, off, n)
        for k in range(2):  # the same span twice at once
            tg.start_soon(transport.read, remote, 0, local, SIZE + k * chunk, chunk)
    view = local.host_view()
    want = pattern(SIZE, 7)
    assert bytes(view[:SIZE]) == want
    assert bytes(view[SIZE : SIZE + chunk]) == bytes(view[SIZE + chunk :]) == want[:chunk]


async def test_reads_of_ranges_never_registered_are_refused(kit, transport, peer):
    _needs(kit, "widen")
    descriptor = await peer.alloc(4096, seed=8)
    remote = transport.connect(descriptor)
    local = transport.allocate(4096)
    with pytest.raises(RegionNotRegisteredError, match=r"\[4000, 4100\)"):
        await transport.read(remote, 4000, local, 0, 100)
    with pytest.raises(RegionNotRegisteredError, match="local"):
        await transport.read(remote, 0, local, 4000, 100)
    # A descriptor that claims more than the peer registered: the library itself refuses.
    widened = transport.connect(kit.widen(descriptor, 1 << 20))
    big = transport.allocate(1 << 20)
    with pytest.raises(RegionNotRegisteredError):
        await transport.read(widened, 4096, big, 0, 1 << 20)
    stranger = kit.new_transport()
    try:
        with pytest.raises(RegionNotRegisteredError, match="local"):
            await transport.read(remote, 0, stranger.allocate(16), 0, 16)
    finally:
        await stranger.aclose()
    await transport.read(remote, 0, local, 0, 4096)  # the failures left nothing broken
    assert bytes(local.host_view()) == pattern(4096, 8)


async def test_a_read_after_the_peer_exited_raises_peer_gone(kit, transport):
    peer = kit.new_peer()
    try:
        remote = transport.connect(await peer.alloc(SIZE, seed=9))
        local = transport.allocate(SIZE)
        await transport.read(remote, 0, local, 0, SIZE)
        await peer.exit()
        with pytest.raises(PeerGoneError):
            await transport.read(remote, 0, local, 0, SIZE)  # a span read before
        with pytest.raises(PeerGoneError):
            await transport.read(remote, 10, local, 0, 100)  # a span never read
    finally:
        peer.close()


async def test_deregister_and_close_leave_no_registration_behind(kit, transport, peer):
    _needs(kit, "holds")
    remote = transport.connect(await peer.alloc(4096, seed=10))
    regions = [transport.allocate(4096), transport.allocate(1 << 20), transport.register(bytearray(4096))]
    for region in regions:
        await transport.read(remote, 0, region, 0, 4096)
        assert kit.holds(transport, region)
    transport.deregister(regions[0])
    assert not kit.holds(transport, regions[0])
    transport.deregister(regions[0])  # twice is harmless
    with pytest.raises(RegionNotRegisteredError):
        await transport.read(remote, 0, regions[0], 0, 4096)
    with pytest.raises(RegionNotRegisteredError):
        transport.export(regions[0])
    await transport.aclose()
    assert not any(kit.holds(transport, region) for region in regions)
    with pytest.raises(TransportError, match="closed"):
        await transport.read(remote, 0, regions[1], 0, 4096)
    await transport.aclose()  # twice is harmless


async def test_bad_memory_and_descriptors_are_refused(transport):
    with pytest.raises(InvalidArgumentError, match="writable"):
        transport.register(b"read-only bytes")
    with pytest.raises(InvalidArgumentError):
        transport.register(object())
    with pytest.raises(InvalidArgumentError, match="descriptor"):
        transport.connect(b"garbage")


async def test_serve_runs_until_cancelled_or_returns(transport, peer):
    transport.allocate(4096)
    with anyio.move_on_after(0.05):
        await transport.serve()


async def test_2d_reads_copy_every_row_and_only_the_rows(transport, peer):
    """A column band of a row-major array (a row-parallel share): rows `pitch` apart on
    the peer, packed or apart locally; native or one read per row, the bytes are the same."""
    want = pattern(SIZE, 11)
    remote = transport.connect(await peer.alloc(SIZE, seed=11))
    mine = bytearray(b"\xaa" * 65536)
    local = transport.register(mine)
    width, pitch, height = 1000, 4099, 40
    await transport.read_2d(remote, 777, pitch, local, 8, width, width, height)
    assert bytes(mine[8 : 8 + width * height]) == b"".join(
        want[777 + i * pitch : 777 + i * pitch + width] for i in range(height)
    )
    assert mine[:8] == b"\xaa" * 8 and mine[8 + width * height :] == b"\xaa" * (65536 - 8 - width * height)
    mine[:] = b"\xaa" * 65536
    await transport.read_2d_many(
        [
            (remote, 0, 100, local, 0, 300, 100, 50),  # spread apart locally
            (remote, SIZE - 64, 0, local, 20000, 64, 64, 3),  # the peer's last bytes, three times
            (remote, 5, 7, local, 30000, 7, 0, 9),  # nothing
            (remote, 5, 7, local, 30000, 7, 7, 0),  # nothing
        ]
    )
    for i in range(50):
        assert bytes(mine[i * 300 : i * 300 + 100]) == want[i * 100 : i * 100 + 100]
        assert mine[i * 300 + 100 : i * 300 + 300] == b"\xaa" * 200
    assert bytes(mine[20000:20192]) == want[-64:] * 3
    assert mine[30000:] == b"\xaa" * (65536 - 30000)
    with pytest.raises(InvalidArgumentError, match="rows would overlap"):
        await transport.read_2d(remote, 0, 100, local, 0, 50, 100, 2)
    with pytest.raises(InvalidArgumentError, match=">= 0"):
        await transport.read_2d(remote, 0, -1, local, 0, 100, 100, 2)
    with pytest.raises(RegionNotRegisteredError):
        await transport.read_2d(remote, 0, SIZE, local, 0, 100, 100, 2)  # the second row lies past the peer's end
    with pytest.raises(RegionNotRegisteredError):
        await transport.read_2d(remote, 0, 100, local, 65536 - 150, 100, 100, 2)  # past the local end
