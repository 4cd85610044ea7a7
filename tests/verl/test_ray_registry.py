"""The registry in a named Ray actor, on a local Ray instance: a trainer task publishes
over nixl while two replica actors pull every version, each process with its own
`RayRegistry` handle on the one actor; leases judged on the actor's clock; errors back as
the same types an embedded registry raises."""

import time
import uuid

import anyio
import pytest
import ray
import torch

from weightpull import Publisher, Puller, create_transport
from weightpull.drivers.ray_registry import RayRegistry
from weightpull.errors import (
    InvalidArgumentError,
    LeaseExpiredError,
    NoReadyVersionError,
    RegistryUnavailableError,
    VersionNotFoundError,
    VersionWaitTimeoutError,
)
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.registry import Registry

from .weights import same_bits, weights

pytestmark = pytest.mark.anyio
VERSIONS = (1, 2, 3)


@ray.remote(num_cpus=1)
def trainer(address: str, replicas: list[str]) -> list[int]:
    """Publish each version, then wait until every replica serves it: the slots stay
    served (`async with Publisher`) while they read."""

    async def main() -> list[int]:
        published = []
        async with RayRegistry(address) as registry, create_transport("nixl") as transport:
            async with Publisher(registry, transport, name="trainer", bucket_bytes=16 << 10) as publisher:
                for version in VERSIONS:
                    result = await publisher.publish(version, weights(version))
                    published.append(result.version)
                    with anyio.fail_after(60):
                        while dict((await registry.status()).serving) != dict.fromkeys(replicas, version):
                            await anyio.sleep(0.05)
        return published

    return anyio.run(main)


@ray.remote(num_cpus=1)
class Replica:
    def __init__(self, address: str, name: str) -> None:
        self.address, self.name = address, name

    async def follow(self, count: int) -> list[tuple[int, list[str]]]:
        """Pull `count` versions as they come, each checked bit for bit against what the
        trainer cast to bf16; (version, names that differ) of each."""
        seen = []
        async with RayRegistry(self.address) as registry, create_transport("nixl") as transport:
            async with Puller(registry, transport, holder=self.name, ttl=10.0) as puller:
                last = 0
                for _ in range(count):
                    await registry.wait_for_version(last + 1, timeout=60)
                    pulled = await puller.pull()
                    want = {n: t.to(torch.bfloat16) for n, t in weights(pulled.version).items()}
                    seen.append((pulled.version, same_bits(as_tensors(pulled.layout, pulled.region), want)))
                    await registry.report_serving(self.name, pulled.version)
                    last = pulled.version
        return seen


def fresh_address() -> str:
    return f"ray://wp-{uuid.uuid4().hex[:8]}"


async def test_a_trainer_task_and_two_replica_actors_share_one_registry_actor(ray_local):
    address = fresh_address()
    registry = RayRegistry(address)  # the driver creates the actor: it lives as long as the test
    assert isinstance(registry, Registry)
    assert await registry.newest() is None
    names = ["replica-0", "replica-1"]
    replicas = [Replica.remote(address, n) for n in names]
    follows = [r.follow.remote(len(VERSIONS)) for r in replicas]  # parked in wait_for_version first
    published = await trainer.remote(address, names)
    assert published == list(VERSIONS)
    for seen in await anyio.to_thread.run_sync(ray.get, follows):
        assert seen == [(v, []) for v in VERSIONS]  # every version, bit-exact
    status = await registry.status()
    assert status.newest_ready == VERSIONS[-1]
    assert dict(status.serving) == dict.fromkeys(names, VERSIONS[-1])
    assert status.leases == ()  # every lease released after its pull
    registry.kill()


async def test_leases_are_judged_on_the_actors_clock_and_errors_keep_their_types(ray_local):
    registry = RayRegistry(fresh_address())
    with pytest.raises(NoReadyVersionError):
        await registry.acquire(ttl=1.0, holder="r")
    async with Publisher(registry, create_transport("fake"), name="p", rollout_dtype=None) as publisher:
        await publisher.publish(1, weights(1))
        lease = await registry.acquire(ttl=0.3, holder="r")
        assert await registry.is_valid(lease)
        lease = await registry.renew(lease)
        await anyio.sleep(0.6)  # past the TTL on any clock: the actor's says it lapsed
        assert not await registry.is_valid(lease)
        with pytest.raises(LeaseExpiredError):
            await registry.renew(lease)
        with pytest.raises(VersionNotFoundError):
            await registry.get(99)
        started = time.monotonic()
        with pytest.raises(VersionWaitTimeoutError):
            await registry.wait_for_version(2, timeout=0.3)
        assert time.monotonic() - started < 10
        # A parked wait blocks no other call of the actor.
        async with anyio.create_task_group() as tg:
            tg.start_soon(registry.wait_for_version, 2, 30.0)
            await anyio.sleep(0.2)
            assert (await registry.status()).newest_ready == 1
            await publisher.publish(2, weights(2))
    # A second handle, as another process would make, finds the same actor by name.
    other = RayRegistry(registry.address)
    assert (await other.newest()).version == 2
    registry.kill()
    with pytest.raises(RegistryUnavailableError):
        await other.status()


def test_addresses_are_checked():
    for bad in ("tcp://127.0.0.1:5555", "ray://", "ray://a/b", "weightpull"):
        with pytest.raises(InvalidArgumentError, match="ray://NAME"):
            RayRegistry(bad)
    with pytest.raises(InvalidArgumentError, match="lifetime"):
        RayRegistry("ray://x", lifetime="forever")
