import os

import pytest

from .kits import DEFAULT_DRIVERS, KITS

DRIVERS = os.environ.get("WEIGHTPULL_DRIVERS", ",".join(DEFAULT_DRIVERS)).split(",")


@pytest.fixture(scope="module", params=sorted(DRIVERS))
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
