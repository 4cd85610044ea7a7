"""The CUDA driver API calls the driver makes, and libc's mmap, through ctypes."""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import weakref
from collections.abc import Iterator
from typing import Any

from weightpull.errors import DriverUnavailableError, TransportError

LAZY_ENABLE_PEER_ACCESS = 0x1
STREAM_NON_BLOCKING = 0x1
EVENT_DISABLE_TIMING = 0x2
HOSTREGISTER_PORTABLE = 0x1
HOSTREGISTER_READ_ONLY = 0x8
POINTER_MEMORY_TYPE = 2
MEMORYTYPE_HOST = 1
NOT_READY = 600
ALREADY_REGISTERED = 712


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class Cuda:
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
            "cuIpcGetMemHandle": [ctypes.POINTER(IpcHandle), u64],
            "cuIpcOpenMemHandle_v2": [ctypes.POINTER(u64), IpcHandle, ctypes.c_uint],
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
            result = self.cuPointerGetAttribute(ctypes.byref(kind), POINTER_MEMORY_TYPE, pointer)
        return result == 0 and kind.value == MEMORYTYPE_HOST


_cuda: Cuda | None = None


def cuda() -> Cuda:
    """The process's binding of the CUDA driver API, loaded on first use.

    Raises:
        DriverUnavailableError: libcuda.so.1 cannot load (no NVIDIA driver here).
    """
    global _cuda
    if _cuda is None:
        _cuda = Cuda()
    return _cuda


class DeviceMemory:
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
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (pointer.value, False),
            "version": 2,
            "strides": None,
        }


def _free(pointer: int, device: int) -> None:
    with contextlib.suppress(Exception):  # at exit CUDA may be gone before us
        cu = cuda()
        with cu.on(device):
            cu.cuMemFree_v2(pointer)


class Libc:
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


libc = Libc()
