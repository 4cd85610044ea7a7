"""What a reader process maps of its peers' exports: each once, however many remotes use it."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import threading
import warnings
from typing import Any

import attrs

from weightpull.errors import PeerGoneError, RegionNotRegisteredError

from .driver_api import HOSTREGISTER_PORTABLE, HOSTREGISTER_READ_ONLY, LAZY_ENABLE_PEER_ACCESS, IpcHandle, cuda, libc
from .owners import DEREGISTERED


@attrs.define(eq=False)
class Import:
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
    views: dict[str, Any] = attrs.Factory(dict)  # device -> the Region `view` made, made once
    connected: bool = True
    # what the owner exported: mapped once per process, however many remotes use it
    key: str = attrs.field(
        init=False, default=attrs.Factory(lambda s: s.path if s.host else s.handle.hex(), takes_self=True)
    )

    @property
    def in_place(self) -> bool:
        """Exported by this very process: read through the owner's own pointer, not mapped."""
        return self.key in own_exports and self.owner_pid == os.getpid()

    @property
    def needs_host_map(self) -> bool:
        return self.host and self.connected and not self.mapped_host and not self.in_place

    def check_owner(self, what: str) -> None:
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # the owner holds its lock: alive, and the region still exported
        fcntl.flock(self.fd, fcntl.LOCK_UN)
        if os.pread(self.fd, 1, 0) == DEREGISTERED:
            raise RegionNotRegisteredError(f"{what}: its owner deregistered it")
        raise PeerGoneError(f"{what}: its owner closed its transport or exited")


# Per process: an export is mapped once per (key, device) however many remotes use it (a
# host slot once, device -1), and one exported by this very process is read in place.
mapped: dict[
    tuple[str, int], list[int]
] = {}  # -> [pointer, users]; a host slot's also the device that locked it, or -1
own_exports: dict[str, int] = {}  # this process's exports: key -> base pointer
_host_lock = threading.Lock()  # host slots are mapped from worker threads


def map_device(imp: Import, device: int) -> int:
    """The base pointer of `imp`'s export as `device` reads it (a host slot: its mapping)."""
    if imp.in_place:
        return own_exports[imp.key]
    if imp.host:
        return mapped[(imp.key, -1)][0]  # `map_host` ran first
    key = (imp.key, device)
    entry = mapped.get(key)
    if entry is None:
        cu = cuda()
        pointer = ctypes.c_uint64()
        with cu.on(device):
            handle = IpcHandle.from_buffer_copy(imp.handle)
            cu.check(
                cu.cuIpcOpenMemHandle_v2(ctypes.byref(pointer), handle, LAZY_ENABLE_PEER_ACCESS),
                f"opening a CUDA IPC handle on cuda:{device}",
            )
            span = cu.address_range(pointer.value)
        if span is None or span[1] < imp.offset + imp.exported:
            with cu.on(device):
                cu.cuIpcCloseMemHandle(pointer.value)
            raise RegionNotRegisteredError(f"the mapped allocation is smaller than the {imp.exported} bytes exported")
        entry = mapped[key] = [pointer.value, 0]
    if device not in imp.devices:
        imp.devices.add(device)
        entry[1] += 1
    return entry[0]


def map_host(imp: Import, device: int) -> None:
    """Map a host slot read-only and page-lock it, once per process: seconds for gigabytes,
    so the caller runs it in a worker thread."""
    with _host_lock:
        if not imp.needs_host_map:
            return
        key = (imp.key, -1)
        entry = mapped.get(key)
        if entry is None:
            if os.fstat(imp.fd).st_size < imp.offset + imp.exported:
                raise RegionNotRegisteredError(
                    f"the host slot's file is shorter than the {imp.exported} bytes exported"
                )
            address = libc.map_read_only(imp.fd, imp.exported, imp.offset)
            cu = cuda()
            with cu.on(device):
                result = cu.cuMemHostRegister_v2(address, imp.exported, HOSTREGISTER_PORTABLE | HOSTREGISTER_READ_ONLY)
            if result:  # still readable, through the driver's own bounce buffers: slower
                warnings.warn(
                    f"cuda_ipc: cannot page-lock a read-only host slot ({cu.error_name(result)}); "
                    "reads from it run below DMA speed",
                    RuntimeWarning,
                    stacklevel=2,
                )
            entry = mapped[key] = [address, 0, -1 if result else device]  # where it is pinned
        entry[1] += 1
        imp.mapped_host = True


def unmap(imp: Import) -> None:
    with _host_lock:  # not while a worker thread maps it
        _unmap_locked(imp)


def _unmap_locked(imp: Import) -> None:
    keys = [(imp.key, d) for d in imp.devices] + ([(imp.key, -1)] if imp.mapped_host else [])
    for key in keys:
        entry = mapped.get(key)
        if entry is None:
            continue
        entry[1] -= 1
        if entry[1] == 0:
            del mapped[key]
            with contextlib.suppress(Exception):
                cu = cuda()
                if key[1] >= 0:
                    with cu.on(key[1]):
                        cu.cuIpcCloseMemHandle(entry[0])
                    continue
                if entry[2] >= 0:
                    with cu.on(entry[2]):
                        cu.cuMemHostUnregister(entry[0])
                libc.munmap(entry[0], imp.exported)
    imp.devices.clear()
    imp.views.clear()
    imp.mapped_host = False
