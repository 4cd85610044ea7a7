"""The `torch` driver: one-sided reads over `torch.distributed._transport` (torch >= 2.15)
and its one backend, nixl.

A torch endpoint has one outgoing peer, so a `TorchTransport` is several endpoints: a home
endpoint that registers and exports this process's memory and never connects, and one
reader endpoint per peer process, connected on first use. One reader endpoint reads every
slot a publisher exports (they share its home endpoint's agent); a sharded version reads
through one endpoint per publisher. Each endpoint registers a local region it reads into
once, on first use.

torch's remote buffer names a whole registration; a read at an offset narrows it to the
span (nixl's descriptor is an address and a length), and NIXL itself refuses a span that
no registration covers. No endpoint runs a progress thread (it spins a core): readers
poll their transfers, and an owner runs `serve()`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import json
import logging
import mmap
from collections.abc import Iterator
from functools import partial
from typing import Any

import anyio
import attrs

from weightpull.errors import (
    InvalidArgumentError,
    PeerGoneError,
    RegionNotRegisteredError,
    TransportError,
    WeightpullError,
)
from weightpull.transport import Region, RegionTable, Remote, Transport, check_span, writable_bytes

log = logging.getLogger(__name__)

BACKEND = "nixl"  # the only backend torch 2.15 ships
_INSTALL = "pip install 'weightpull[torch-transport]' (in an environment of its own)"


def _torch() -> Any:
    import torch

    return torch


def _api() -> Any:
    return importlib.import_module("torch.distributed._transport")


def _remote_buffer_class() -> Any:
    return importlib.import_module(f"torch.distributed._transport.{BACKEND}").NIXLRemoteBuffer


@contextlib.contextmanager
def torch_errors(what: str, peer: _Peer | None = None) -> Iterator[None]:
    """Raise torch's and NIXL's errors as the project's, named after what was being done."""
    try:
        yield
    except WeightpullError:
        raise
    except Exception as exc:
        kind = type(exc).__name__
        if kind == "nixlRemoteDisconnectError":
            if peer is not None:
                peer.gone = True
            raise PeerGoneError(f"{what}: the peer disconnected (its process exited)") from exc
        if kind == "nixlNotFoundError":
            raise RegionNotRegisteredError(f"{what}: NIXL holds no registration covering it") from exc
        if "unregistered" in str(exc):
            raise RegionNotRegisteredError(f"{what}: {exc}") from exc
        if kind.startswith("nixl") or isinstance(exc, (RuntimeError, TimeoutError)):
            raise TransportError(f"{what}: {kind} ({exc})") from exc
        if isinstance(exc, (ValueError, TypeError)):
            raise InvalidArgumentError(f"{what}: {exc}") from exc
        raise


@attrs.define(eq=False)
class _Registration:
    """`Region.handle`: the region as one flat uint8 tensor, and its registration with
    each endpoint that used it."""

    tensor: Any  # None for an empty region, which torch cannot register
    memories: dict[Any, Any] = attrs.Factory(dict)  # endpoint -> torch Memory


@attrs.define(eq=False)
class _Peer:
    """A reader endpoint, connected to one peer process's home endpoint."""

    agent: str
    endpoint: Any
    gone: bool = False


@attrs.define(eq=False)
class _Source:
    """`Remote.handle`: a peer's remote buffer, and the endpoint that reads it."""

    buffer: Any  # None for an empty region
    peer: _Peer | None
    connected: bool = True


def _flat(memory: Any, device: str) -> tuple[Any, memoryview | None, str]:
    """(a flat uint8 tensor over `memory`, its host view, its device name)."""
    torch = _torch()
    if isinstance(memory, torch.Tensor):
        if not memory.is_contiguous():
            raise InvalidArgumentError("torch transport needs a contiguous tensor")
        where = str(memory.device)
        if memory.is_cuda:
            if device not in ("cpu", "cuda", where):
                raise InvalidArgumentError(f"the tensor lives on {where}, not {device!r}")
        elif memory.device.type != "cpu" or device != "cpu":
            raise InvalidArgumentError(f"torch transport registers host or CUDA tensors, not {where} as {device!r}")
        flat = memory.detach().reshape(-1).view(torch.uint8)
        view = memoryview(flat.numpy()) if where == "cpu" and flat.numel() else None
        return flat, view, where
    if device != "cpu":
        raise InvalidArgumentError(f"torch transport registers {device!r} memory as a torch tensor only")
    view = writable_bytes("torch", memory)
    flat = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
    return flat, view, "cpu"


class TorchTransport(RegionTable, Transport):
    """The `torch` driver: `torch.distributed._transport` (torch >= 2.15) over its nixl
    backend, host and CUDA memory. Needs the `torch-transport` extra;
    `unavailable_reason` says what is missing."""

    name = "torch"

    def __init__(self, *, timeout: float = 60.0, progress_interval: float = 0.001) -> None:
        """Make an endpoint; torch's endpoints are made on first use.

        Args:
            timeout: Seconds that bound torch's own waits (its lock, a transfer).
            progress_interval: Seconds between `serve()`'s polls of the home endpoint.
        """
        self.timeout = timeout
        self.progress_interval = progress_interval
        self._home: Any = None
        self._peers: dict[str, _Peer] = {}  # agent name -> reader endpoint
        self._regions: dict[_Registration, Region] = {}
        self._limiter: anyio.CapacityLimiter | None = None
        self._closed = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            torch = _torch()
        except ImportError as exc:
            return f"torch is not installed ({exc}); {_INSTALL}"
        try:
            api = _api()
        except ImportError:
            return f"torch {torch.__version__} has no torch.distributed._transport (it first ships in torch 2.15); {_INSTALL}"
        if BACKEND not in api.available_transports():
            return f"torch {torch.__version__} offers no {BACKEND!r} transport backend"
        backend = importlib.import_module(f"torch.distributed._transport.{BACKEND}").NIXLTransport
        if not backend.supported():
            return "torch's nixl backend cannot import the `nixl` package; " + _INSTALL
        return None

    def _endpoint(self) -> Any:
        with torch_errors("creating a torch.distributed._transport endpoint"):
            return _api().new_transport(BACKEND, enable_prog_thread=False, timeout=self.timeout)

    @property
    def home(self) -> Any:
        """The endpoint that registers and exports this process's memory (made on first use)."""
        if self._home is None:
            self._check_open()
            self._home = self._endpoint()
        return self._home

    # -- registration ---------------------------------------------------------------------

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        if device == "cpu":
            return self.register(mmap.mmap(-1, nbytes) if nbytes else bytearray())
        if device == "cuda" or device.startswith("cuda:"):
            torch = _torch()
            return self.register(torch.empty(nbytes, dtype=torch.uint8, device=device), device)
        raise InvalidArgumentError(f"torch transport cannot allocate on {device!r} (cpu or cuda[:N])")

    def register(self, memory: Any, device: str = "cpu") -> Region:
        """Registration with torch happens once per endpoint, on first export or read."""
        self._check_open()
        flat, view, where = _flat(memory, device)
        reg = _Registration(flat if flat.numel() else None)
        region = Region(nbytes=flat.numel(), device=where, memory=memory, view=view, handle=reg)
        self._regions[reg] = region
        return region

    def _memory(self, region: Region, endpoint: Any) -> Any:
        """`region`'s registration with `endpoint`, made once."""
        reg = region.handle
        memory = reg.memories.get(endpoint)
        if memory is None:
            with torch_errors(f"registering {region.nbytes} bytes of {region.device} memory"):
                memory = reg.memories[endpoint] = endpoint.register_memory(reg.tensor)
        return memory

    def deregister(self, region: Region) -> None:
        reg = region.handle
        if self._regions.pop(reg, None) is None:
            return
        memories, reg.memories = reg.memories, {}
        failed = None
        for endpoint, memory in memories.items():
            try:
                with torch_errors(f"deregistering {region.nbytes} bytes of {region.device} memory"):
                    endpoint.unregister_memory(memory)
            except TransportError as exc:  # e.g. a gone peer's stuck read holds it; go on
                failed = failed or exc
        if failed is not None:
            raise failed

    def export(self, region: Region) -> bytes:
        reg = self._mine(region, "export")
        buffer = None
        if reg.tensor is not None:
            with torch_errors("exporting a remote buffer"):
                buffer = self._memory(region, self.home).to_remote_buffer().serialize().decode()
        return json.dumps({"torch_transport": BACKEND, "buffer": buffer, "nbytes": region.nbytes}).encode()

    def connect(self, descriptor: bytes) -> Remote:
        self._check_open()
        try:
            d = json.loads(descriptor)
            if d["torch_transport"] != BACKEND:
                raise ValueError(f"backend {d['torch_transport']!r}")
            nbytes = int(d["nbytes"])
            buffer = None if d["buffer"] is None else _remote_buffer_class().deserialize(d["buffer"].encode())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"not a torch-transport descriptor ({exc}): {bytes(descriptor[:80])!r}") from exc
        return Remote(nbytes, descriptor, handle=_Source(buffer, None if buffer is None else self._peer(buffer)))

    def _peer(self, buffer: Any) -> _Peer:
        """The reader endpoint for the process that exported `buffer`, connected once."""
        peer = self._peers.get(buffer.agent_name)
        if peer is None:
            endpoint = self._endpoint()
            with torch_errors(f"connecting to agent {buffer.agent_name}"):
                endpoint.connect(buffer.metadata)  # its partial metadata carries the address
            peer = self._peers[buffer.agent_name] = _Peer(buffer.agent_name, endpoint)
        if peer.gone:
            raise PeerGoneError(f"agent {peer.agent} has disconnected")
        return peer

    def disconnect(self, remote: Remote) -> None:
        if isinstance(remote.handle, _Source):
            remote.handle.connected = False  # the endpoint stays: other slots of that peer use it

    # -- reading -------------------------------------------------------------------------

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        self._check_open()
        source = remote.handle
        if not isinstance(source, _Source) or not source.connected:
            raise InvalidArgumentError("that remote was not connected by this torch transport, or was disconnected")
        self._mine(local, "read into")
        check_span("remote", remote_offset, nbytes, remote.nbytes)
        check_span("local", local_offset, nbytes, local.nbytes)
        peer = source.peer
        what = f"reading [{remote_offset}, {remote_offset + nbytes}) of agent {peer.agent if peer else '-'}"
        if peer is not None and peer.gone:
            raise PeerGoneError(f"{what}: the agent has disconnected")
        if not nbytes or peer is None:
            return
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(1)  # the endpoint's lock serializes posts anyway
        with torch_errors(what, peer):
            view = self._memory(local, peer.endpoint).to_mutable_view(local_offset, nbytes)
            span = dataclasses.replace(source.buffer, address=source.buffer.address + remote_offset, length=nbytes)
            # Off the event loop: over CMA the post is the copy itself.
            post = partial(peer.endpoint.read, view, span, async_op=True)
            work = await anyio.to_thread.run_sync(post, limiter=self._limiter)
            await self._wait(work)

    @staticmethod
    async def _wait(work: Any) -> None:
        delay = 0.0
        while not work.is_completed():
            # torch 2.15 keeps a Work whose post failed pending for good (it cannot know the
            # DMA stopped); its error is recorded at once, so raise it rather than hang.
            failed = getattr(work, "_error", None)
            if failed is not None:
                raise failed
            await anyio.sleep(delay)
            delay = min(0.001, delay * 2 or 0.00005)
        failed = work.exception()
        if failed is not None:
            raise failed

    # -- progress and lifetime ---------------------------------------------------------------

    async def serve(self) -> None:
        """Poll the home endpoint's agent, so that peers' reads of our memory complete (the
        first one needs UCX's wire-up answered). torch has no public call for it."""
        while True:
            agent = getattr(self._home, "_agent", None)
            if agent is not None and not self._closed:
                with torch_errors("making progress"):
                    agent.get_new_notifs()
            await anyio.sleep(self.progress_interval)

    async def aclose(self) -> None:
        if self._closed:
            return
        for region in list(self._regions.values()):
            with contextlib.suppress(TransportError):  # one a gone peer's stuck read holds
                self.deregister(region)
        for peer in self._peers.values():
            with contextlib.suppress(Exception):
                # A gone peer's endpoint holds a Work torch never completes: it cannot close
                # and is left to the process's exit.
                peer.endpoint.close(timeout=0.1 if peer.gone else self.timeout)
        if self._home is not None:
            with torch_errors("closing the home endpoint"):
                self._home.close(timeout=self.timeout)
        self._peers.clear()
        self._closed = True
