import anyio
import pytest

from weightpull import FakeClock, TornReadError, TransportError
from weightpull.drivers.fake import FakeFabric, FakeFaults, FakeTransport
from weightpull.drivers.faulty import Faults, FaultyTransport

from .conftest import autojump, host_tensors

pytestmark = pytest.mark.anyio

DATA = bytes(range(256)) * 4


@pytest.fixture
def clock():
    return FakeClock()


def endpoints(clock, faults):
    """An owner holding DATA, and a faulty reader around a plain fake endpoint."""
    fabric = FakeFabric()
    owner = FakeTransport(clock=clock, fabric=fabric)
    region = owner.register(bytearray(DATA))
    reader = FaultyTransport(FakeTransport(clock=clock, fabric=fabric), faults, clock=clock)
    return reader, reader.connect(owner.export(region)), reader.allocate(len(DATA))


async def test_without_faults_everything_passes_through(clock):
    reader, remote, local = endpoints(clock, None)
    assert reader.name == "fake"  # manifests name the wrapped driver
    assert local.handle in reader.inner._mine  # registered by the inner endpoint
    await reader.read(remote, 100, local, 0, 200)
    assert bytes(local.host_view()[:200]) == DATA[100:300]
    assert reader.faults.reads == 1 and clock.now() == 0


async def test_delay_and_bandwidth_take_time_on_the_clock(clock):
    reader, remote, local = endpoints(clock, Faults(delay=2.0, bandwidth=100.0))
    async with autojump(clock):
        async with anyio.create_task_group() as tg:  # two reads share one link
            tg.start_soon(reader.read, remote, 0, local, 0, 500)
            tg.start_soon(reader.read, remote, 500, local, 500, 500)
    assert clock.now() == pytest.approx(2 + 1000 / 100)
    assert bytes(local.host_view()[:1000]) == DATA[:1000]


async def test_a_failing_read_lands_half_then_raises(clock):
    reader, remote, local = endpoints(clock, Faults(fail_reads=1))
    with pytest.raises(TransportError, match="injected failure after 512 of 1024"):
        await reader.read(remote, 0, local, 0, 1024)
    view = local.host_view()
    assert bytes(view[:512]) == DATA[:512] and bytes(view[512:]) == bytes(512)
    assert reader.faults.fail_reads == 0
    await reader.read(remote, 0, local, 0, 1024)  # the next one is whole
    assert bytes(view) == DATA


async def test_a_torn_read_stalls_without_yielding_and_lands_other_bytes(clock):
    reader, remote, local = endpoints(clock, Faults(tear_reads=1, freeze=7.0))
    await reader.read(remote, 0, local, 0, 1024)
    assert clock.now() == 7.0  # jumped inside the read: no timer got to run
    view = local.host_view()
    assert bytes(view[:512]) == DATA[:512] and bytes(view[576:]) == DATA[576:]
    assert all(a != b for a, b in zip(view[512:576], DATA[512:576], strict=True))


async def test_a_puller_over_any_wrapped_driver_rejects_a_torn_read(world):
    await world.publisher().publish(1, host_tensors(1))
    faulty = FaultyTransport(world.transport(), Faults(tear_reads=1, freeze=6.0), clock=world.clock)
    puller = world.puller(faulty, ttl=5.0)
    with pytest.raises(TornReadError):
        await puller.pull()
    pulled = await puller.pull()
    assert bytes(pulled.view("t2")) == host_tensors(1)["t2"].data


def test_the_fake_driver_injects_the_same_faults():
    assert FakeFaults is Faults


async def test_the_wrapper_passes_the_owners_progress_and_gpu_traits_through():
    served = []

    class Owner(FakeTransport):
        reads_into_gpu = True

        async def serve(self):
            served.append(True)

    faulty = FaultyTransport(Owner(fabric=FakeFabric()))
    await faulty.serve()
    assert served == [True] and faulty.reads_into_gpu and faulty.name == "fake"
