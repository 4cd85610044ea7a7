"""The `cuda_ipc` driver: the same-host fast path, over CUDA's driver API (ctypes).

A GPU slot is a plain device allocation (`cuMemAlloc`; CUDA IPC cannot export the caching
allocator's expandable segments), exported once as a CUDA IPC handle. A reader process
opens each handle once, per GPU it reads into, and reads with device copies on a stream
of its own; a batch of reads awaits the event recorded after its last copy, so all bytes
have landed before the puller checks its lease. A reader on another GPU of the host maps
the handle with peer access and copies peer-to-peer.

A host slot is shared memory (a file in /dev/shm), page-locked by its owner and, read-only,
by each reader process, which maps it once: a reader's GPU then pulls it by DMA at the
host-to-device limit, with no copy through the CPU. Host regions that are not exported
(a reader's host mirror) are page-locked on registration.

CUDA keeps a handle mapped in a reader whatever its owner does, so the owner's liveness
travels beside it: a small file per exported region (in /dev/shm; a host slot's bytes
follow in the same file) on which the owner holds an exclusive lock while the region is
exported, with a byte saying why it let go. A read checks it first: deregistered ->
`RegionNotRegisteredError`; closed or died -> `PeerGoneError`. Files of owners that died
without closing are removed by the next transport made on the host.
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
import threading
import time
import warnings
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
_HOSTREGISTER_READ_ONLY = 0x8
_POINTER_MEMORY_TYPE = 2
_MEMORYTYPE_HOST = 1
_NOT_READY = 600
_ALREADY_REGISTERED = 712
_SPIN_S = 0.002
_MERGE_UP_TO = 1 << 30  # adjacent reads go as one copy up to this; the stream starts on the first meanwhile
_FILE_PREFIX = "weightpull-cuda-ipc-"
_RECORD = struct.Struct("<c7xQ")  # state, exported bytes
_EXPORTED, _DEREGISTERED, _CLOSED = b"A", b"D", b"C"
_DATA_OFFSET = mmap.ALLOCATIONGRANULARITY  # where a host slot's bytes start in its file


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
            "cuStreamSynchronize": [ptr],
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
    key: str = ""  # what readers map, once exported: the IPC handle (hex) or the host slot's file
    descriptor: bytes | None = None


class _OwnerFile:
    """The owner's side of an exported region's liveness file: locked while exported. With
    `data`, the file also holds the region's bytes (a host slot), mapped at `self.data`."""

    def __init__(self, nbytes: int, data: bool = False) -> None:
        self.path = os.path.join(_files_dir(), f"{_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}")
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        fcntl.flock(self.fd, fcntl.LOCK_EX)
        os.pwrite(self.fd, _RECORD.pack(_EXPORTED, nbytes), 0)
        self.data: Any = None
        if data:
            try:  # reserve it all now: a full /dev/shm fails here, not as SIGBUS mid-copy
                os.posix_fallocate(self.fd, 0, _DATA_OFFSET + nbytes)
            except OSError as exc:
                self.release(_CLOSED)
                raise TransportError(f"cannot reserve {nbytes} bytes of shared memory in {_files_dir()}: "
                                     f"{os.strerror(exc.errno or 0)}") from None
            self.data = mmap.mmap(self.fd, nbytes, offset=_DATA_OFFSET) if nbytes else bytearray()

    def release(self, state: bytes) -> None:
        """Say why, then let go: readers see it at their next read."""
        if self.fd < 0:
            return
        os.pwrite(self.fd, state, 0)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        os.close(self.fd)  # drops the lock
        self.fd = -1


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def sweep_dead_owners(directory: str | None = None) -> list[str]:
    """Remove the files of owners that died without closing (SIGKILL, say): a host slot's
    holds gigabytes of shared memory. A file goes when its owner's process is gone and no
    one holds its lock; a reader that still has it open reads `PeerGoneError`."""
    directory = directory or _files_dir()
    removed = []
    for name in os.listdir(directory):
        pid = name.removeprefix(_FILE_PREFIX).split("-")[0]
        if not name.startswith(_FILE_PREFIX) or not pid.isdigit() or _alive(int(pid)):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.unlink(path)
            removed.append(path)
        except OSError:  # locked after all (another pid namespace), or already gone
            pass
        finally:
            os.close(fd)
    return removed


class _Libc:
    """mmap(2) and munmap(2): a read-only shared mapping, by address (Python's mmap cannot
    hand out the address of a read-only map)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None, use_errno=True)
        self.mmap, self.munmap = lib.mmap, lib.munmap
        self.mmap.restype = ctypes.c_void_p
        self.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        self.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

    def map_read_only(self, fd: int, nbytes: int, offset: int) -> int:
        address = self.mmap(None, nbytes, mmap.PROT_READ, mmap.MAP_SHARED, fd, offset)
        if address in (None, ctypes.c_void_p(-1).value):
            raise TransportError(f"mapping {nbytes} bytes of a host slot: {os.strerror(ctypes.get_errno())}")
        return address


_libc = _Libc()


@attrs.define(eq=False)
class _Import:
    """`Remote.handle`: a peer's exported region, as this process sees it."""

    handle: bytes  # the CUDA IPC handle; empty for a host slot
    offset: int  # of the region in the exported allocation (or file)
    exported: int  # bytes, as the owner's file records them
    owner_pid: int
    fd: int  # the owner's file, read-only
    path: str
    host: bool = False  # a host slot, mapped from the owner's file
    devices: set[int] = attrs.Factory(set)  # where this remote holds a mapping
    mapped_host: bool = False
    connected: bool = True
    # what the owner exported: mapped once per process, however many remotes use it
    key: str = attrs.field(init=False, default=attrs.Factory(lambda s: s.path if s.host else s.handle.hex(), takes_self=True))

    def check_owner(self, what: str) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the owner holds its lock: alive, and the region still exported
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if os.pread(self.fd, 1, 0) == _DEREGISTERED:
            raise RegionNotRegisteredError(f"{what}: its owner deregistered it")
        raise PeerGoneError(f"{what}: its owner closed its transport or exited")


# Per process: an export is mapped once per (key, device) however many remotes use it (a
# host slot once, device -1), and one exported by this very process is read in place.
_mappings: dict[tuple[str, int], list[int]] = {}  # -> [pointer, users]
_exported: dict[str, int] = {}  # key -> base pointer
_host_lock = threading.Lock()  # host slots are mapped from worker threads


def _map(imp: _Import, device: int) -> int:
    """The base pointer of `imp`'s allocation in `device`'s address space."""
    if imp.key in _exported and imp.owner_pid == os.getpid():
        return _exported[imp.key]
    if imp.host:
        return _mappings[(imp.key, -1)][0]  # `_map_host` ran first
    key = (imp.key, device)
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


def _map_host(imp: _Import, device: int) -> None:
    """Map a host slot read-only and page-lock it, once per process: seconds for gigabytes,
    so the caller runs it in a worker thread."""
    with _host_lock:
        if imp.mapped_host or not imp.connected or (imp.key in _exported and imp.owner_pid == os.getpid()):
            return
        key = (imp.key, -1)
        entry = _mappings.get(key)
        if entry is None:
            if os.fstat(imp.fd).st_size < imp.offset + imp.exported:
                raise RegionNotRegisteredError(f"the host slot's file is shorter than the {imp.exported} bytes exported")
            address = _libc.map_read_only(imp.fd, imp.exported, imp.offset)
            cu = cuda()
            with cu.on(device):
                result = cu.cuMemHostRegister_v2(address, imp.exported, _HOSTREGISTER_PORTABLE | _HOSTREGISTER_READ_ONLY)
            if result:  # still readable, through the driver's own bounce buffers: slower
                warnings.warn(f"cuda_ipc: cannot page-lock a read-only host slot ({cu.error_name(result)}); "
                              "reads from it run below DMA speed", RuntimeWarning, stacklevel=2)
            entry = _mappings[key] = [address, 0, -1 if result else device]  # where it is pinned
        entry[1] += 1
        imp.mapped_host = True


def _unmap(imp: _Import) -> None:
    with _host_lock:  # not while a worker thread maps it
        _unmap_locked(imp)


def _unmap_locked(imp: _Import) -> None:
    keys = [(imp.key, d) for d in imp.devices] + ([(imp.key, -1)] if imp.mapped_host else [])
    for key in keys:
        entry = _mappings.get(key)
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            del _mappings[key]
            with contextlib.suppress(Exception):
                cu = cuda()
                if key[1] >= 0:
                    with cu.on(key[1]):
                        cu.cuIpcCloseMemHandle(entry[0])
                    continue
                if entry[2] >= 0:
                    with cu.on(entry[2]):
                        cu.cuMemHostUnregister(entry[0])
                _libc.munmap(entry[0], imp.exported)
    imp.devices.clear()
    imp.mapped_host = False


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
        """Queue a copy and an event after it; no wait. Raises with CUDA's error name.
        (An event per copy, not per batch: each one landing keeps the poller spinning.)"""
        cu = cuda()
        cu.cuCtxPushCurrent_v2(self.context)
        try:
            if not self._free:
                event = ctypes.c_void_p()
                cu.check(cu.cuEventCreate(ctypes.byref(event), _EVENT_DISABLE_TIMING), "creating an event")
                self._all.append(event)
                self._free.append(event)
            event = self._free[-1]
            cu.check(cu.cuMemcpyAsync(dst, src, nbytes, self.stream), f"queueing a copy of {nbytes} bytes")
            cu.check(cu.cuEventRecord(event, self.stream), "queueing its event")
            self._free.pop()
        finally:
            cu.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
        wait = _Wait(event)
        self._queue.append(wait)
        return wait

    def drain(self) -> None:
        """Block until every copy queued so far landed (milliseconds): a read that failed
        half-queued returns only once nothing more lands in its caller's memory."""
        cu = cuda()
        with contextlib.suppress(TransportError), cu.on(self.device):
            cu.cuStreamSynchronize(self.stream)

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
        sweep_dead_owners()

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
        """A GPU region is a plain device allocation; a host one is page-locked shared memory.
        Both are exportable."""
        if device == "cpu":
            self._check_open()
            shared = _OwnerFile(nbytes, data=True)
            try:
                region = self.register(shared.data)
            except BaseException:
                shared.release(_CLOSED)
                raise
            region.handle.export = shared  # the file is the region: it goes when the region does
            return region
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
        if reg.pinned:
            cu = cuda()
            with cu.on(self.device):
                cu.check(cu.cuMemHostUnregister(reg.pointer), f"unpinning {region.nbytes} bytes of host memory")
            reg.pinned = False
        if reg.export is not None:
            _exported.pop(reg.key, None)
            reg.export.release(_DEREGISTERED)

    def export(self, region: Region) -> bytes:
        """Export once: the same descriptor every time after."""
        reg = self._mine(region, "export")
        if reg.descriptor is None:
            reg.descriptor = self._export_host(region, reg) if reg.device is None else self._export_device(region, reg)
        return reg.descriptor

    def _export_host(self, region: Region, reg: _Registration) -> bytes:
        if reg.export is None or reg.export.data is None:
            raise InvalidArgumentError("cuda_ipc exports host memory it allocated itself (shared memory a reader "
                                       "can map): let this transport allocate the slot")
        reg.key = reg.export.path
        _exported[reg.key] = reg.pointer
        return self._descriptor(reg, "host", "", _DATA_OFFSET, region.nbytes)

    def _export_device(self, region: Region, reg: _Registration) -> bytes:
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
            reg.key, offset = bytes(raw).hex(), reg.pointer - base  # all 64 bytes, NULs too
            _exported[reg.key] = base
        reg.export = _OwnerFile(region.nbytes)
        return self._descriptor(reg, "device", reg.key, offset, region.nbytes)

    @staticmethod
    def _descriptor(reg: _Registration, memory: str, handle: str, offset: int, nbytes: int) -> bytes:
        assert reg.export is not None
        return json.dumps({
            "cuda_ipc": 1, "memory": memory, "handle": handle, "offset": offset, "nbytes": nbytes,
            "device": reg.device, "pid": os.getpid(), "boot": _boot_id(), "file": reg.export.path,
        }).encode()

    def connect(self, descriptor: bytes) -> Remote:
        self._check_open()
        try:
            d = json.loads(descriptor)
            handle, offset, nbytes = bytes.fromhex(d["handle"]), int(d["offset"]), int(d["nbytes"])
            pid, boot, path, host = int(d["pid"]), str(d["boot"]), str(d["file"]), d["memory"] == "host"
            if (d["cuda_ipc"] != 1 or d["memory"] not in ("host", "device") or len(handle) not in ((0,) if host else (0, 64))
                    or not os.path.basename(path).startswith(_FILE_PREFIX) or offset % mmap.ALLOCATIONGRANULARITY * host):
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
        imp = _Import(handle, offset, exported, pid, fd, path, host)
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
        """Check each read and queue its copy (reads adjacent on both sides merge into one),
        then wait once per stream, for its last copy: copies on a stream land in order."""
        self._check_open()
        checked: set[_Import] = set()  # owners asked once per call
        for imp in {r[0].handle for r in reads if r[4] and isinstance(r[0].handle, _Import)}:
            if imp.host and imp.connected and not imp.mapped_host and imp.key not in _exported:
                imp.check_owner(f"reading a region of process {imp.owner_pid}")  # before pinning gigabytes
                checked.add(imp)
                await anyio.to_thread.run_sync(_map_host, imp, self.device)
        gathering: dict[_Lane, list[Any]] = {}  # per lane: [dst, src, nbytes, remote, local] of the next copy
        last: dict[_Lane, _Wait] = {}  # per lane, its last copy queued
        try:
            for remote, remote_offset, local, local_offset, nbytes in reads:
                lane, dst, src = self._route(remote, remote_offset, local, local_offset, nbytes, checked)
                if not nbytes:
                    continue
                g = gathering.get(lane)
                if (g and g[3] is remote.handle and g[4] is local and g[0] + g[2] == dst and g[1] + g[2] == src
                        and g[2] + nbytes <= _MERGE_UP_TO):  # adjacent on both sides: one copy
                    g[2] += nbytes
                    continue
                if g:
                    last[lane] = lane.copy(*g[:3])
                gathering[lane] = [dst, src, nbytes, remote.handle, local]
            for lane, g in gathering.items():
                last[lane] = lane.copy(*g[:3])
        except BaseException:
            for lane in last:
                lane.drain()
            raise
        for lane, wait in last.items():
            await lane.fence(wait)
        for lane, wait in last.items():
            if wait.result:
                owners = sorted({r[0].handle.owner_pid for r in reads})
                raise TransportError(f"reading {len(reads)} span(s) of regions of process(es) {owners} "
                                     f"on cuda:{lane.device}: {cuda().error_name(wait.result)}")

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
        base = _map(imp, device) + (0 if imp.host else imp.offset) if nbytes else 0  # a host map starts at its offset
        source = base + remote_offset if nbytes else 0
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
