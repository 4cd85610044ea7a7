"""A wait parked in the registry's Ray actor ends when the publisher it waits on lapses,
with `PublisherLapsedError` naming it, within about the liveness TTL and not at the
wait's own timeout; a trainer's `wait_until_served` there ends on a replica that left."""

import anyio
import pytest

from weightpull import wait_until_served
from weightpull.drivers.ray_registry import RayRegistry
from weightpull.errors import PublisherLapsedError, ReplicasLeftError

from .test_ray_registry import READER, TRAINER, fresh_address, manifest

pytestmark = pytest.mark.anyio
TTL = 1.0


async def test_a_wait_in_the_actor_ends_at_the_publishers_lapse_and_a_replica_leaving_ends_wait_until_served(
    ray_local,
):
    driver = RayRegistry.create(fresh_address(), principals=[TRAINER, READER], liveness_ttl=TTL)
    trainer = RayRegistry(driver.address, token=driver.tokens[TRAINER], heartbeat=TTL / 5)
    reader = RayRegistry(driver.address, token=driver.tokens[READER], heartbeat=None)  # no heartbeat: it leaves
    try:
        v = await trainer.begin(publisher="trainer", slot=0)
        await trainer.commit(manifest(v, buckets=1))
        await reader.report_serving("replica-0", v)
        with pytest.raises(ReplicasLeftError, match="'replica-0' .* left"):
            await wait_until_served(trainer, v + 1, timeout=30, poll=0.1)
        await trainer.aclose()  # its heartbeat stops: it lapses after the TTL
        started = anyio.current_time()
        with pytest.raises(PublisherLapsedError, match="publisher 'trainer' lapsed"):
            await reader.wait_for_version(v + 1, timeout=30, publisher="trainer")
        assert anyio.current_time() - started < 3 * TTL
    finally:
        await reader.aclose()
        driver.kill()
