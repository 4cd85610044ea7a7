import pytest

from weightpull import InvalidArgumentError, TransportError
from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.errors import PeerGoneError, RegionNotRegisteredError

pytestmark = pytest.mark.anyio


@pytest.fixture
def pair():
    fabric = FakeFabric()
    return FakeTransport(fabric=fabric), FakeTransport(fabric=fabric)


async def test_register_export_connect_read(pair):
    owner, reader = pair
    src = owner.register(bytearray(b"0123456789" * 100))
    remote = reader.connect(owner.export(src))
    dst = reader.allocate(1000)
    await reader.read(remote, 0, dst, 0, 1000)
    assert bytes(dst.host_view()) == b"0123456789" * 100
    await reader.read(remote, 3, dst, 500, 4)
    assert bytes(dst.host_view()[500:504]) == b"3456"


async def test_reads_outside_registered_memory_are_refused(pair):
    owner, reader = pair
    remote = reader.connect(owner.export(owner.allocate(100)))
    dst = reader.allocate(100)
    with pytest.raises(RegionNotRegisteredError, match=r"\[90, 110\)"):
        await reader.read(remote, 90, dst, 0, 20)
    with pytest.raises(RegionNotRegisteredError, match="local"):
        await reader.read(remote, 0, dst, 90, 20)
    stranger = FakeTransport(fabric=owner.fabric).allocate(10)
    with pytest.raises(RegionNotRegisteredError, match="local region"):
        await reader.read(remote, 0, stranger, 0, 10)


async def test_deregistered_and_exited_peers(pair):
    owner, reader = pair
    a, b = owner.allocate(10), owner.allocate(10)
    ra, rb = reader.connect(owner.export(a)), reader.connect(owner.export(b))
    dst = reader.allocate(10)
    owner.deregister(a)
    with pytest.raises(RegionNotRegisteredError):
        await reader.read(ra, 0, dst, 0, 10)
    await owner.aclose()
    with pytest.raises(PeerGoneError):
        await reader.read(rb, 0, dst, 0, 10)
    await reader.aclose()
    with pytest.raises(TransportError, match="closed"):
        await reader.read(rb, 0, dst, 0, 10)


async def test_bad_memory_and_descriptors(pair):
    owner, reader = pair
    with pytest.raises(InvalidArgumentError, match="writable"):
        owner.register(b"read-only bytes")
    with pytest.raises(InvalidArgumentError, match="cannot allocate on 'cuda:0'"):
        owner.allocate(10, device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="host memory only"):
        owner.register(bytearray(4), device="cuda:0")
    with pytest.raises(InvalidArgumentError, match="descriptor"):
        reader.connect(b"garbage")
    with pytest.raises(RegionNotRegisteredError):
        reader.export(owner.allocate(1))
