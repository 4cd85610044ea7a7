"""The `cuda_ipc` driver: the same-host GPU fast path, over CUDA's driver API (ctypes).

A GPU slot is a plain device allocation (`cuMemAlloc`; CUDA IPC cannot export the caching
allocator's expandable segments), exported once as a CUDA IPC handle. A reader process
opens each handle once, per GPU it reads into, and reads with device copies on a stream
of its own; every read awaits the event recorded after its copy, so all bytes have landed
before the puller checks its lease. A reader on another GPU of the host maps the handle
with peer access and copies peer-to-peer. Host regions (a reader's host mirror) are
page-locked on registration and read into by device-to-host copies.

CUDA keeps a handle mapped in a reader whatever its owner does, so the owner's liveness
travels beside it: a small file per exported region (in /dev/shm) on which the owner holds
an exclusive lock while the region is exported, with a byte saying why it let go. A read
checks it first: deregistered -> `RegionNotRegisteredError`; closed or died -> `PeerGoneError`.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import json
import mmap
import os
import struct
import tempfile
import time
import uuid
import weakref
from collections import deque
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
)
from weightpull.transport import Region, RegionTable, Remote, Transport, check_span

_LAZY_ENABLE_PEER_ACCESS = 0x1
_STREAM_NON_BLOCKING = 0x1
_EVENT_DISABLE_TIMING = 0x2
_HOSTREGISTER_PORTABLE = 0x1
_POINTER_MEMORY_TYPE = 2
_MEMORYTYPE_HOST = 1
_NOT_READY = 600
_ALREADY_REGISTERED = 712
_SPIN_S = 0.002
_FILE_PREFIX = "weightpull-cuda-ipc-"
_RECORD = struct.Struct("<c7xQ")  # state, exported bytes
_EXPORTED, _DEREGISTERED, _CLOSED = b"A", b"D", b"C"


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Cuda:
    """The few CUDA driver calls this driver makes, on each device's primary context
    (the one torch uses, so pointers pass freely between them)."""

    def __init__(self) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DriverUnavailableError(f"the CUDA driver library libcuda.so.1 cannot load: {exc}") from exc
        u64, ptr, size = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t
        signatures: dict[str, list[Any]] = {
            "cuInit": [ctypes.c_uint],
            "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
            "cuDeviceGet": [ctypes.POINTER(ctypes.c_int), ctypes.c_int],
            "cuDevicePrimaryCtxRetain": [ctypes.POINTER(ptr), ctypes.c_int],
            "cuCtxPushCurrent_v2": [ptr],
            "cuCtxPopCurrent_v2": [ctypes.POINTER(ptr)],
            "cuMemAlloc_v2": [ctypes.POINTER(u64), size],
            "cuMemFree_v2": [u64],
            "cuMemGetAddressRange_v2": [ctypes.POINTER(u64), ctypes.POINTER(size), u64],
            "cuIpcGetMemHandle": [ctypes.POINTER(_Handle), u64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), _Handle, ctypes.c_uint],
            "cuIpcCloseMemHandle": [u64],
            "cuMemHostRegister_v2": [ptr, size, ctypes.c_uint],
            "cuMemHostUnregister": [ptr],
            "cuPointerGetAttribute": [ptr, ctypes.c_int, u64],
            "cuMemcpyAsync": [u64, u64, size, ptr],
            "cuStreamCreate": [ctypes.POINTER(ptr), ctypes.c_uint],
            "cuStreamDestroy_v2": [ptr],
            "cuEventCreate": [ctypes.POINTER(ptr), ctypes.c_uint],
            "cuEventRecord": [ptr, ptr],
            "cuEventQuery": [ptr],
            "cuEventDestroy_v2": [ptr],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int
            setattr(self, name, fn)
        self._contexts: dict[int, ctypes.c_void_p] = {}
        self.check(self.cuInit(0), "initializing CUDA")

    def error_name(self, result: int) -> str:
        name = ctypes.c_char_p()
        self.cuGetErrorName(result, ctypes.byref(name))
        return name.value.decode() if name.value else f"CUresult {result}"

    def check(self, result: int, what: str) -> None:
        if result:
            raise TransportError(f"{what}: {self.error_name(result)}")

    @contextlib.contextmanager
    def on(self, device: int) -> Iterator[None]:
        """Make `device`'s primary context current for the calls inside, then restore."""
        ctx = self._contexts.get(device)
        if ctx is None:
            ctx, dev = ctypes.c_void_p(), ctypes.c_int()
            self.check(self.cuDeviceGet(ctypes.byref(dev), device), f"finding cuda:{device}")
            self.check(self.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev.value), f"opening cuda:{device}")
            self._contexts[device] = ctx
        self.check(self.cuCtxPushCurrent_v2(ctx), f"entering cuda:{device}")
        try:
            yield
        finally:
            self.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def address_range(self, pointer: int) -> tuple[int, int] | None:
        """(base, size) of the allocation or mapping holding `pointer`, or None."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), pointer):
            return None
        return base.value, size.value

    def host_pinned(self, pointer: int, device: int = 0) -> bool:
        """Whether CUDA holds `pointer` as page-locked host memory (registered or allocated)."""
        kind = ctypes.c_uint()
        with self.on(device):
            result = self.cuPointerGetAttribute(ctypes.byref(kind), _POINTER_MEMORY_TYPE, pointer)
        return result == 0 and kind.value == _MEMORYTYPE_HOST


_cuda: _Cuda | None = None


def cuda() -> _Cuda:
    global _cuda
    if _cuda is None:
        _cuda = _Cuda()
    return _cuda


def _torch() -> Any:
    import torch

    return torch


def _boot_id() -> str:
    with open("/proc/sys/kernel/random/boot_id") as f:
        return f.read().strip()


def _files_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class _DeviceMemory:
    """A plain `cuMemAlloc` allocation, freed once nothing (no tensor over it) holds it.
    Torch sees it through the CUDA array interface, without a copy."""

    def __init__(self, nbytes: int, device: int) -> None:
        cu = cuda()
        pointer = ctypes.c_uint64()
        with cu.on(device):
            cu.check(cu.cuMemAlloc_v2(ctypes.byref(pointer), nbytes), f"allocating {nbytes} bytes on cuda:{device}")
        self.pointer, self.nbytes, self.device = pointer.value, nbytes, device
        weakref.finalize(self, _free, pointer.value, device)
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (pointer.value, False), "version": 2, "strides": None,
        }


def _free(pointer: int, device: int) -> None:
    with contextlib.suppress(Exception):  # at exit CUDA may be gone before us
        cu = cuda()
        with cu.on(device):
            cu.cuMemFree_v2(pointer)


@attrs.define(eq=False)
class _Registration:
    """`Region.handle`: where the memory is, and what this driver did to it."""

    pointer: int
    device: int | None  # None: host memory
    pinned: bool = False  # page-locked by us, to undo
    owner: Any = None  # the allocation, when this driver made it: kept while registered
    export: _OwnerFile | None = None
    ipc: bytes = b""  # the CUDA IPC handle, once exported
    descriptor: bytes | None = None


class _OwnerFile:
    """The owner's side of an exported region's liveness file: locked while exported."""

    def __init__(self, nbytes: int) -> None:
        self.path = os.path.join(_files_dir(), f"{_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.pwrite(self.fd, _RECORD.pack(_EXPORTED, nbytes), 0)

    def release(self, state: bytes) -> None:
        """Say why, then let go: readers see it at their next read."""
        if self.fd < 0:
            return
        os.pwrite(self.fd, state, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)  # drops the lock
        self.fd = -1


@attrs.define(eq=False)
class _Import:
    """`Remote.handle`: a peer's exported region, as this process sees it."""

    handle: bytes
    offset: int  # of the region in the exported allocation
    exported: int  # bytes, as the owner's file records them
    owner_pid: int
    fd: int  # the owner's file, read-only
    devices: set[int] = attrs.Factory(set)  # where this remote holds a mapping
    connected: bool = True

    def check_owner(self, what: str) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the owner holds its lock: alive, and the region still exported
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if os.pread(self.fd, 1, 0) == _DEREGISTERED:
            raise RegionNotRegisteredError(f"{what}: its owner deregistered it")
        raise PeerGoneError(f"{what}: its owner closed its transport or exited")


# Per process: a handle is opened once per (handle, device) however many remotes use it,
# and a handle exported by this very process is read through its own pointer.
_mappings: dict[tuple[bytes, int], list[int]] = {}  # -> [pointer, users]
_exported: dict[bytes, int] = {}  # handle -> base pointer


def _map(imp: _Import, device: int) -> int:
    """The base pointer of `imp`'s allocation in `device`'s address space."""
    if imp.handle in _exported and imp.owner_pid == os.getpid():
        return _exported[imp.handle]
    key = (imp.handle, device)
    entry = _mappings.get(key)
    if entry is None:
        cu = cuda()
        pointer = ctypes.c_uint64()
        with cu.on(device):
            handle = _Handle.from_buffer_copy(imp.handle)
            cu.check(cu.cuIpcOpenMemHandle_v2(ctypes.byref(pointer), handle, _LAZY_ENABLE_PEER_ACCESS),
                     f"opening a CUDA IPC handle on cuda:{device}")
            span = cu.address_range(pointer.value)
        if span is None or span[1] < imp.offset + imp.exported:
            with cu.on(device):
                cu.cuIpcCloseMemHandle(pointer.value)
            raise RegionNotRegisteredError(f"the mapped allocation is smaller than the {imp.exported} bytes exported")
        entry = _mappings[key] = [pointer.value, 0]
    if device not in imp.devices:
        imp.devices.add(device)
        entry[1] += 1
    return entry[0]


def _unmap(imp: _Import) -> None:
    for device in imp.devices:
        entry = _mappings.get((imp.handle, device))
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            del _mappings[(imp.handle, device)]
            with contextlib.suppress(Exception):
                cu = cuda()
                with cu.on(device):
                    cu.cuIpcCloseMemHandle(entry[0])
    imp.devices.clear()


@attrs.define(eq=False)
class _Wait:
    """A queued copy: its event, and its result once landed."""

    event: ctypes.c_void_p
    result: int | None = None  # the event's CUresult
    wake: anyio.Event | None = None  # set while a fence waits on it without polling


class _Lane:
    """A device's copy stream. Copies on it land in the order they were queued, so one
    poller marks every copy that landed, oldest first, and wakes whoever waits on them;
    when its own copy landed it hands polling on to one still waiting.

    The poller spins (yields without sleeping) while copies keep landing: an asyncio sleep
    shorter than a millisecond lasts a millisecond, longer than a 64 MiB device copy. After
    `_SPIN_S` without progress it sleeps a millisecond at a time."""

    def __init__(self, device: int) -> None:
        self.device = device
        cu = cuda()
        self.stream = ctypes.c_void_p()
        with cu.on(device):
            cu.check(cu.cuStreamCreate(ctypes.byref(self.stream), _STREAM_NON_BLOCKING), "creating a copy stream")
            self.context = cu._contexts[device]
        self._free: list[ctypes.c_void_p] = []
        self._all: list[ctypes.c_void_p] = []
        self._queue: deque[_Wait] = deque()  # copies not yet seen landed, oldest first
        self._waiting: dict[_Wait, None] = {}  # fences asleep, oldest first
        self._polling = False

    def copy(self, dst: int, src: int, nbytes: int) -> _Wait:
        """Queue the copy and an event after it; no wait. Raises with CUDA's error name."""
        cu = cuda()
        cu.cuCtxPushCurrent_v2(self.context)
        try:
            if not self._free:
                event = ctypes.c_void_p()
                cu.check(cu.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "creating an event")
                self._all.append(event)
                self._free.append(event)
            event = self._free.pop()
            cu.check(cu.cuMemcpyAsync(dst, src, nbytes, self.stream), "queueing the copy")
            cu.check(cu.cuEventRecord(event, self.stream), "queueing its event")
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        wait = _Wait(event)
        self._queue.append(wait)
        return wait

    async def fence(self, wait: _Wait) -> None:
        """Return once the copy landed (and so every copy queued before it)."""
        while wait.result is None:
            if self._polling:  # another fence polls: sleep until it wakes us
                wait.wake = anyio.Event()
                self._waiting[wait] = None
                try:
                    await wait.wake.wait()
                except BaseException:  # cancelled, perhaps just as it was woken to poll
                    self._waiting.pop(wait, None)
                    self._hand_on()
                    raise
                self._waiting.pop(wait, None)
                continue
            self._polling = True
            try:
                spun_since = time.monotonic()
                while wait.result is None:
                    if self._land():
                        spun_since = time.monotonic()
                    if wait.result is None:
                        await anyio.sleep(0 if time.monotonic() - spun_since < _SPIN_S else 0.001)
            finally:
                self._polling = False
                self._hand_on()  # done or cancelled: one still waiting polls next

    def _hand_on(self) -> None:
        if not self._polling:
            for other in self._waiting:
                if other.result is None and other.wake is not None:
                    other.wake.set()
                    return

    def _land(self) -> bool:
        """Mark every copy that landed, oldest first, and wake their fences."""
        cu = cuda()
        landed = False
        cu.cuCtxPushCurrent_v2(self.context)
        try:
            while self._queue:
                result = cu.cuEventQuery(self._queue[0].event)
                if result == _NOT_READY:
                    break
                wait = self._queue.popleft()
                wait.result = result
                self._free.append(wait.event)
                if wait.wake is not None:
                    wait.wake.set()
                landed = True
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        return landed

    def close(self) -> None:
        cu = cuda()
        with cu.on(self.device):
            for event in self._all:
                cu.cuEventDestroy_v2(event)
            cu.cuStreamDestroy_v2(self.stream)


def _device_index(device: str) -> int:
    torch = _torch()
    d = torch.device(device)
    if d.type != "cuda":
        raise InvalidArgumentError(f"{device!r} is not a CUDA device")
    return d.index if d.index is not None else torch.cuda.current_device()


class CudaIpcTransport(RegionTable, Transport):
    name = "cuda_ipc"
    reads_into_gpu = True

    def __init__(self, *, device: str | None = None) -> None:
        """`device` copies into host regions (default: the current CUDA device); reads into
        a GPU region run on that region's own GPU."""
        self._device = device
        self._index: int | None = None
        self._regions: dict[_Registration, Region] = {}
        self._imports: set[_Import] = set()
        self._lanes: dict[int, _Lane] = {}
        self._closed = False

    @classmethod
    def unavailable_reason(cls) -> str | None:
        try:
            torch = _torch()
        except ImportError as exc:
            return f"torch is not installed ({exc}); pip install 'weightpull[torch]'"
        if not torch.cuda.is_available():
            return f"no CUDA device here (torch {torch.__version__} sees none)"
        try:
            cuda()
        except (DriverUnavailableError, TransportError) as exc:
            return str(exc)
        return None

    @property
    def device(self) -> int:
        if self._index is None:
            self._index = _device_index(self._device or "cuda")
        return self._index

    # -- registration ---------------------------------------------------------------------

    def allocate(self, nbytes: int, device: str = "cpu") -> Region:
        """A GPU region is a plain device allocation, exportable; a host one is page-locked."""
        if device == "cpu":
            return self.register(mmap.mmap(-1, nbytes) if nbytes else bytearray())
        if not (device == "cuda" or device.startswith("cuda:")):
            raise InvalidArgumentError(f"cuda_ipc transport cannot allocate on {device!r} (cpu or cuda[:N])")
        index = _device_index(device)
        torch = _torch()
        if not nbytes:
            return self.register(torch.empty(0, dtype=torch.uint8, device=f"cuda:{index}"), f"cuda:{index}")
        owner = _DeviceMemory(nbytes, index)
        region = self.register(torch.as_tensor(owner, device=f"cuda:{index}"), f"cuda:{index}")
        region.handle.owner = owner
        return region

    def register(self, memory: Any, device: str = "cpu") -> Region:
        self._check_open()
        torch = _torch()
        if isinstance(memory, torch.Tensor):
            if not memory.is_contiguous():
                raise InvalidArgumentError("cuda_ipc transport needs a contiguous tensor")
            flat = memory.detach().reshape(-1).view(torch.uint8)
            if flat.is_cuda:
                where = f"cuda:{flat.device.index}"
                if device not in ("cpu", "cuda", where):
                    raise InvalidArgumentError(f"the tensor lives on {where}, not {device!r}")
                reg = _Registration(flat.data_ptr(), flat.device.index)
                return self._add(Region(nbytes=flat.numel(), device=where, memory=flat, handle=reg))
            if flat.device.type != "cpu" or device != "cpu":
                raise InvalidArgumentError(f"cuda_ipc transport registers host or CUDA tensors, not {flat.device} as {device!r}")
            view = memoryview(flat.numpy()) if flat.numel() else memoryview(bytearray())
            region = Region(nbytes=flat.numel(), device="cpu", memory=flat, view=view)
            if flat.is_pinned():  # by its allocator: nothing to do, or undo
                region.handle = _Registration(flat.data_ptr(), None)
                return self._add(region)
            return self._pin(region, flat.data_ptr())
        if device != "cpu":
            raise InvalidArgumentError(f"cuda_ipc transport registers {device!r} memory as a torch tensor only")
        try:
            view = memoryview(memory).cast("B")
        except TypeError as exc:
            raise InvalidArgumentError(f"cuda_ipc transport cannot register {type(memory).__name__}: {exc}") from exc
        if view.readonly:
            raise InvalidArgumentError("cuda_ipc transport needs writable memory")
        address = ctypes.addressof((ctypes.c_char * view.nbytes).from_buffer(view)) if view.nbytes else 0
        return self._pin(Region(nbytes=view.nbytes, device="cpu", memory=memory, view=view), address)

    def _pin(self, region: Region, address: int) -> Region:
        """Page-lock host memory once, so copies into it run at DMA speed."""
        pinned = False
        if region.nbytes:
            cu = cuda()
            with cu.on(self.device):
                result = cu.cuMemHostRegister_v2(address, region.nbytes, _HOSTREGISTER_PORTABLE)
            if result not in (0, _ALREADY_REGISTERED):  # already: pinned by its allocator
                cu.check(result, f"page-locking {region.nbytes} bytes of host memory")
            pinned = result == 0
        region.handle = _Registration(address, None, pinned)
        return self._add(region)

    def _add(self, region: Region) -> Region:
        self._regions[region.handle] = region
        return region

    def deregister(self, region: Region) -> None:
        reg = region.handle
        if self._regions.pop(reg, None) is None:
            return
        if reg.export is not None:
            _exported.pop(reg.ipc, None)
            reg.export.release(_DEREGISTERED)
        if reg.pinned:
            cu = cuda()
            with cu.on(self.device):
                cu.check(cu.cuMemHostUnregister(reg.pointer), f"unpinning {region.nbytes} bytes of host memory")
            reg.pinned = False

    def export(self, region: Region) -> bytes:
        """Export once: the same descriptor every time after."""
        reg = self._mine(region, "export")
        if reg.device is None:
            raise InvalidArgumentError("cuda_ipc exports GPU memory only: allocate the slot on a GPU (device='cuda')")
        if reg.descriptor is None:
            offset = 0
            if region.nbytes:
                cu = cuda()
                with cu.on(reg.device):
                    base, _ = cu.address_range(reg.pointer) or (reg.pointer, 0)
                    raw = _Handle()
                    result = cu.cuIpcGetMemHandle(ctypes.byref(raw), base)
                if result:
                    raise InvalidArgumentError(
                        f"CUDA cannot export that memory ({cu.error_name(result)}): CUDA IPC exports plain "
                        "device allocations, not expandable segments; let this transport allocate the slot")
                reg.ipc, offset = bytes(raw), reg.pointer - base  # all 64 bytes, NULs too
                _exported[reg.ipc] = base
            reg.export = _OwnerFile(region.nbytes)
            reg.descriptor = json.dumps({
                "cuda_ipc": 1, "handle": reg.ipc.hex(), "offset": offset, "nbytes": region.nbytes,
                "device": reg.device, "pid": os.getpid(), "boot": _boot_id(), "file": reg.export.path,
            }).encode()
        return reg.descriptor

    def connect(self, descriptor: bytes) -> Remote:
        self._check_open()
        try:
            d = json.loads(descriptor)
            handle, offset, nbytes = bytes.fromhex(d["handle"]), int(d["offset"]), int(d["nbytes"])
            pid, boot, path = int(d["pid"]), str(d["boot"]), str(d["file"])
            if d["cuda_ipc"] != 1 or not os.path.basename(path).startswith(_FILE_PREFIX) or len(handle) not in (0, 64):
                raise ValueError("unknown fields")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgumentError(f"not a cuda_ipc descriptor ({exc}): {bytes(descriptor[:80])!r}") from exc
        if boot != _boot_id():
            raise InvalidArgumentError("that region was exported on another host: CUDA IPC reads within one host")
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise RegionNotRegisteredError(
                "that region is no longer exported (deregistered, or its owner closed its transport)") from None
        _, exported = _RECORD.unpack(os.pread(fd, _RECORD.size, 0))
        imp = _Import(handle, offset, exported, pid, fd)
        self._imports.add(imp)
        return Remote(nbytes, descriptor, handle=imp)

    def disconnect(self, remote: Remote) -> None:
        if isinstance(remote.handle, _Import):
            self._drop(remote.handle)

    def _drop(self, imp: _Import) -> None:
        if not imp.connected:
            return
        imp.connected = False
        _unmap(imp)
        os.close(imp.fd)
        self._imports.discard(imp)

    # -- reading -------------------------------------------------------------------------

    async def read(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int) -> None:
        await self.read_many([(remote, remote_offset, local, local_offset, nbytes)])

    async def read_many(self, reads: Sequence[tuple[Remote, int, Region, int, int]]) -> None:
        """Queue every copy, then wait once per stream, for its last: copies land in order."""
        self._check_open()
        checked: set[_Import] = set()  # owners asked once per call
        waits: list[tuple[_Lane, _Wait]] = []
        for remote, remote_offset, local, local_offset, nbytes in reads:
            lane, dst, src = self._route(remote, remote_offset, local, local_offset, nbytes, checked)
            if nbytes:  # a copy queued before a later read fails lands unawaited: the lane drops it then
                waits.append((lane, lane.copy(dst, src, nbytes)))
        for lane, wait in {lane: wait for lane, wait in waits}.items():
            await lane.fence(wait)
        for (lane, wait), (remote, remote_offset, local, _, nbytes) in zip(waits, (r for r in reads if r[4])):
            if wait.result:
                raise TransportError(
                    f"reading [{remote_offset}, {remote_offset + nbytes}) of a region of process "
                    f"{remote.handle.owner_pid} into {local.device}: {cuda().error_name(wait.result)}")

    def _route(self, remote: Remote, remote_offset: int, local: Region, local_offset: int, nbytes: int,
               checked: set[_Import]) -> tuple[_Lane, int, int]:
        """Check one read; return (the lane that copies it, destination, source)."""
        imp = remote.handle
        if not isinstance(imp, _Import) or not imp.connected:
            raise InvalidArgumentError("that remote was not connected by this cuda_ipc transport, or was disconnected")
        reg = self._mine(local, "read into")
        check_span("remote", remote_offset, nbytes, remote.nbytes)
        check_span("local", local_offset, nbytes, local.nbytes)
        if imp not in checked:
            imp.check_owner(f"reading a region of process {imp.owner_pid}")
            checked.add(imp)
        check_span("exported", remote_offset, nbytes, imp.exported)  # the owner's record, not the descriptor's
        device = self.device if reg.device is None else reg.device
        lane = self._lanes.get(device)
        if lane is None:
            lane = self._lanes[device] = _Lane(device)
        source = _map(imp, device) + imp.offset + remote_offset if nbytes else 0
        return lane, reg.pointer + local_offset, source

    # -- lifetime ------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._closed:
            return
        for imp in list(self._imports):
            self._drop(imp)
        for region in list(self._regions.values()):
            if region.handle.export is not None:
                region.handle.export.release(_CLOSED)
            self.deregister(region)
        for lane in self._lanes.values():
            lane.close()
        self._lanes.clear()
        self._closed = True
