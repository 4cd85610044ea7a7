"""What the driver conformance suite needs of each driver (its `Kit`): a local endpoint, a
peer that registers and exports memory (in a process of its own wherever the driver
crosses processes), a way to ask the driver's library whether it still holds a region,
and a way to widen a descriptor past what was registered.

The built-in drivers' kits are in `KITS`. A third-party driver gets one by `kit_for(name)`:
from the entry-point group `weightpull.conformance_kits` (a callable returning a `Kit`,
under the driver's name) if its package offers one, else a generic kit (a peer in a
process of its own, through `create_transport(name)`), whose tests that need `holds` or
`widen` are skipped, saying so.
"""

from __future__ import annotations

import json
import multiprocessing
import random
from collections.abc import Callable
from typing import Any, Protocol

import anyio
import attrs

from weightpull import Transport, create_transport
from weightpull.drivers.fake import FakeFabric, FakeTransport
from weightpull.transport import Region

KIT_ENTRY_POINT_GROUP = "weightpull.conformance_kits"


def pattern(nbytes: int, seed: int) -> bytes:
    """The bytes a peer's region holds: distinct for every seed and every offset."""
    return random.Random(seed).randbytes(nbytes)


class Peer(Protocol):
    async def alloc(self, nbytes: int, seed: int) -> bytes:
        """Register `nbytes` holding `pattern(nbytes, seed)`; return their descriptor."""

    async def fill(self, descriptor: bytes, seed: int) -> None:
        """Rewrite a region `alloc` made with `pattern(len, seed)`."""

    async def exit(self) -> None:
        """Close the peer's transport and, for a process, end the process."""


def _write(region: Region, data: bytes) -> None:
    if region.view is not None:
        region.host_view()[:] = data
        return
    import torch  # a GPU region

    region.memory.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    torch.cuda.synchronize()


class InProcessPeer:
    def __init__(self, transport: Transport, device: str = "cpu") -> None:
        self.transport = transport
        self.device = device  # where its regions live
        self.regions: dict[bytes, Region] = {}

    async def alloc(self, nbytes: int, seed: int) -> bytes:
        region = self.transport.allocate(nbytes, self.device)
        _write(region, pattern(nbytes, seed))
        descriptor = self.transport.export(region)
        self.regions[descriptor] = region
        return descriptor

    async def fill(self, descriptor: bytes, seed: int) -> None:
        region = self.regions[descriptor]
        _write(region, pattern(region.nbytes, seed))

    async def exit(self) -> None:
        await self.transport.aclose()

    def close(self) -> None:
        pass


async def _peer_loop(conn: Any, driver: str, device: str) -> None:
    transport = create_transport(driver)
    peer = InProcessPeer(transport, device)
    async with anyio.create_task_group() as tg:
        tg.start_soon(transport.serve)  # the owner's progress, as a publisher runs it
        while True:
            command, *args = await anyio.to_thread.run_sync(conn.recv)
            if command == "exit":
                break
            try:
                conn.send(("ok", await getattr(peer, command)(*args)))
            except Exception as exc:  # report it; the test decides
                conn.send(("error", repr(exc)))
        tg.cancel_scope.cancel()
    await transport.aclose()
    conn.send(("ok", None))


def peer_main(conn: Any, driver: str, device: str = "cpu") -> None:
    anyio.run(_peer_loop, conn, driver, device)


class ProcessPeer:
    """A peer in a process of its own, driven over a pipe; it runs `serve()` throughout."""

    def __init__(self, driver: str, device: str = "cpu") -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=peer_main, args=(child, driver, device), daemon=True)
        self.process.start()
        child.close()

    def _call(self, *command: Any) -> Any:
        self.conn.send(command)
        if not self.conn.poll(60):
            raise TimeoutError(f"peer process did not answer {command[0]!r}")
        status, value = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"peer process failed {command[0]!r}: {value}")
        return value

    async def alloc(self, nbytes: int, seed: int) -> bytes:
        return await anyio.to_thread.run_sync(self._call, "alloc", nbytes, seed)

    async def fill(self, descriptor: bytes, seed: int) -> None:
        await anyio.to_thread.run_sync(self._call, "fill", descriptor, seed)

    async def exit(self) -> None:
        await anyio.to_thread.run_sync(self._call, "exit")
        await anyio.to_thread.run_sync(self.process.join, 30)
        assert self.process.exitcode == 0, f"peer process exited with {self.process.exitcode}"

    def close(self) -> None:
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


def _widen(length_key: str) -> Callable[[bytes, int], bytes]:
    """A descriptor claiming `extra` bytes past what was registered (both drivers' are JSON)."""

    def widen(descriptor: bytes, extra: int) -> bytes:
        d = json.loads(descriptor)
        d[length_key] += extra
        return json.dumps(d).encode()

    return widen


def _nixl_holds(transport: Any, region: Region) -> bool:
    """Ask NIXL itself: preparing a list over the region fails once it is deregistered."""
    reg = region.handle
    try:
        handle = transport.agent.prep_xfer_dlist("", [(reg.addr, region.nbytes, reg.dev)], reg.mem)
    except Exception as exc:
        if type(exc).__name__ == "nixlNotFoundError":
            return False
        raise
    handle.release()
    return True


@attrs.define
class Kit:
    name: str
    new_transport: Callable[[], Transport]
    new_peer: Callable[[], InProcessPeer | ProcessPeer]
    holds: Callable[[Any, Region], bool] | None = None  # the driver's library still holds the region
    widen: Callable[[bytes, int], bytes] | None = None  # a descriptor claiming more than registered
    shared: Any = None  # a peer the module's tests share

    def shared_peer(self) -> Any:
        if self.shared is None:
            self.shared = self.new_peer()
        return self.shared

    def close(self) -> None:
        if self.shared is not None:
            self.shared.close()


def fake_kit() -> Kit:
    fabric = FakeFabric()
    return Kit(
        "fake",
        lambda: FakeTransport(fabric=fabric),
        lambda: InProcessPeer(FakeTransport(fabric=fabric)),
        lambda t, region: region.handle in t.fabric.regions,
        _widen("nbytes"),
    )


def nixl_kit() -> Kit:
    return Kit(
        "nixl",
        lambda: create_transport("nixl"),
        lambda: ProcessPeer("nixl"),
        _nixl_holds,
        _widen("len"),
    )


def _torch_holds(transport: Any, region: Region) -> bool:
    """Ask torch's nixl backend: a view of a registration it dropped is refused."""
    for memory in region.handle.memories.values():
        try:
            memory.to_view()
            return True
        except RuntimeError:
            pass
    return False


def torch_kit() -> Kit:
    return Kit(
        "torch",
        lambda: create_transport("torch"),
        lambda: ProcessPeer("torch"),
        _torch_holds,
        _widen("nbytes"),
    )


def _cuda_ipc_holds(transport: Any, region: Region) -> bool:
    """Ask CUDA: host memory stays page-locked while registered (the suite reads into host)."""
    from weightpull.drivers.cuda_ipc import cuda

    return cuda().host_pinned(region.handle.pointer)


def cuda_ipc_kit(slots: str = "cuda") -> Kit:
    """The peer exports GPU slots, or with `slots="cpu"` host slots (shared memory)."""
    return Kit(
        "cuda_ipc" if slots == "cuda" else "cuda_ipc_host",
        lambda: create_transport("cuda_ipc"),
        lambda: ProcessPeer("cuda_ipc", device=slots),
        _cuda_ipc_holds,
        _widen("nbytes"),
    )


KITS: dict[str, Callable[[], Kit]] = {
    "fake": fake_kit,
    "nixl": nixl_kit,
    "torch": torch_kit,
    "cuda_ipc": cuda_ipc_kit,
    "cuda_ipc_host": lambda: cuda_ipc_kit("cpu"),
}


def generic_kit(name: str) -> Kit:
    """Any driver `create_transport` knows, its peer in a process of its own."""
    return Kit(name, lambda: create_transport(name), lambda: ProcessPeer(name))


def kit_for(name: str) -> Kit:
    """The kit of a built-in driver, the one a driver's package registers under
    `weightpull.conformance_kits`, or a generic one."""
    if name in KITS:
        return KITS[name]()
    from importlib.metadata import entry_points

    for ep in entry_points(group=KIT_ENTRY_POINT_GROUP):
        if ep.name == name:
            return ep.load()()
    return generic_kit(name)


# The drivers a plain `pytest` runs the suite against. Others need an environment of their
# own (torch: torch >= 2.15) or a GPU (cuda_ipc): WEIGHTPULL_DRIVERS=name,... picks them,
# and a picked driver that cannot run here fails its tests rather than skip them.
DEFAULT_DRIVERS = ("fake", "nixl")
