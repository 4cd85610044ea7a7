"""Lifecycle: registries, transports, publishers and pullers are async context managers.
Each `async with` exits cleanly on success, on error and on cancellation, leaves no task
of its own running, and closing twice does nothing more."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager, nullcontext

import anyio
import pytest

from weightpull import InProcessRegistry, InvalidArgumentError, Manifest, Publisher, connect_registry, plan_layout
from weightpull.layout import TensorSpec
from weightpull.registry import AsyncResource, Registry

from .conftest import host_tensors
from .test_publisher import Progressing

pytestmark = pytest.mark.anyio


def tasks() -> set[asyncio.Task]:
    return asyncio.all_tasks()


async def settled(before: set[asyncio.Task]) -> set[asyncio.Task]:
    """The tasks started since `before` that are still running once cancellations land."""
    for _ in range(20):
        if not (left := tasks() - before):
            break
        await anyio.sleep(0.01)
    return left


class Boom(Exception):
    pass


# -- the in-process registry ---------------------------------------------------------------


async def test_an_in_process_registry_is_an_async_resource_that_keeps_working_after_close():
    before = tasks()
    async with InProcessRegistry() as reg:
        assert isinstance(reg, Registry) and isinstance(reg, AsyncResource)
        await reg.begin(1, publisher="p", slot=0)
    assert tasks() == before
    await reg.aclose()  # twice: harmless
    assert (await reg.status()).versions[0].version == 1  # it keeps working: others may rely on it


async def test_closing_an_in_process_registry_wakes_no_waiter(world):
    reg = world.registry
    got: list[int] = []

    async def wait() -> None:
        got.append((await reg.wait_for_version(1)).version)

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.sleep(0)
        await reg.aclose()
        await anyio.sleep(0)
        assert got == []  # the waiter is its caller's: closing does not end it
        pub = world.publisher()
        await pub.publish(1, host_tensors(1))
    assert got == [1]


async def test_an_in_process_registry_lets_the_blocks_error_and_cancellation_through():
    with pytest.raises(Boom):
        async with InProcessRegistry():
            raise Boom
    with anyio.move_on_after(0.01) as scope:
        async with InProcessRegistry():
            await anyio.sleep_forever()
    assert scope.cancelled_caught


async def test_connect_registry_without_an_address_works_both_ways(monkeypatch):
    monkeypatch.delenv("WEIGHTPULL_REGISTRY", raising=False)
    async with connect_registry() as reg:
        assert isinstance(reg, InProcessRegistry)
    plain = connect_registry()
    await plain.aclose()


# -- transports ----------------------------------------------------------------------------


async def test_a_transport_releases_its_regions_on_exit_error_and_cancellation(world):
    for ending in ("exit", "error", "cancel"):
        before = tasks()
        t = world.transport()
        with anyio.move_on_after(0.01), pytest.raises(Boom) if ending == "error" else nullcontext():
            async with t as entered:
                assert entered is t
                region = t.allocate(64)
                assert region.handle in world.fabric.regions
                if ending == "error":
                    raise Boom
                if ending == "cancel":
                    await anyio.sleep_forever()
        assert region.handle not in world.fabric.regions and t._closed, ending
        await t.aclose()  # twice: harmless
        assert tasks() == before


# -- pullers -------------------------------------------------------------------------------


async def test_a_puller_is_an_async_context_manager_that_releases_what_it_holds(world):
    await world.publisher().publish(1, host_tensors(1))
    transport = world.transport()
    before = tasks()
    async with world.puller(transport) as puller:
        pulled = await puller.pull()
        assert pulled.version == 1 and puller.mirror is not None and puller._remotes
    assert puller.mirror is None and puller.mirror_version is None and not puller._remotes
    assert not transport._mine  # the mirror is deregistered
    assert not transport._closed  # the transport is the caller's: still open
    assert tasks() == before
    await puller.aclose()  # twice: harmless
    assert (await puller.pull()).version == 1  # a later pull registers a mirror afresh
    await puller.aclose()


async def test_a_puller_releases_its_mirror_when_the_block_fails_or_is_cancelled(world):
    await world.publisher().publish(1, host_tensors(1))
    transport = world.transport()
    with pytest.raises(Boom):
        async with world.puller(transport) as puller:
            await puller.pull()
            raise Boom
    assert puller.mirror is None and not transport._mine
    before = tasks()
    with anyio.move_on_after(0.01) as scope:
        async with world.puller(transport) as puller:
            await puller.pull()
            await anyio.sleep_forever()
    assert scope.cancelled_caught and puller.mirror is None and not transport._mine
    assert tasks() == before
    assert (await world.registry.status()).leases == ()


# -- publishers (already async context managers: what they start ends with the block) -------


async def test_a_publisher_leaves_no_task_and_closes_twice_harmlessly(world):
    transport = Progressing(world.transport())
    before = tasks()
    async with Publisher(world.registry, transport, rollout_dtype=None) as pub:
        await pub.publish(1, host_tensors(1))
        await anyio.sleep(0.01)
        assert len(tasks() - before) == 1  # serving the transport's progress
    assert transport.stopped and tasks() == before
    await pub.aclose()
    with anyio.move_on_after(0.01) as scope:
        async with Publisher(world.registry, transport, rollout_dtype=None):
            await anyio.sleep_forever()
    assert scope.cancelled_caught and tasks() == before


# -- the served registry -------------------------------------------------------------------

SECRET = b"lifecycle-secret"


def ZmqRegistry(*args, **kw):
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.client import ZmqRegistry

    return ZmqRegistry(*args, **kw)


@asynccontextmanager
async def served():
    """A `RegistryServer` on a loopback port in this process, and its address."""
    pytest.importorskip("zmq")
    from weightpull.drivers.zmq_registry.server import RegistryServer

    server = RegistryServer("tcp://127.0.0.1:0", secret=SECRET)
    async with anyio.create_task_group() as tg:
        yield server, await tg.start(server.serve)
        tg.cancel_scope.cancel()


def heartbeats() -> list[asyncio.Task]:
    """A served client's heartbeats: tasks of a group (named by anyio) or of the loop."""
    name = "ZmqRegistry._heartbeat"
    return [t for t in tasks() if t.get_name().endswith(name) or t.get_coro().__qualname__ == name]


async def publish_one(reg: Registry, version: int = 1) -> None:
    slot = version % 2
    await reg.begin(version, publisher="p", slot=slot)
    await reg.commit(Manifest(version, plan_layout([TensorSpec("w", "uint8", (8,))]), "fake", b"{}", slot, "p"))


async def test_async_with_connect_registry_owns_the_heartbeat(monkeypatch):
    monkeypatch.delenv("WEIGHTPULL_REGISTRY", raising=False)
    async with served() as (server, address):
        before = tasks()
        async with connect_registry(address, secret=SECRET, heartbeat=0.01) as reg:
            assert type(reg).__name__ == "ZmqRegistry" and isinstance(reg, Registry)
            await publish_one(reg)
            answered = server.served
            await anyio.sleep(0.1)
            assert server.served > answered  # it beats unprompted
            assert len(heartbeats()) == 1
        assert heartbeats() == [] and tasks() == before  # ended with the block, not later
        assert reg._beat is None and not reg._idle  # sockets closed too
        await reg.aclose()  # twice: harmless
        assert (await reg.newest()).version == 1  # a later call connects afresh
        await reg.aclose()
        assert not await settled(before)


async def test_the_served_client_lets_the_blocks_error_through_unwrapped_and_stops():
    async with served() as (_, address):
        before = tasks()
        with pytest.raises(Boom):
            async with ZmqRegistry(address, secret=SECRET, heartbeat=0.01) as reg:
                await publish_one(reg)
                raise Boom
        assert heartbeats() == [] and tasks() == before


async def test_the_served_client_exits_cleanly_when_the_block_is_cancelled():
    async with served() as (_, address):
        before = tasks()
        with anyio.move_on_after(0.1) as scope:
            async with ZmqRegistry(address, secret=SECRET, heartbeat=0.01) as reg:
                await publish_one(reg)
                await anyio.sleep_forever()
        assert scope.cancelled_caught
        assert heartbeats() == [] and tasks() == before and reg._beat is None


async def test_without_async_with_the_heartbeat_stays_a_task_that_aclose_stops():
    async with served() as (_, address):
        before = tasks()
        reg = ZmqRegistry(address, secret=SECRET, heartbeat=0.01)
        await publish_one(reg)
        assert len(heartbeats()) == 1  # as it always was: a task of the loop
        await reg.aclose()
        assert not await settled(before)
        await reg.aclose()  # twice: harmless
        await publish_one(reg, 2)  # and after close, the next publish beats again
        assert len(heartbeats()) == 1
        await reg.aclose()
        assert not await settled(before)


async def test_a_heartbeat_begun_before_the_block_is_the_blocks_from_then_on():
    async with served() as (_, address):
        before = tasks()
        reg = ZmqRegistry(address, secret=SECRET, heartbeat=0.01)
        await publish_one(reg)
        loose = heartbeats()
        async with reg:
            await anyio.sleep(0.03)
            assert loose[0].done() and len(heartbeats()) == 1
        assert not await settled(before)


async def test_a_served_client_is_entered_once_at_a_time():
    async with served() as (_, address):
        async with ZmqRegistry(address, secret=SECRET) as reg:
            with pytest.raises(InvalidArgumentError, match="already in use"):
                async with reg:
                    pass
