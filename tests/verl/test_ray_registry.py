"""The registry in a named Ray actor, on a local Ray instance: a trainer task publishes
over nixl while two replica actors pull every version, each process with its own
`RayRegistry` handle (and token) on the one actor; leases judged on the actor's clock;
errors back as the same types an embedded registry raises; each caller acts as the
principal its token proves, so a reader cannot begin, commit or retire the trainer's
versions; every operation of the table (streams, reservations, relays) works through it."""

import time
import uuid

import anyio
import pytest
import ray
import torch

from weightpull import Manifest, Publisher, Puller, create_transport, plan_layout
from weightpull.drivers.ray_registry import RayRegistry
from weightpull.errors import (
    AuthenticationError,
    InvalidArgumentError,
    LeaseExpiredError,
    NoReadyVersionError,
    NoSourceError,
    PermissionDeniedError,
    RegistryUnavailableError,
    VersionNotFoundError,
    VersionWaitTimeoutError,
)
from weightpull.integrations.torch_tensors import as_tensors
from weightpull.layout import TensorSpec
from weightpull.principals import Principal
from weightpull.records import Reservation
from weightpull.registry import Registry, RelayingRegistry, ReservingRegistry, StreamingRegistry

from .weights import same_bits, weights

pytestmark = pytest.mark.anyio
VERSIONS = (1, 2, 3)


@ray.remote(num_cpus=1)
def trainer(address: str, token: str, replicas: list[str]) -> list[int]:
    """Publish each version, then wait until every replica serves it: the slots stay
    served (`async with Publisher`) while they read."""

    async def main() -> list[int]:
        published = []
        async with RayRegistry(address, token=token) as registry, create_transport("nixl") as transport:
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
    def __init__(self, address: str, name: str, token: str) -> None:
        self.address, self.name, self.token = address, name, token

    async def follow(self, count: int) -> list[tuple[int, list[str]]]:
        """Pull `count` versions as they come, each checked bit for bit against what the
        trainer cast to bf16; (version, names that differ) of each."""
        seen = []
        async with RayRegistry(self.address, token=self.token) as registry, create_transport("nixl") as transport:
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
    names = ["replica-0", "replica-1"]
    principals = [Principal.publisher("trainer"), *map(Principal.reader, names)]
    registry = RayRegistry.create(address, principals=principals)  # the driver's: it lives as long as the test
    assert isinstance(registry, Registry)
    assert await registry.newest() is None
    replicas = [Replica.remote(address, n, registry.tokens[Principal.reader(n)]) for n in names]
    follows = [r.follow.remote(len(VERSIONS)) for r in replicas]  # parked in wait_for_version first
    published = await trainer.remote(address, registry.tokens[Principal.publisher("trainer")], names)
    assert published == list(VERSIONS)
    for seen in await anyio.to_thread.run_sync(ray.get, follows):
        assert seen == [(v, []) for v in VERSIONS]  # every version, bit-exact
    status = await registry.status()
    assert status.newest_ready == VERSIONS[-1]
    assert dict(status.serving) == dict.fromkeys(names, VERSIONS[-1])
    assert status.leases == ()  # every lease released after its pull
    registry.kill()


async def test_leases_are_judged_on_the_actors_clock_and_errors_keep_their_types(ray_local):
    with pytest.warns(DeprecationWarning, match="without a token"):  # an open registry: still works, for a release
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
    with pytest.warns(DeprecationWarning):
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


# -- principals, and every operation of the table ----------------------------------------

TRAINER, READER = Principal.publisher("trainer"), Principal.reader("replica-0")


def manifest(version: int, slot: int = 0, *, buckets: int = 1, digests: bool = False) -> Manifest:
    specs = [TensorSpec(f"w{i}", "uint8", (8,)) for i in range(buckets)]
    sums = tuple(f"d{i}" for i in range(buckets)) if digests else None
    return Manifest(version, plan_layout(specs, bucket_bytes=8), "fake", b"{}", slot, "trainer", sums)


def made(*principals: Principal) -> tuple[RayRegistry, dict[Principal, RayRegistry]]:
    """The driver's handle on a new registry, and a handle per principal with its token."""
    driver = RayRegistry.create(fresh_address(), principals=principals)
    return driver, {p: RayRegistry(driver.address, token=t) for p, t in driver.tokens.items()}


async def test_a_readers_token_cannot_begin_commit_or_retire_the_trainers_versions(ray_local):
    driver, handles = made(TRAINER, READER)
    trainer, reader = handles[TRAINER], handles[READER]
    assert set(driver.tokens) == {TRAINER, READER} and len(set(driver.tokens.values())) == 2
    v1 = await trainer.begin(publisher="trainer", slot=0)
    with pytest.raises(PermissionDeniedError, match="reader replica-0 may not begin"):
        await reader.begin(publisher="trainer", slot=1)
    with pytest.raises(PermissionDeniedError, match="reader replica-0 may not commit"):
        await reader.commit(manifest(v1))
    await trainer.commit(manifest(v1))
    with pytest.raises(PermissionDeniedError, match="reader replica-0 may not retire"):
        await reader.retire(v1)
    with pytest.raises(PermissionDeniedError):
        await reader.abort(v1, "not mine")
    assert (await reader.newest()).version == v1  # what it may do: read
    lease = await reader.acquire(ttl=5.0, holder="replica-0")
    with pytest.raises(PermissionDeniedError):  # a lease under another's name
        await reader.acquire(ttl=5.0, holder="trainer")
    with pytest.raises(PermissionDeniedError):
        await trainer.release(lease)  # another's lease
    assert await reader.release_checked(lease) is True
    await trainer.retire(v1)  # the trainer may
    await trainer.reclaim(v1)
    status = await driver.status()  # the driver's handle is an admin
    assert [v.version for v in status.versions] == []
    driver.kill()


async def test_a_call_without_a_token_or_with_a_foreign_one_is_refused_saying_what_to_pass(ray_local):
    driver, _ = made(TRAINER)
    stranger = RayRegistry(driver.address, token="not-one-of-them")
    with pytest.raises(AuthenticationError, match="no such token"):
        await stranger.begin(publisher="trainer", slot=0)
    with pytest.warns(DeprecationWarning):
        tokenless = RayRegistry(driver.address)
    with pytest.raises(AuthenticationError, match="takes tokens.*token="):
        await tokenless.status()
    nowhere = RayRegistry(fresh_address(), token="t")  # a token's handle finds, never creates
    with pytest.raises(RegistryUnavailableError, match="RayRegistry.create"):
        await nowhere.status()
    with pytest.raises(InvalidArgumentError, match="cannot create"):
        RayRegistry.create(driver.address, principals=[TRAINER])  # the name is taken
    with pytest.raises(InvalidArgumentError, match="Principal"):
        RayRegistry.create(fresh_address(), principals=[])
    driver.kill()


async def test_streams_reservations_relays_and_liveness_work_through_the_actor(ray_local):
    relay = Principal.reader("replica-1")
    driver, handles = made(TRAINER, READER, relay)
    trainer, reader, relaying = handles[TRAINER], handles[READER], handles[relay]
    for registry in (trainer, reader):
        assert isinstance(registry, StreamingRegistry | ReservingRegistry | RelayingRegistry)
        assert isinstance(registry, StreamingRegistry) and isinstance(registry, RelayingRegistry)
    await trainer.reserve(Reservation("trainer", "fake", (b"s0", b"s1"), 16))
    assert [r.publisher for r in await reader.reservations()] == ["trainer"]
    with pytest.raises(PermissionDeniedError):
        await reader.reserve(Reservation("trainer", "fake", (b"s0",), 16))
    # A stream: read bucket by bucket while it is written.
    v = await trainer.begin(publisher="trainer", slot=0)
    await trainer.stream(manifest(v, buckets=2))
    lease = await reader.acquire(ttl=10.0, holder="replica-0", streaming=True)
    assert lease.version == v
    async with anyio.create_task_group() as tg:
        waited = []

        async def wait() -> None:
            waited.append(await reader.wait_for_buckets(v, 1, timeout=30.0, publisher="trainer"))

        tg.start_soon(wait)
        await anyio.sleep(0.2)  # parked in the actor meanwhile
        await trainer.mark(v, 1)
    assert waited[0].committed == 1
    assert (await reader.progress(v)).committed == 1
    with pytest.raises(PermissionDeniedError):
        await reader.mark(v, 2)
    await trainer.mark(v, 2)
    await trainer.commit_stream(v, ["d0", "d1"])
    assert (await reader.wait_for_version(v, timeout=10.0, publisher="trainer")).digests == ("d0", "d1")
    assert await reader.release_checked(lease) is True
    # A relay: a replica holding the version offers its mirror; a reader is placed there.
    await relaying.offer(v, holder="replica-1", host="h1", descriptor=b"\x00mirror", cap=4)
    with pytest.raises(PermissionDeniedError):
        await reader.offer(v, holder="replica-1", host="h1", descriptor=b"x")  # another's name
    placed = await reader.acquire(v, ttl=10.0, holder="replica-0", host="h1", exclude=())
    assert (placed.source, placed.descriptor) == ("replica-1", b"\x00mirror")
    assert await relaying.readers_at(v, "replica-1") == 1
    assert (await reader.progress(v, source="replica-1")).state.name == "READY"
    assert await reader.is_valid(placed)
    await reader.release(placed)
    assert await relaying.readers_at(v, "replica-1") == 0
    await relaying.withdraw(v, holder="replica-1")
    # Liveness: a principal keeps alive only its own names; status names the live.
    await reader.keepalive(("replica-0",))
    with pytest.raises(PermissionDeniedError):
        await reader.keepalive(("trainer",))
    await reader.report_serving("replica-0", v)
    status = await driver.status()
    assert dict(status.serving) == {"replica-0": v} and status.newest_ready == v
    driver.kill()


async def test_a_registry_that_judges_liveness_ends_a_trainers_stream_once_its_heartbeat_stops(ray_local):
    driver = RayRegistry.create(fresh_address(), principals=[TRAINER, READER], liveness_ttl=2.0)
    trainer = RayRegistry(driver.address, token=driver.tokens[TRAINER], heartbeat=0.2)
    reader = RayRegistry(driver.address, token=driver.tokens[READER])
    v = await trainer.begin(publisher="trainer", slot=0)
    await trainer.stream(manifest(v, buckets=2))
    await anyio.sleep(3.0)  # past the TTL: the handle's heartbeat keeps the trainer alive
    assert (await reader.progress(v)).state.name == "STREAMING"
    assert "trainer" in (await driver.status()).alive
    await trainer.aclose()  # its heartbeat stops: silent past the TTL, the trainer is judged dead
    await anyio.sleep(3.0)
    assert (await reader.progress(v)).state.name == "ABORTED"
    driver.kill()


async def test_an_origin_cap_places_readers_past_it_elsewhere(ray_local):
    driver = RayRegistry.create(fresh_address(), principals=[TRAINER, READER], origin_cap=1)
    trainer = RayRegistry(driver.address, token=driver.tokens[TRAINER])
    reader = RayRegistry(driver.address, token=driver.tokens[READER])
    v = await trainer.begin(publisher="trainer", slot=0)
    await trainer.commit(manifest(v, digests=True))
    assert (await reader.acquire(v, ttl=10.0, holder="replica-0/a", host="h1")).source == ""  # the slot's one place
    with pytest.raises(NoSourceError):  # no relay offers it: ask again later
        await reader.acquire(v, ttl=10.0, holder="replica-0/b", host="h2")
    driver.kill()


async def test_a_call_as_a_handle_of_an_earlier_release_makes_it_is_answered(ray_local):
    """Such a handle sent every argument, an optional one unset as None (shard=None)."""
    with pytest.warns(DeprecationWarning):
        registry = RayRegistry(fresh_address())
    answer = await registry.actor.call.remote("begin", {"version": None, "publisher": "p", "slot": 0, "shard": None})
    assert isinstance(answer["ok"], int)
    answer = await registry.actor.call.remote("newest", {})
    assert answer == {"ok": None}
    registry.kill()
