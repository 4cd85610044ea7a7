"""The `nixl` driver: one-sided reads over NIXL's own Python bindings (UCX backend).

One NIXL agent per transport, made on first use (after any CUDA memory the caller made,
so UCX sees a CUDA context), with no progress thread: it spins a whole core. A peer's
first read needs the owner's agent to answer UCX's wire-up, and reads of GPU memory over
UCX's tcp emulation need it throughout, so an owner runs `serve()`, which polls its agent
(a `Publisher` used as a context manager runs it itself).

A descriptor is JSON: the agent's metadata for the one region and its `(addr, len, dev)`,
never a pickled NIXL list (those are tied to the cu12 or cu13 build). Each transfer is
prepared once per (remote, local, span) and reposted on every later read of that span.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import importlib
import json
import logging
import mmap
import os
import sys
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

import anyio
import attrs

from weightpull.errors import (
    DriverUnavailableError,
    InvalidArgumentError,
    PeerGoneError,
    RegionNotRegisteredError,
    TransportError,
    WeightpullError,
)
from weightpull.tasks import each_at_once
from weightpull.transport import (
    Read2D,
    Region,
    RegionTable,
    Remote,
    Transport,
    address_of,
    check_2d,
    check_span,
    span_2d,
    writable_bytes,
)

log = logging.getLogger(__name__)

# `nixl` is the meta package (it holds both builds); the others are the builds themselves.
API_MODULES = ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
_MAX_XFERS = 4096  # prepared transfers kept; a model has a few hundred buckets at most
_STALL_WARNING_S = 10.0
_api: Any = None


def nixl_api() -> Any:
    """NIXL's `_api` module, from whichever build is installed."""
    global _api
    if _api is None:
        # Both log to stdout by default, which would break `--json` (its last line).
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        os.environ.setdefault("UCX_LOG_FILE", "stderr")
        failures = []
        for name in API_MODULES:
            try:
                _api = importlib.import_module(name)
                break
            except (ImportError, OSError) as exc:  # OSError: a shared library failed to load
                failures.append(f"{name}: {exc}")
        else:
            raise DriverUnavailableError(
                "NIXL's Python bindings cannot load (" + "; ".join(failures) + "); "
                "install them with: pip install 'weightpull[nixl]'"
            )
    return _api


@contextlib.contextmanager
def nixl_errors(what: str) -> Iterator[None]:
    """Raise NIXL's errors as the project's, named after what was being done."""
    try:
        yield
    except WeightpullError:
        raise
    except Exception as exc:
        kind = type(exc).__name__
        if kind == "nixlRemoteDisconnectError":
            raise PeerGoneError(f"{what}: the peer's NIXL agent disconnected (its process exited)") from exc
        if kind == "nixlNotFoundError":
            raise RegionNotRegisteredError(f"{what}: NIXL holds no registration covering it") from exc
        if kind.startswith("nixl"):
            raise TransportError(f"{what}: {kind} ({exc})") from exc
        raise


@attrs.define(eq=False)
class _Registration:
    """`Region.handle` of this driver: where the memory is, and NIXL's list to deregister."""

    addr: int
    dev: int
    mem: str  # "DRAM" or "VRAM"
    descs: Any  # NIXL's nixlRegDList; None for an empty region, which NIXL cannot register


@attrs.define(eq=False)
class _Peer:
    """`Remote.handle` of this driver: a peer agent's region."""

    agent: str
    addr: int
    dev: int
    mem: str
    connected: bool = True


@attrs.define(eq=False)
class _Xfer:
    handle: Any
    busy: bool = False


def _torch() -> Any:
    try:
        import torch
    except ImportError as exc:
        raise InvalidArgumentError(
            f"pinned or GPU memory needs torch: pip install 'weightpull[torch]' ({exc})"
        ) from exc
    return torch


def _describe(memory: Any, device: str) -> tuple[int, int, int, str, str, memoryview | None]:
    """(addr, nbytes, dev, mem, device name, host view) of a torch tensor or a host buffer."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(memory, torch.Tensor):
        if not memory.is_contiguous():
            raise InvalidArgumentError("nixl transport needs a contiguous tensor")
        nbytes = memory.numel() * memory.element_size()
        addr = memory.data_ptr()
        if memory.is_cuda:
            index = memory.device.index if memory.device.index is not None else torch.cuda.current_device()
            if device not in ("cpu", "cuda", f"cuda:{index}"):
                raise InvalidArgumentError(f"the tensor lives on cuda:{index}, not {device!r}")
            return addr, nbytes, index, "VRAM", f"cuda:{index}", None
        if memory.device.type != "cpu" or device != "cpu":
            raise InvalidArgumentError(
                f"nixl transport registers host or CUDA tensors, not {memory.device} as {device!r}"
            )
        view = memoryview((ctypes.c_char * nbytes).from_address(addr)).cast("B") if nbytes else memoryview(bytearray())
        return addr, nbytes, 0, "DRAM", "cpu", view
    if device != "cpu":
        raise InvalidArgumentError(f"nixl transport registers {device!r} memory as a torch tensor only")
    view = writable_bytes("nixl", memory)
    return address_of(view), view.nbytes, 0, "DRAM", "cpu", view


class NixlTransport(RegionTable, Transport):
    """The `nixl` driver: NIXL over UCX, between processes and hosts (TCP, RDMA, shared
    memory, whatever UCX finds), host memory and, where UCX has a GPU path, CUDA memory.
    Made by `create_transport("nixl", ...)` with the same keyword arguments. Needs the
    `nixl` extra.

    Raises:
        InvalidArgumentError: `threads` is not a positive int.
    """

    name = "nixl"
    native_2d = True

    def __init__(
        self,
        *,
        agent_name: str | None = None,
        pinned: bool = False,
        threads: int = 1,
        progress_interval: float = 0.001,
    ) -> None:
        """Make an endpoint; its NIXL agent is made on first use.

        Args:
            agent_name: The agent's name, unique among its peers (default: one made of the
                process id and a random part).
            pinned: Allocate host memory page-locked (through torch), for fast copies to a
                GPU afterwards.
            threads: Post that many transfers at once, each on its own UCX worker (it did
                not pay on the machines measured; see docs/guides/transports.md).
            progress_interval: Seconds between `serve()`'s polls of the agent.
        """
        if not isinstance(threads, int) or threads < 1:
            raise InvalidArgumentError(f"threads must be a positive int, got {threads!r}")
        self.agent_name = agent_name or f"weightpull-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.pinned = pinned
        self.threads = threads
        self.progress_interval = progress_interval
        self._agent: Any = None
        self._limiter: anyio.CapacityLimiter | None = None
        self._regions: dict[_Registration, Region] = {}
        self._peers: dict[str, int] = {}  # agent -> connected remotes
        self._gone: set[str] = set()  # agents seen disconnected
        self._xfers: OrderedDict[tuple[Any, ...], _Xfer] = OrderedDict()
        self._closed = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            nixl_api()
        except DriverUnavailableError as exc:
            return str(exc)
        return None

    @property
    def agent(self) -> Any:
        """The NIXL agent, made on first use (about 0.4 s)."""
        if self._agent is None:
            self._check_open()
            api = nixl_api()
            sync = api.nixl_thread_sync_t
            # STRICT: the event loop and the transfer thread share the agent.
            mode = sync.NIXL_THREAD_SYNC_RW if self.threads > 1 else sync.NIXL_THREAD_SYNC_STRICT
            config = api.nixl_agent_config(enable_prog_thread=False, backends=[], sync_mode=mode)
            try:
                agent = api.nixl_agent(self.agent_name, config)
                agent.create_backend("UCX", {"num_workers": str(self.threads)})
            except Exception as exc:
                raise TransportError(f"cannot create a NIXL agent with the UCX backend: {exc!r}") from exc
            self._agent = agent
        return self._agent

    # -- registration ---------------------------------------------------------------------

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        if device != "cpu" and device != "cuda" and not device.startswith("cuda:"):
            raise InvalidArgumentError(f"nixl transport cannot allocate on {device!r} (cpu or cuda[:N])")
        if device == "cpu" and not self.pinned:
            return self.register(mmap.mmap(-1, nbytes) if nbytes else bytearray())
        torch = _torch()
        if device == "cpu":
            return self.register(torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
        return self.register(torch.empty(nbytes, dtype=torch.uint8, device=device), device)

    def register(self, memory: Any, device: str = "cpu") -> Region:
        self._check_open()
        addr, nbytes, dev, mem, where, view = _describe(memory, device)
        descs = None
        if nbytes:
            with nixl_errors(f"registering {nbytes} bytes of {where} memory"):
                descs = self.agent.register_memory([(addr, nbytes, dev, "")], mem)
        reg = _Registration(addr, dev, mem, descs)
        region = Region(nbytes=nbytes, device=where, memory=memory, view=view, handle=reg)
        self._regions[reg] = region
        return region

    def deregister(self, region: Region) -> None:
        reg = region.handle
        if self._regions.pop(reg, None) is None:
            return
        self._drop_xfers(lambda key: key[1] is reg)
        if reg.descs is not None:
            with nixl_errors(f"deregistering {region.nbytes} bytes of {region.device} memory"):
                self.agent.deregister_memory(reg.descs)

    def export(self, region: Region) -> bytes:
        reg = self._mine(region, "export")
        with nixl_errors("exporting the agent's metadata"):
            if reg.descs is None:
                md = self.agent.get_agent_metadata()
            else:  # this region's keys and the agent's connection info, not every region's
                md = self.agent.get_partial_agent_metadata(reg.descs, True, ["UCX"])
        return json.dumps(
            {
                "nixl_agent": self.agent_name,
                "md": base64.b64encode(md).decode(),
                "addr": reg.addr,
                "len": region.nbytes,
                "dev": reg.dev,
                "mem": reg.mem,
            }
        ).encode()

    def connect(self, descriptor: bytes) -> Remote:
        self._check_open()
        try:
            d = json.loads(descriptor)
            peer = _Peer(str(d["nixl_agent"]), int(d["addr"]), int(d["dev"]), str(d["mem"]))
            nbytes, md = int(d["len"]), base64.b64decode(d["md"], validate=True)
            if peer.mem not in ("DRAM", "VRAM"):
                raise ValueError(f"memory type {peer.mem!r}")
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgumentError(f"not a nixl descriptor ({exc}): {bytes(descriptor[:80])!r}") from exc
        if peer.agent in self._gone:
            raise PeerGoneError(f"NIXL agent {peer.agent} has disconnected")
        if peer.agent != self.agent_name:  # our own regions are read by loopback
            with nixl_errors(f"loading the metadata of NIXL agent {peer.agent}"):
                self.agent.add_remote_agent(md)
        self._peers[peer.agent] = self._peers.get(peer.agent, 0) + 1
        return Remote(nbytes, descriptor, handle=peer)

    def disconnect(self, remote: Remote) -> None:
        peer = remote.handle
        if not isinstance(peer, _Peer) or not peer.connected:
            return
        peer.connected = False
        self._drop_xfers(lambda key: key[0] is peer)
        left = self._peers.pop(peer.agent, 1) - 1
        if left:
            self._peers[peer.agent] = left
        elif peer.agent != self.agent_name and peer.agent not in self._gone and self._agent is not None:
            with contextlib.suppress(Exception):  # it may have exited already
                self._agent.remove_remote_agent(peer.agent)

    # -- reading -------------------------------------------------------------------------

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        self._check_open()
        peer = remote.handle
        if not isinstance(peer, _Peer) or not peer.connected:
            raise InvalidArgumentError("that remote was not connected by this nixl transport, or was disconnected")
        reg = self._mine(local, "read into")
        check_span("remote", remote_offset, nbytes, remote.nbytes)
        check_span("local", local_offset, nbytes, local.nbytes)
        what = f"reading [{remote_offset}, {remote_offset + nbytes}) of NIXL agent {peer.agent}"
        if peer.agent in self._gone:
            raise PeerGoneError(f"{what}: the agent has disconnected")
        if not nbytes:
            return
        await self._post(peer, reg, (remote_offset, 0, local_offset, 0, nbytes, 1), what)

    async def read_2d_many(self, reads: Sequence[Read2D]) -> None:
        """Each 2-D read as one NIXL request whose descriptor lists hold a row each."""
        posts = []
        for read in reads:
            check_2d(read)
            remote, r_off, r_pitch, local, l_off, l_pitch, width, height = read
            self._check_open()
            peer = remote.handle
            if not isinstance(peer, _Peer) or not peer.connected:
                raise InvalidArgumentError("that remote was not connected by this nixl transport, or was disconnected")
            reg = self._mine(local, "read into")
            check_span("remote", *span_2d(r_off, r_pitch, width, height), remote.nbytes)
            check_span("local", *span_2d(l_off, l_pitch, width, height), local.nbytes)
            what = f"reading {height} rows of {width} bytes from {r_off} of NIXL agent {peer.agent}"
            if peer.agent in self._gone:
                raise PeerGoneError(f"{what}: the agent has disconnected")
            if width and height:
                posts.append((peer, reg, (r_off, r_pitch, l_off, l_pitch, width, height), what))
        await each_at_once(lambda post: self._post(*post), posts)

    async def _post(
        self, peer: _Peer, reg: _Registration, rows: tuple[int, int, int, int, int, int], what: str
    ) -> None:
        """Make one request of `rows` (remote offset, pitch, local offset, pitch, width,
        height), reusing a transfer prepared for the same spans."""
        key = (peer, reg, *rows)
        xfer = self._xfers.get(key)
        one_off = xfer is not None and xfer.busy  # a concurrent read of the same span
        if xfer is None or one_off:
            xfer = _Xfer(self._prepare(peer, reg, rows, what))
            if not one_off:
                self._xfers[key] = xfer
                while len(self._xfers) > _MAX_XFERS:
                    self._release(self._xfers.popitem(last=False)[1])
        else:
            self._xfers.move_to_end(key)
        xfer.busy = True
        try:
            await self._transfer(xfer, peer, what)
        except BaseException:
            # Failed or cancelled mid-flight: the request may still be active; never repost it.
            if self._xfers.get(key) is xfer:
                del self._xfers[key]
            self._release(xfer)
            raise
        xfer.busy = False
        if one_off:
            self._release(xfer)

    def _prepare(self, peer: _Peer, reg: _Registration, rows: tuple[int, int, int, int, int, int], what: str) -> Any:
        agent = self.agent
        r_off, r_pitch, l_off, l_pitch, width, height = rows
        with nixl_errors(what):
            local = agent.get_xfer_descs(
                [(reg.addr + l_off + i * l_pitch, width, reg.dev) for i in range(height)], reg.mem
            )
            remote = agent.get_xfer_descs(
                [(peer.addr + r_off + i * r_pitch, width, peer.dev) for i in range(height)], peer.mem
            )
            return agent.initialize_xfer("READ", local, remote, peer.agent)

    async def _transfer(self, xfer: _Xfer, peer: _Peer, what: str) -> None:
        agent = self.agent
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.threads)
        started = time.monotonic()
        warned = False
        try:
            with nixl_errors(what):
                # Off the event loop: over CMA the post is the copy itself (NIXL drops the GIL).
                state = await anyio.to_thread.run_sync(agent.transfer, xfer.handle, limiter=self._limiter)
                delay = 0.0
                while state == "PROC":
                    await anyio.sleep(delay)
                    delay = min(0.001, delay * 2 or 0.00005)
                    state = agent.check_xfer_state(xfer.handle)
                    if not warned and time.monotonic() - started > _STALL_WARNING_S:
                        warned = True
                        log.warning(
                            "%s: still in progress after %.0f s; is the owner serving its progress "
                            "(`async with Publisher(...)`, or `publisher.serve()`)?",
                            what,
                            _STALL_WARNING_S,
                        )
        except PeerGoneError:
            self._gone.add(peer.agent)
            self._release(xfer)
            with contextlib.suppress(Exception):  # closes the endpoint and its requests
                agent.remove_remote_agent(peer.agent)
            raise
        if state != "DONE":
            raise TransportError(f"{what}: NIXL reported the transfer as {state}")

    def _release(self, xfer: _Xfer) -> None:
        with contextlib.suppress(Exception):  # an active request NIXL cannot abort: it logs it
            xfer.handle.release()

    def _drop_xfers(self, match: Any) -> None:
        for key in [k for k in self._xfers if match(k)]:
            self._release(self._xfers.pop(key))

    # -- progress and lifetime ---------------------------------------------------------------

    async def serve(self) -> None:
        """Poll the agent, so that peers' reads of our memory complete: their first one
        (UCX's wire-up) and every read of GPU memory over tcp."""
        while True:
            if self._agent is not None and not self._closed:
                with nixl_errors("making progress"):
                    self._agent.get_new_notifs()
            await anyio.sleep(self.progress_interval)

    async def aclose(self) -> None:
        """Release every prepared transfer, registration and peer. The agent itself goes
        with the transport object."""
        if self._closed:
            return
        self._drop_xfers(lambda key: True)
        for region in list(self._regions.values()):
            self.deregister(region)
        for agent in list(self._peers):
            if agent != self.agent_name and agent not in self._gone and self._agent is not None:
                with contextlib.suppress(Exception):
                    self._agent.remove_remote_agent(agent)
        self._peers.clear()
        self._closed = True
