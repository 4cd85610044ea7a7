import pytest

from .kits import KITS


@pytest.fixture(scope="module", params=sorted(KITS))
def kit(request):
    kit = KITS[request.param]()
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
